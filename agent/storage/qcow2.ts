/**
 * qcow2 helpers for snapshot chains (qemu-img). Every path here is one we made; none may hold a
 * ',' (QEMU option syntax), which the launcher checks too.
 */
import { constants, existsSync } from "node:fs";
import { copyFile, rename } from "node:fs/promises";
import { basename, dirname, join } from "node:path";
import { runTool, ToolError } from "../host/tool.ts";
import { StorageError } from "./chain.ts";

/**
 * Chains deeper than this are flattened: every extra level costs a lookup per cluster miss and
 * an open file per VM, and QEMU reads the whole chain's L1 tables at open. 8 keeps a fork of a
 * fork ... cheap (a few ms of open time) while still letting most families share their layers.
 */
export const MAX_CHAIN_DEPTH = 8;

/**
 * Runs qemu-img (agent/host/tool.ts: deadline, bounded output) and returns its stdout; a failure
 * is a StorageError carrying the ToolError as its cause.
 */
async function runQemuImg(args: string[]): Promise<string> {
  try {
    return (await runTool(["qemu-img", ...args])).stdout.toString("utf8");
  } catch (err) {
    if (!(err instanceof ToolError)) throw err;
    const message =
      err.kind === "exit" && err.details.exitCode != null
        ? `qemu-img ${args.join(" ")} failed (exit ${err.details.exitCode}): ${err.details.output ?? ""}`
        : err.kind === "spawn"
          ? err.message
          : `qemu-img ${args.join(" ")}: ${err.message}`;
    throw new StorageError(message, { cause: err });
  }
}

/** Virtual size in bytes of an image (`-U`: it may be open in a running QEMU). */
export async function virtualSize(path: string): Promise<number> {
  const out = await runQemuImg(["info", "-U", "--output=json", path]);
  const size = (JSON.parse(out) as { "virtual-size"?: number })["virtual-size"];
  if (typeof size !== "number") throw new StorageError(`qemu-img info ${path}: no virtual size`);
  return size;
}

/**
 * A new qcow2 overlay on `backing` (a qcow2 too). The only place overlays are made. With
 * `sizeBytes`: `-u`, qemu-img does not open the backing file, which a running parent QEMU may hold
 * locked (a fork's frozen layer, a template's disk). Without: qemu-img opens `backing` to take its
 * size, for a backing file nobody runs on (an image's base disk).
 */
export async function createOverlayOn(backing: string, path: string, sizeBytes?: number): Promise<void> {
  if (path.includes(",") || backing.includes(","))
    throw new StorageError(`image paths may not contain ',': ${path} ${backing}`);
  const target = sizeBytes === undefined ? [path] : ["-u", path, String(sizeBytes)];
  await runQemuImg(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", backing, ...target]);
}

/**
 * Copies the data of `top`'s whole chain above `base` into a new image `out` backed directly by
 * `base` (a chain of depth 1). `top` and its chain must be frozen (no writer). `below` is that
 * chain, nearest first, ending with `base`, as the agent's records have it: qemu-img is handed
 * every layer by name (`--image-opts`, one `backing.` level per layer) and never follows a
 * backing name from a header, which a jail that had a layer could have rewritten; a layer
 * whose header names another file is read as the records say. `top` itself is never opened
 * to take its size: `sizeBytes` is the VM's.
 *
 * Not `qemu-img convert -B base`: convert assumes the output's new backing holds what the
 * source's own backing holds, so it copies only the clusters allocated in `top` itself and
 * drops every layer between `top` and `base` (a fork past MAX_CHAIN_DEPTH read zeros where
 * its grandparents had written). Instead `out` starts as an empty overlay on `top` and is
 * rebased onto `base` in safe mode: qemu-img compares the old chain with `base` and writes
 * into `out` every cluster where they differ, from all layers.
 */
export async function flattenOnto(
  top: string,
  below: readonly string[],
  out: string,
  sizeBytes: number,
): Promise<void> {
  const base = below.at(-1);
  if (base === undefined) throw new StorageError(`flattening ${top}: no base disk`);
  const layers = [out, top, ...below];
  if (layers.some((p) => p.includes(",")))
    throw new StorageError(`image paths may not contain ',': ${layers.join(" ")}`);
  await createOverlayOn(top, out, sizeBytes);
  // The base disk (the image store's, never a jail's) keeps its own backing, if any.
  const opts = layers.map((p, i) => {
    const at = "backing.".repeat(i);
    return `${at}driver=qcow2,${at}file.driver=file,${at}file.filename=${p}`;
  });
  await runQemuImg(["rebase", "-U", "-q", "--image-opts", "-F", "qcow2", "-b", base, opts.join(",")]);
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

/**
 * Rewrites the backing name in `path`'s header to `backing` (qcow2) without opening either
 * image's data (`-u`): for an overlay whose backing file moved, here a copied template's overlay
 * arriving beside its own copied base. Neither the old name nor the new file is read.
 */
export async function rebaseUnsafe(path: string, backing: string): Promise<void> {
  if (path.includes(",") || backing.includes(","))
    throw new StorageError(`image paths may not contain ',': ${path} ${backing}`);
  await runQemuImg(["rebase", "-q", "-u", "-f", "qcow2", "-F", "qcow2", "-b", backing, path]);
}
