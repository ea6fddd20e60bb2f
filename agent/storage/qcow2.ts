/**
 * qcow2 helpers for snapshot chains (qemu-img). Every path here is one we made; none may hold a
 * ',' (QEMU option syntax), which the launcher checks too.
 */
import { spawn } from "node:child_process";
import { constants, existsSync } from "node:fs";
import { copyFile, rename } from "node:fs/promises";
import { basename, dirname, join } from "node:path";
import { StorageError } from "./chain.ts";

/**
 * Chains deeper than this are flattened: every extra level costs a lookup per cluster miss and
 * an open file per VM, and QEMU reads the whole chain's L1 tables at open. 8 keeps a fork of a
 * fork ... cheap (a few ms of open time) while still letting most families share their layers.
 */
export const MAX_CHAIN_DEPTH = 8;

export function runQemuImg(args: string[]): Promise<string> {
  return new Promise((resolve, reject) => {
    const child = spawn("qemu-img", args, { stdio: ["ignore", "pipe", "pipe"] });
    let out = "";
    let err = "";
    child.stdout?.on("data", (d: Buffer) => {
      out += d.toString();
    });
    child.stderr?.on("data", (d: Buffer) => {
      err = (err + d.toString()).slice(-4000);
    });
    child.on("error", (e) => reject(new StorageError(`cannot run qemu-img: ${e.message}`, { cause: e })));
    child.on("close", (code) => {
      if (code === 0) resolve(out);
      else reject(new StorageError(`qemu-img ${args.join(" ")} failed (exit ${code}): ${err.trim()}`));
    });
  });
}

/** Virtual size in bytes of an image (`-U`: it may be open in a running QEMU). */
export async function virtualSize(path: string): Promise<number> {
  const out = await runQemuImg(["info", "-U", "--output=json", path]);
  const size = (JSON.parse(out) as { "virtual-size"?: number })["virtual-size"];
  if (typeof size !== "number") throw new StorageError(`qemu-img info ${path}: no virtual size`);
  return size;
}

/**
 * A new overlay on `backing`. `-u` with an explicit size: qemu-img does not open the backing
 * file, which a running parent QEMU may hold locked.
 */
export async function createOverlayOn(backing: string, path: string, sizeBytes: number): Promise<void> {
  if (path.includes(",") || backing.includes(","))
    throw new StorageError(`image paths may not contain ',': ${path} ${backing}`);
  await runQemuImg([
    "create",
    "-q",
    "-f",
    "qcow2",
    "-F",
    "qcow2",
    "-b",
    backing,
    "-u",
    path,
    String(sizeBytes),
  ]);
}

/**
 * Copies the data of `top`'s whole chain above `base` into a new image `out` backed directly by
 * `base` (a chain of depth 1). `top` and its chain must be frozen (no writer).
 */
export async function flattenOnto(top: string, base: string, out: string): Promise<void> {
  await runQemuImg([
    "convert",
    "-U",
    "-q",
    "-f",
    "qcow2",
    "-O",
    "qcow2",
    "-F",
    "qcow2",
    "-B",
    base,
    top,
    out,
  ]);
}

/** Name of the pristine overlay kept beside a template's disk (see createOverlayFromBlank). */
export function blankOverlayPath(backing: string, sizeBytes: number): string {
  return join(dirname(backing), `blank-${basename(backing, ".qcow2")}-${sizeBytes}.qcow2`);
}

/**
 * A new empty overlay on `backing`, made by copying a pristine one kept beside `backing`
 * (created once, atomically). Spawning runs this on every sandbox: a `qemu-img create` costs a
 * 10-20 ms subprocess, which was most of the gap between our spawn and a bare QEMU restore; a
 * 200 KB copy costs well under a millisecond. Only for backing files that never change (a
 * template's frozen disk): the blank records the backing path and size, nothing else. The
 * owner of `backing` removes the blank with it (deleteTemplate).
 */
export async function createOverlayFromBlank(
  backing: string,
  path: string,
  sizeBytes: number,
): Promise<void> {
  const blank = blankOverlayPath(backing, sizeBytes);
  if (!existsSync(blank)) {
    const tmp = `${blank}.${process.pid}.${Date.now()}.tmp`;
    await createOverlayOn(backing, tmp, sizeBytes);
    await rename(tmp, blank); // two racing spawns both write a valid blank; either one wins
  }
  await copyFile(blank, path, constants.COPYFILE_EXCL);
}
