/**
 * Templates: a booted, optionally warmed-up VM frozen to disk so that sandboxes start by
 * restoring it instead of booting.
 *
 *   boot (RAM = memory-backend-file share=on at <shmRoot>/tpl-<id>.mem, disk = a new overlay)
 *   -> ready command (docs/templates.md "Rules of templates": starts a service detached, blocks until healthy, exits 0)
 *   -> guest sync -> QMP stop -> x-ignore-shared -> migrate device state to `state` -> kill QEMU
 *
 * x-ignore-shared leaves the shared RAM block out of the stream: RAM is already in the file, so
 * the state is ~60 KB and written in ~10 ms (measured under TCG, 256 MiB guest). Children map that file
 * private (copy-on-write): clean pages stay shared in the page cache.
 *
 * On disk: `<dataDir>/templates/<id>/{disk.qcow2 (frozen, 0444), state, meta.json}` + the RAM
 * file. meta.json records the state: building -> ready | failed (with the error). A failed build
 * removes its files and keeps meta.json so the caller can read why; `deleteTemplate` frees all.
 */

import { createHash, randomBytes } from "node:crypto";
import { chmod, mkdir, readdir, readFile, rename, rm, rmdir, stat, writeFile } from "node:fs/promises";
import { join, resolve } from "node:path";
import { MAX_MEM_MIB, MAX_VCPUS, MIN_MEM_MIB, MIN_VCPUS } from "../../contracts/api/limits.ts";
import { bestEffort } from "../../contracts/best-effort.ts";
import { needFreeSpace } from "../../contracts/disk-space.ts";
import type { GuestArtifacts } from "../guest/artifacts.ts";
import type { GuestClient } from "../guest/client.ts";
import type { ImageConfig, ImportedImage } from "../image/import.ts";
import type { Accel } from "../qemu/launch.ts";
import { launchVm, type VmProcess } from "../qemu/launch.ts";
import { openChainStore } from "../storage/chain.ts";
import { createOverlayOn, virtualSize } from "../storage/qcow2.ts";
import { DEFAULT_VM_HOST, type VmHostSettings } from "../vm/host-settings.ts";
import { claimVm } from "../vm/process.ts";
import { createVmDir, removeVmDir, vmsRoot } from "../vm/workdir.ts";
import { asSnapshotError, fail, ok, type Result, SnapshotError } from "./errors.ts";
import { digZeroHoles } from "./sparse.ts";
import {
  connectBuildGuest,
  registerTemplateFiles,
  runReadyCommand,
  saveDeviceState,
} from "./template-steps.ts";

export type TemplateState = "building" | "ready" | "failed";

export interface TemplateMeta {
  id: string;
  state: TemplateState;
  error?: { code: string; message: string; details?: Record<string, unknown> };
  imageDigest: string;
  config: ImageConfig;
  baseDisk: string;
  disk: string;
  diskBytes: number;
  statePath: string;
  memPath: string;
  shmRoot: string;
  memMib: number;
  vcpus: number;
  accel: Accel;
  artifacts: GuestArtifacts;
  readyCmd?: string[];
  createdAt: string;
  /**
   * Readiness telemetry of the build (ms): boot (QEMU start to HELLO), ready command, snapshot
   * (sync + stop + device-state save), distribute (registering the files with the chain store),
   * total (overlay creation to ready).
   */
  timings?: {
    bootMs: number;
    readyCmdMs: number;
    snapshotMs: number;
    distributeMs?: number;
    totalMs: number;
  };
  /** Saved device state, bytes. */
  stateBytes?: number;
  /** Allocated bytes of the RAM file (tmpfs) and of the frozen overlay at freeze time. */
  memFileBytes?: number;
  diskFileBytes?: number;
}

export interface BuildTemplateOptions {
  dataDir: string;
  image: ImportedImage;
  artifacts: GuestArtifacts;
  accel: Accel;
  id?: string;
  /** Guest RAM, MiB (default 256). */
  memMib?: number;
  /** Default 1. */
  vcpus?: number;
  /** argv run in the image's env/cwd/user before the freeze; non-zero or timeout fails the build. */
  readyCmd?: string[];
  /** Default 60 s (the API leaves it to the caller, docs/templates.md "Rules of templates"; a service that is not healthy in a minute is broken). */
  readyTimeoutMs?: number;
  /** Added to (and overriding) the image's Env for the ready command only (sandboxes API `ready.env`). */
  readyEnv?: Record<string, string>;
  /** Called when the frozen files start being registered for restores (bake phase Distributing). */
  onDistributing?: () => void;
  /** QEMU start to the guest agent's HELLO. Default 60 s: a cold boot takes ~3 s under TCG. */
  bringupTimeoutMs?: number;
  /** tmpfs directory for RAM files (default `defaultShmRoot(dataDir)`). */
  shmRoot?: string;
  /** The operator's jail and disk-reserve settings; default DEFAULT_VM_HOST. */
  host?: VmHostSettings;
  log?: (m: string) => void;
  /**
   * Ends the build (the template was deleted): a ready command in flight is cancelled in the
   * guest and the build fails, so its VM and files go as for any failed build.
   */
  signal?: AbortSignal;
}

const DEFAULT_MEM_MIB = 256;
/** The ready command's deadline when the template names none (`SANDBOXD_READY_TIMEOUT`). */
export const DEFAULT_READY_TIMEOUT_MS = 60_000;
/** Cold boot to the guest agent's HELLO (`SANDBOXD_BOOT_TIMEOUT`); ~3 s under TCG. */
export const DEFAULT_BRINGUP_TIMEOUT_MS = 60_000;
const ID_RE = /^[a-z0-9][a-z0-9-]{0,40}$/;

/** `/dev/shm/sandboxd/<hash of the data dir>`: RAM files of one data dir, apart from others'. */
export function defaultShmRoot(dataDir: string): string {
  const h = createHash("sha256").update(resolve(dataDir)).digest("hex").slice(0, 12);
  return join("/dev/shm/sandboxd", h);
}

export function templatesRoot(dataDir: string): string {
  return join(dataDir, "templates");
}

/** `<dataDir>/templates/<id>`: a template's files (its RAM file is on tmpfs, `memPath`). */
export function templateDirOf(dataDir: string, id: string): string {
  return join(templatesRoot(dataDir), id);
}

/** Writes a template's meta.json whole (temp file + rename): a crash leaves the old or the new. */
export async function writeMeta(meta: TemplateMeta): Promise<void> {
  const dir = join(meta.disk, "..");
  const tmp = join(dir, "meta.json.tmp");
  await writeFile(tmp, JSON.stringify(meta, null, 1));
  await rename(tmp, join(dir, "meta.json"));
}

/**
 * Disk a template build is expected to write in the data dir beyond its RAM file: the device
 * state (~67 KB) and the overlay's growth during boot and the ready command. 64 MiB covers a
 * package install's worth; a build that writes more meets ENOSPC, reported the same way.
 */
const TEMPLATE_DISK_ESTIMATE_BYTES = 64 * 1024 * 1024;

/** A template's RAM and vCPUs out of the range a VM may have: `bad_request`. */
function checkSize(memMib: number, vcpus: number): SnapshotError | undefined {
  if (!Number.isInteger(memMib) || memMib < MIN_MEM_MIB || memMib > MAX_MEM_MIB)
    return new SnapshotError(
      "bad_request",
      `memMib must be an integer in ${MIN_MEM_MIB}..${MAX_MEM_MIB}, got ${memMib}`,
    );
  if (!Number.isInteger(vcpus) || vcpus < MIN_VCPUS || vcpus > MAX_VCPUS)
    return new SnapshotError(
      "bad_request",
      `vcpus must be an integer in ${MIN_VCPUS}..${MAX_VCPUS}, got ${vcpus}`,
    );
  return undefined;
}

/**
 * The template's directory and its meta.json in state `building`, once the RAM file and the
 * disk have room; a taken id is `bad_request`.
 */
async function newTemplateDir(
  o: BuildTemplateOptions,
  dataDir: string,
  id: string,
  memMib: number,
  vcpus: number,
): Promise<Result<TemplateMeta>> {
  const shmRoot = o.shmRoot ?? defaultShmRoot(dataDir);
  const dir = templateDirOf(dataDir, id);
  try {
    // Asked before anything is created: the RAM file fills guest RAM on tmpfs; the disk holds the
    // device state and what the ready command writes on the overlay.
    const reserve = (o.host ?? DEFAULT_VM_HOST).diskReserveBytes;
    await needFreeSpace(shmRoot, "the template's memory file", memMib * 1024 * 1024, reserve);
    await needFreeSpace(dataDir, "the template's disk", TEMPLATE_DISK_ESTIMATE_BYTES, reserve);
  } catch (err) {
    return fail(asSnapshotError(err, "template_build_failed", `building template ${id} failed`));
  }
  try {
    await mkdir(templatesRoot(dataDir), { recursive: true });
    await mkdir(dir); // EEXIST: the id is taken
  } catch (err) {
    return fail(asSnapshotError(err, "bad_request", `template ${id} cannot be created`));
  }
  await mkdir(shmRoot, { recursive: true, mode: 0o700 });
  const meta: TemplateMeta = {
    id,
    state: "building",
    imageDigest: o.image.digest,
    config: o.image.config,
    baseDisk: o.image.disk,
    disk: join(dir, "disk.qcow2"),
    diskBytes: 0,
    statePath: join(dir, "state"),
    memPath: join(shmRoot, `tpl-${id}.mem`),
    shmRoot,
    memMib,
    vcpus,
    accel: o.accel,
    artifacts: o.artifacts,
    ...(o.readyCmd ? { readyCmd: o.readyCmd } : {}),
    createdAt: new Date().toISOString(),
  };
  await writeMeta(meta);
  return ok(meta);
}

export async function buildTemplate(o: BuildTemplateOptions): Promise<Result<TemplateMeta>> {
  const log = o.log ?? (() => {});
  const id = o.id ?? `tpl-${randomBytes(6).toString("hex")}`;
  if (!ID_RE.test(id))
    return fail(new SnapshotError("bad_request", `invalid template id ${JSON.stringify(id)}`));
  const memMib = o.memMib ?? DEFAULT_MEM_MIB;
  const vcpus = o.vcpus ?? 1;
  const badSize = checkSize(memMib, vcpus);
  if (badSize) return fail(badSize);
  const dataDir = resolve(o.dataDir);
  const made = await newTemplateDir(o, dataDir, id, memMib, vcpus);
  if (!made.ok) return made;
  const meta = made.value;

  const vmId = `${id}-build`;
  const vmDir = join(vmsRoot(dataDir), vmId);
  let vm: VmProcess | undefined;
  let guest: GuestClient | undefined;
  const t0 = performance.now();
  try {
    await createOverlayOn(o.image.disk, meta.disk);
    meta.diskBytes = await virtualSize(meta.disk);
    await createVmDir(dataDir, vmId);
    vm = await launchVm({
      dir: vmDir,
      artifacts: o.artifacts,
      disk: meta.disk,
      memMib,
      vcpus,
      accel: o.accel,
      hostname: "template",
      memBackend: { path: meta.memPath, share: true },
      ...(o.host ? { jail: o.host.jail } : {}),
      log,
    });
    await claimVm(vmDir, vm.pid, vm.jailUid);
    const bringupMs = o.bringupTimeoutMs ?? DEFAULT_BRINGUP_TIMEOUT_MS;
    guest = await connectBuildGuest(vm, bringupMs);
    const tBoot = performance.now();
    if (o.signal?.aborted) throw new SnapshotError("template_build_failed", "the build was cancelled");
    if (o.readyCmd) {
      const timeoutMs = o.readyTimeoutMs ?? DEFAULT_READY_TIMEOUT_MS;
      await runReadyCommand(guest, o.readyCmd, o.image.config, {
        timeoutMs,
        env: o.readyEnv,
        signal: o.signal,
      });
    }
    const tReady = performance.now();
    // Everything the guest wrote reaches the overlay before the overlay is frozen.
    await guest.sync();
    const tSnap = performance.now();
    meta.stateBytes = await saveDeviceState(vm, meta.statePath, memMib);
    const snapshotMs = performance.now() - tSnap;
    guest.close();
    guest = undefined;
    await vm.kill();
    vm = undefined;
    await removeVmDir(vmDir);
    await chmod(meta.disk, 0o444);
    // The guest zeroed more pages than it kept data in; with the QEMU that wrote the file gone,
    // its zero pages go back to holes (sparse.ts): only pages with data cost host memory.
    await digZeroHoles(meta.memPath, log);
    const [memStat, diskStat] = await Promise.all([stat(meta.memPath), stat(meta.disk)]);
    meta.memFileBytes = memStat.blocks * 512;
    meta.diskFileBytes = diskStat.blocks * 512;
    const tDistribute = performance.now();
    o.onDistributing?.();
    await registerTemplateFiles(dataDir, id, meta);
    meta.state = "ready";
    meta.timings = {
      bootMs: tBoot - t0,
      readyCmdMs: tReady - tBoot,
      snapshotMs,
      distributeMs: performance.now() - tDistribute,
      totalMs: performance.now() - t0,
    };
    await writeMeta(meta);
    log(`template ${id} ready: snapshot ${snapshotMs.toFixed(0)} ms, state ${meta.stateBytes} B`);
    return ok(meta);
  } catch (err) {
    const e = asSnapshotError(err, "template_build_failed", `building template ${id} failed`);
    guest?.close();
    await vm?.kill();
    await removeVmDir(vmDir);
    await removeTemplateFiles(meta);
    meta.state = "failed";
    meta.error = { code: e.code, message: e.message, ...(e.details ? { details: e.details } : {}) };
    await bestEffort(log, `recording template ${id} as failed`, writeMeta(meta));
    log(`template ${id} failed: ${e.message}`);
    return fail(e);
  }
}

/** Removes the files of a template that never became ready (a failed build or copy). */
export async function removeTemplateFiles(meta: TemplateMeta): Promise<void> {
  await Promise.all([meta.disk, meta.statePath, meta.memPath].map((p) => rm(p, { force: true })));
}

/** Reads a template's meta.json (after a restart too). Not ready -> `template_not_ready`. */
export async function loadTemplate(dataDir: string, id: string): Promise<Result<TemplateMeta>> {
  if (!ID_RE.test(id))
    return fail(new SnapshotError("template_not_found", `no template ${JSON.stringify(id)}`));
  let meta: TemplateMeta;
  try {
    meta = JSON.parse(
      await readFile(join(templateDirOf(resolve(dataDir), id), "meta.json"), "utf8"),
    ) as TemplateMeta;
  } catch (err) {
    return fail(new SnapshotError("template_not_found", `no template ${id}`, { cause: err }));
  }
  if (meta.state !== "ready")
    return fail(
      new SnapshotError("template_not_ready", `template ${id} is ${meta.state}`, {
        details: { state: meta.state, error: meta.error },
      }),
    );
  return ok(meta);
}

/** Every template's meta, whatever its state. */
export async function listTemplates(dataDir: string): Promise<TemplateMeta[]> {
  const root = templatesRoot(resolve(dataDir));
  let ids: string[] = [];
  try {
    ids = await readdir(root);
  } catch {
    return [];
  }
  const out: TemplateMeta[] = [];
  for (const id of ids) {
    try {
      out.push(JSON.parse(await readFile(join(root, id, "meta.json"), "utf8")) as TemplateMeta);
    } catch {
      // a build in its first milliseconds, or debris: not a template
    }
  }
  return out;
}

/**
 * Deletes a template. Its files are freed now when no VM uses them, else when the last VM
 * spawned from it ends (the chain store's reference counts): children never lose their RAM file.
 */
export async function deleteTemplate(dataDir: string, id: string): Promise<Result<void>> {
  const abs = resolve(dataDir);
  const dir = templateDirOf(abs, id);
  if (!ID_RE.test(id))
    return fail(new SnapshotError("template_not_found", `no template ${JSON.stringify(id)}`));
  try {
    await stat(join(dir, "meta.json"));
  } catch (err) {
    return fail(new SnapshotError("template_not_found", `no template ${id}`, { cause: err }));
  }
  const chain = await openChainStore(abs);
  await chain.release(`template:${id}`);
  await rm(join(dir, "meta.json"), { force: true });
  // The blank overlays spawns copy (storage/qcow2.ts) belong to the template alone.
  for (const f of await readdir(dir).catch(() => [] as string[])) {
    if (f.startsWith("blank-")) await rm(join(dir, f), { force: true });
  }
  // Files still used by children stay (they are in this dir); the dir goes with the last one.
  await removeIfEmpty(dir);
  return ok(undefined);
}

/** Removes a template dir once its files are all gone (after its last child ended). */
async function removeIfEmpty(dir: string): Promise<void> {
  await rmdir(dir).catch((err: NodeJS.ErrnoException) => {
    // Children still use files in it (ENOTEMPTY), or it went already (ENOENT).
    if (err.code !== "ENOTEMPTY" && err.code !== "ENOENT") throw err;
  });
}
