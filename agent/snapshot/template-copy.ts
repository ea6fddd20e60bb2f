/**
 * A ready template copied from one agent to another (docs/templates.md "Agents that join
 * later"): the frozen files themselves, not a rebuild, so a template whose source is gone (an
 * uploaded image) or needed the tenant's registry credentials (never stored) reaches an agent
 * that joined after its bake, and arrives in the seconds a copy takes instead of a rebuild's
 * minutes.
 *
 * What crosses (bundle-codec.ts): a header (the size, the guest artifacts' key, the accelerator
 * and QEMU version the state was saved under, the image config and ports), then the base disk,
 * the frozen overlay, the device state and the RAM file.
 *
 * What the receiver checks, since the sender may be hostile (a customer's agent):
 * - the state loads only into the same guest kernel and initramfs, accelerator and QEMU: any
 *   difference is `template_incompatible`, before a byte of the files is written;
 * - sizes within the bounds a VM may have, the RAM file exactly the guest's RAM, the state
 *   under the cap a save of that guest has, room on each filesystem before writing;
 * - the base disk is a qcow2 with no backing file and no external data file; the overlay is a
 *   qcow2 with no data file, whose backing name is rewritten (`rebase -u`) to the base it came
 *   with and then read back: a header naming any host file is never opened;
 * - the base lands in the image cache as an entry of its own (`images/copied/<random>`): never
 *   shared with another template, never answering for an image digest, evicted like any entry
 *   once no template stands on it.
 * A failed import removes every file it wrote.
 */
import { randomBytes } from "node:crypto";
import { chmod, mkdir, rename, rm } from "node:fs/promises";
import { join, resolve } from "node:path";
import { z } from "zod";
import { MAX_MEM_MIB, MAX_VCPUS, MIN_MEM_MIB, MIN_VCPUS } from "../../contracts/api/limits.ts";
import { bestEffort } from "../../contracts/best-effort.ts";
import { needFreeSpace } from "../../contracts/disk-space.ts";
import type { GuestArtifacts } from "../guest/artifacts.ts";
import { runTool } from "../host/tool.ts";
import { DISK_FILE } from "../image/cache.ts";
import { type ImageConfig, StoredImageConfig } from "../image/config.ts";
import type { Accel } from "../qemu/args.ts";
import { backingChain, QCOW2_MAGIC } from "../qemu/jail-setup.ts";
import { QEMU_BINARY_PATH } from "../qemu/launch.ts";
import { rebaseUnsafe, virtualSize } from "../storage/qcow2.ts";
import { DEFAULT_VM_HOST, type VmHostSettings } from "../vm/host-settings.ts";
import {
  type BundleSource,
  ExactReader,
  encodeBundle,
  readBundleFile,
  readBundleHeader,
} from "./bundle-codec.ts";
import { asSnapshotError, fail, ok, type Result, SnapshotError } from "./errors.ts";
import { migrationByteCap } from "./stream.ts";
import {
  loadTemplate,
  removeTemplateFiles,
  type TemplateMeta,
  templateDirOf,
  writeMeta,
} from "./template.ts";
import { registerTemplateFiles } from "./template-steps.ts";

/**
 * Largest base disk or overlay file a copy may carry: an imported image is at most 8 GiB
 * unpacked (agent/image/limits.ts), its ext4 and qcow2 metadata add a fraction; 32 GiB leaves
 * room and still stops a sender declaring terabytes (the free-space checks stop it sooner).
 */
export const COPY_DISK_MAX_BYTES = 32 * 1024 ** 3;

/** The files of a bundle, in the order they are sent. */
const FILES = ["base", "disk", "state", "mem"] as const;
type BundleFile = (typeof FILES)[number];

const FileSize = z.int().min(0).max(Number.MAX_SAFE_INTEGER);

export const BundleHeader = z
  .object({
    version: z.literal(1),
    memMib: z.int(),
    vcpus: z.int(),
    accel: z.enum(["kvm", "tcg"]),
    artifactsKey: z.string().max(256),
    qemuVersion: z.string().max(256),
    imageDigest: z.string().max(256),
    config: StoredImageConfig,
    exposedPorts: z.array(z.int().min(1).max(65535)).max(1024),
    readyCmd: z.array(z.string()).max(4096).optional(),
    files: z.object({ base: FileSize, disk: FileSize, state: FileSize, mem: FileSize }).strict(),
  })
  .strict();
export type BundleHeader = z.infer<typeof BundleHeader>;

let qemuVersionOnce: Promise<string> | undefined;

/** The first line of `qemu-system-x86_64 --version` (the state's format follows the QEMU). */
export function qemuVersion(): Promise<string> {
  qemuVersionOnce ??= runTool([QEMU_BINARY_PATH, "--version"], { timeoutMs: 30_000 }).then(
    (r) => r.stdout.toString("utf8").split("\n")[0]?.trim() ?? "",
  );
  qemuVersionOnce.catch(() => {
    qemuVersionOnce = undefined;
  });
  return qemuVersionOnce;
}

/** The bundle of ready template `id`, with the image config and ports its record keeps. */
export async function exportTemplate(
  dataDir: string,
  id: string,
  extra: { config: ImageConfig; exposedPorts: number[] },
): Promise<AsyncGenerator<Buffer>> {
  const r = await loadTemplate(dataDir, id);
  if (!r.ok) throw r.error;
  const meta = r.value;
  const paths: Record<BundleFile, string> = {
    base: meta.baseDisk,
    disk: meta.disk,
    state: meta.statePath,
    mem: meta.memPath,
  };
  const sizes = {} as Record<BundleFile, number>;
  const sources: BundleSource[] = [];
  for (const f of FILES) {
    const size = (await Bun.file(paths[f]).stat()).size;
    sizes[f] = size;
    sources.push({ path: paths[f], size });
  }
  const header: BundleHeader = {
    version: 1,
    memMib: meta.memMib,
    vcpus: meta.vcpus,
    accel: meta.accel,
    artifactsKey: meta.artifacts.key,
    qemuVersion: await qemuVersion(),
    imageDigest: meta.imageDigest,
    config: extra.config,
    exposedPorts: extra.exposedPorts,
    ...(meta.readyCmd ? { readyCmd: meta.readyCmd } : {}),
    files: sizes,
  };
  return encodeBundle(header, sources);
}

export interface ImportTemplateOptions {
  dataDir: string;
  /** The image cache: the copied base disk becomes an entry of it. */
  cacheDir: string;
  shmRoot: string;
  id: string;
  bundle: ReadableStream<Uint8Array>;
  /** This agent's: a bundle saved under others is `template_incompatible`. */
  artifacts: GuestArtifacts;
  accel: Accel;
  host?: VmHostSettings;
  signal?: AbortSignal;
  onDistributing?: () => void;
  log?: (m: string) => void;
}

export interface ImportedTemplate {
  meta: TemplateMeta;
  config: ImageConfig;
  exposedPorts: number[];
}

/** Parses and checks a bundle's header against this agent (see the module's comment). */
async function checkedHeader(o: ImportTemplateOptions, r: ExactReader): Promise<BundleHeader> {
  const parsed = BundleHeader.safeParse(await readBundleHeader(r));
  if (!parsed.success)
    throw new SnapshotError(
      "bad_request",
      `template bundle: the header is malformed: ${parsed.error.message}`,
    );
  const h = parsed.data;
  const theirs = { artifacts: h.artifactsKey, accel: h.accel, qemu: h.qemuVersion };
  const ours = { artifacts: o.artifacts.key, accel: o.accel, qemu: await qemuVersion() };
  for (const k of ["artifacts", "accel", "qemu"] as const)
    if (theirs[k] !== ours[k])
      throw new SnapshotError(
        "template_incompatible",
        `the template was frozen under another ${k === "artifacts" ? "guest kernel/initramfs" : k === "accel" ? "accelerator" : "QEMU"} (${theirs[k]}; this agent has ${ours[k]}): it cannot be restored here`,
        { details: { theirs, ours } },
      );
  if (!Number.isInteger(h.memMib) || h.memMib < MIN_MEM_MIB || h.memMib > MAX_MEM_MIB)
    throw new SnapshotError("bad_request", `template bundle: memMib ${h.memMib} is out of range`);
  if (h.vcpus < MIN_VCPUS || h.vcpus > MAX_VCPUS)
    throw new SnapshotError("bad_request", `template bundle: vcpus ${h.vcpus} is out of range`);
  if (h.files.mem !== h.memMib * 1024 * 1024)
    throw new SnapshotError(
      "bad_request",
      `template bundle: a RAM file of ${h.files.mem} bytes for ${h.memMib} MiB`,
    );
  if (h.files.state > migrationByteCap(h.memMib))
    throw new SnapshotError("bad_request", `template bundle: a device state of ${h.files.state} bytes`);
  for (const f of ["base", "disk"] as const)
    if (h.files[f] > COPY_DISK_MAX_BYTES)
      throw new SnapshotError("bad_request", `template bundle: a ${f} of ${h.files[f]} bytes`);
  return h;
}

/**
 * Reads a bundle into template `id` of this data dir: ready and registered for restores when it
 * answers ok. Refuses an id already taken (`bad_request`), a foreign or malformed bundle.
 */
export async function importTemplate(o: ImportTemplateOptions): Promise<Result<ImportedTemplate>> {
  const log = o.log ?? (() => {});
  const dataDir = resolve(o.dataDir);
  const reader = new ExactReader(o.bundle);
  const dir = templateDirOf(dataDir, o.id);
  const baseDir = join(resolve(o.cacheDir), "images", "copied", randomBytes(32).toString("hex"));
  const baseTmp = `${baseDir}.tmp`;
  let meta: TemplateMeta | undefined;
  let made = false;
  try {
    const h = await checkedHeader(o, reader);
    const reserve = (o.host ?? DEFAULT_VM_HOST).diskReserveBytes;
    // Asked before anything is written: the files are about to take this much, as declared.
    await needFreeSpace(o.shmRoot, "the copied template's memory file", h.files.mem, reserve);
    await needFreeSpace(dataDir, "the copied template's disk", h.files.disk + h.files.state, reserve);
    await needFreeSpace(o.cacheDir, "the copied template's base disk", h.files.base, reserve);
    await mkdir(join(dataDir, "templates"), { recursive: true });
    try {
      await mkdir(dir); // EEXIST: the id is taken
    } catch (err) {
      throw asSnapshotError(err, "bad_request", `template ${o.id} cannot be created`);
    }
    made = true;
    await mkdir(o.shmRoot, { recursive: true, mode: 0o700 });
    await mkdir(baseTmp, { recursive: true, mode: 0o700 });
    meta = {
      id: o.id,
      state: "building",
      imageDigest: h.imageDigest,
      config: h.config,
      baseDisk: join(baseDir, DISK_FILE),
      disk: join(dir, "disk.qcow2"),
      diskBytes: 0,
      statePath: join(dir, "state"),
      memPath: join(o.shmRoot, `tpl-${o.id}.mem`),
      shmRoot: o.shmRoot,
      memMib: h.memMib,
      vcpus: h.vcpus,
      accel: o.accel,
      artifacts: o.artifacts,
      ...(h.readyCmd ? { readyCmd: h.readyCmd } : {}),
      createdAt: new Date().toISOString(),
    };
    await writeMeta(meta);
    const t0 = performance.now();
    const into: Record<BundleFile, string> = {
      base: join(baseTmp, DISK_FILE),
      disk: meta.disk,
      state: meta.statePath,
      mem: meta.memPath,
    };
    for (const f of FILES) await readBundleFile(reader, f, into[f], h.files[f], o.signal);
    if (!(await reader.atEnd()))
      throw new SnapshotError("bad_request", "template bundle: bytes after its last file");
    await checkDisks(into.base, meta.disk);
    // Published whole: an entry of the cache appears complete or not at all.
    await rename(baseTmp, baseDir);
    await rebaseUnsafe(meta.disk, meta.baseDisk);
    const chain = await backingChain(meta.disk, new Set([meta.baseDisk]));
    if (chain.foreign !== undefined || chain.files.join() !== meta.baseDisk)
      throw new SnapshotError(
        "bad_request",
        `template bundle: the overlay's chain is ${chain.foreign ?? chain.files.join(" <- ")} after its rebase`,
      );
    await chmod(meta.baseDisk, 0o444);
    await chmod(meta.disk, 0o444);
    meta.diskBytes = await virtualSize(meta.disk);
    if (meta.diskBytes > COPY_DISK_MAX_BYTES)
      throw new SnapshotError("bad_request", `template bundle: a disk of ${meta.diskBytes} virtual bytes`);
    const copyMs = performance.now() - t0;
    o.onDistributing?.();
    await registerTemplateFiles(dataDir, o.id, meta);
    meta.state = "ready";
    meta.stateBytes = h.files.state;
    meta.timings = { bootMs: 0, readyCmdMs: 0, snapshotMs: 0, distributeMs: copyMs, totalMs: copyMs };
    await writeMeta(meta);
    log(`template ${o.id}: copied in (${(copyMs / 1000).toFixed(1)} s)`);
    return ok({ meta, config: h.config, exposedPorts: h.exposedPorts });
  } catch (err) {
    reader.cancel();
    const e = asSnapshotError(err, "template_build_failed", `copying template ${o.id} in failed`);
    await rm(baseTmp, { recursive: true, force: true });
    if (made && meta) {
      await rm(baseDir, { recursive: true, force: true });
      await removeTemplateFiles(meta);
      meta.state = "failed";
      meta.error = { code: e.code, message: e.message };
      await bestEffort(log, `recording template ${o.id} as failed`, writeMeta(meta));
    } else if (made) await rm(dir, { recursive: true, force: true });
    log(`template ${o.id}: copy refused: ${e.message}`);
    return fail(e as SnapshotError);
  }
}

/**
 * The copied disks before any of them is used: the base a qcow2 naming no backing file and no
 * external data file (its header would be trusted as the image store's), the overlay a qcow2
 * with no data file (its backing name is rewritten next, never followed).
 */
async function checkDisks(base: string, disk: string): Promise<void> {
  for (const [what, path] of [
    ["base disk", base],
    ["overlay", disk],
  ] as const) {
    const head = Buffer.from(await Bun.file(path).slice(0, 4).arrayBuffer());
    if (head.length < 4 || head.readUInt32BE(0) !== QCOW2_MAGIC)
      throw new SnapshotError("bad_request", `template bundle: the ${what} is not a qcow2 image`);
  }
  const own = await backingChain(base, new Set());
  if (own.foreign !== undefined || own.files.length > 0)
    throw new SnapshotError(
      "bad_request",
      `template bundle: the base disk names ${own.foreign ?? own.files.join(", ")}; a copied base may name nothing`,
    );
  const top = await backingChain(disk, new Set());
  if (top.foreign?.includes("external data file"))
    throw new SnapshotError("bad_request", "template bundle: the overlay has an external data file");
}
