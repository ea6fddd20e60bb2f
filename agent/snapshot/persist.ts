/**
 * An engine VM saved among its records: `snapshot-vm.json` (agent/vm/records-dir.ts:
 * `<stateDir>/records/vms/<id>/`, root's and out of the VM's jail's reach) holds what another agent process
 * needs to drive the VM again (its disk chain top and QEMU node name, RAM file, overlay
 * generation, the template's shape, and while suspended the state file), plus the notes its owner
 * keeps with it (template, size, image config). `saveVm` turns a live `SandboxVm` into that
 * record and `restoreVm` a record back into a `SandboxVm` without a QEMU; the caller then adopts
 * the running QEMU or resumes from the state file.
 *
 * What is read back was written by an earlier process, possibly an older agent, possibly torn by
 * a crash or put there by hand: it is parsed with the zod schema below, and a file that does not
 * pass is a `vm_record_invalid` error naming the reason, never a half-trusted object. Before it
 * drives anything, `checkVmRecord` holds its id and every path in it to where this agent puts
 * them. A record an older agent left in the VM directory itself (version 1 kept it there, where
 * the jail uid could rewrite it) is not migrated: its VM is lost, with that reason.
 */
import { existsSync } from "node:fs";
import { realpath } from "node:fs/promises";
import { basename, dirname, join } from "node:path";
import { z } from "zod";
import type { GuestArtifacts } from "../guest/artifacts.ts";
import { DISK_FILE } from "../image/cache.ts";
import { StoredImageConfig } from "../image/config.ts";
import type { ChainStore } from "../storage/chain.ts";
import { VM_ID_PATTERN } from "../vm/ids.ts";
import { readVmRecordFile, vmRecordsDir, writeVmRecordFile } from "../vm/records-dir.ts";
import { fail, ok, type Result, SnapshotError } from "./errors.ts";
import { SandboxVm, type VmShape } from "./vm.ts";

export const VM_RECORD_FILE = "snapshot-vm.json";
export const VM_RECORD_VERSION = 1;

const GuestArtifactsState = z.object({
  vmlinux: z.string(),
  initramfs: z.string(),
  kernelVersion: z.string(),
  key: z.string(),
}) satisfies z.ZodType<GuestArtifacts>;

const VmShapeState = z.object({
  dataDir: z.string(),
  shmRoot: z.string(),
  artifacts: GuestArtifactsState,
  accel: z.enum(["kvm", "tcg"]),
  memMib: z.int().min(1),
  vcpus: z.int().min(1),
  baseDisk: z.string(),
  diskBytes: z.int().min(0),
  dieWithParent: z.boolean().optional(),
}) satisfies z.ZodType<VmShape>;

export const VmRecord = z.object({
  version: z.literal(VM_RECORD_VERSION),
  vmId: z.string().min(1),
  /** The owner's notes: the engine keeps them with the VM and does not read them. */
  templateId: z.string(),
  size: z.object({ vcpus: z.int().min(1), memMib: z.int().min(1) }),
  image: StoredImageConfig,
  shape: VmShapeState,
  disk: z.string(),
  topNode: z.string(),
  memPath: z.string(),
  generation: z.int().min(0),
  /** Set while suspended: the full RAM + device state file. */
  suspendState: z.string().optional(),
  memBytes: z.number().optional(),
});
export type VmRecord = z.infer<typeof VmRecord>;

/** What the VM's owner records with it. */
export type VmNotes = Pick<VmRecord, "templateId" | "size" | "image" | "memBytes">;

/** The shape as saved: the host settings are the adopting agent's own, not the saver's. */
function savedShape(shape: VmShape): VmShape {
  const { host: _host, ...saved } = shape;
  return saved;
}

/** The record of `vm` as it is now (a pure function: nothing is written). */
export function saveVm(vm: SandboxVm, notes: VmNotes): VmRecord {
  const record: VmRecord = {
    version: VM_RECORD_VERSION,
    vmId: vm.id,
    templateId: notes.templateId,
    size: notes.size,
    image: notes.image,
    shape: savedShape(vm.shape),
    disk: vm.disk,
    topNode: vm.topNode,
    memPath: vm.memPath,
    generation: vm.generation,
  };
  if (vm.suspendState) record.suspendState = vm.suspendState;
  if (notes.memBytes !== undefined) record.memBytes = notes.memBytes;
  return record;
}

/**
 * A `SandboxVm` in `dir` from its record: disk chain, node name, RAM file, generation and suspend
 * state as saved, no QEMU and no guest yet (state `starting`: the caller says what it became).
 */
export function restoreVm(record: VmRecord, dir: string, log?: (m: string) => void): SandboxVm {
  const vm = new SandboxVm(record.vmId, dir, record.shape, record.disk, record.memPath, log);
  vm.topNode = record.topNode;
  vm.generation = record.generation;
  vm.suspendState = record.suspendState;
  return vm;
}

/** Writes the record of the VM in `dir` atomically (the old record or the new one). */
export function writeVmRecord(dir: string, record: VmRecord): Promise<void> {
  return writeVmRecordFile(dir, VM_RECORD_FILE, JSON.stringify(record));
}

/**
 * The record of the VM in `dir`: `undefined` when there is none; `vm_record_invalid` when the
 * file is not JSON (torn), is of another version, is not a VM record, or is only in the VM
 * directory (an older agent's, which the jail could have written).
 */
export async function readVmRecord(dir: string): Promise<Result<VmRecord | undefined>> {
  const path = join(vmRecordsDir(dir), VM_RECORD_FILE);
  let text: string | undefined;
  try {
    text = await readVmRecordFile(dir, VM_RECORD_FILE);
  } catch (err) {
    return fail(invalid(`cannot read ${path}`, err));
  }
  if (text === undefined) {
    if (existsSync(join(dir, VM_RECORD_FILE)))
      return fail(
        invalid(
          `${join(dir, VM_RECORD_FILE)} is an older agent's record, kept where the VM's jail could rewrite it: not trusted`,
        ),
      );
    return ok(undefined);
  }
  let raw: unknown;
  try {
    raw = JSON.parse(text);
  } catch (err) {
    return fail(invalid(`${path} is not JSON (torn or foreign)`, err));
  }
  const version =
    typeof raw === "object" && raw !== null ? (raw as { version?: unknown }).version : undefined;
  if (version !== VM_RECORD_VERSION)
    return fail(
      invalid(
        `${path} has version ${JSON.stringify(version)}; this agent reads version ${VM_RECORD_VERSION}`,
      ),
    );
  const r = VmRecord.safeParse(raw);
  if (!r.success) return fail(invalid(`${path} is not a VM record: ${z.prettifyError(r.error)}`, r.error));
  return ok(r.data);
}

function invalid(message: string, cause?: unknown): SnapshotError {
  const why = cause instanceof Error && !(cause instanceof z.ZodError) ? `: ${cause.message}` : "";
  return new SnapshotError("vm_record_invalid", `${message}${why}`, { cause });
}

/** Where this agent keeps a VM's files: what `checkVmRecord` holds a record to. */
export interface VmRecordPlaces {
  /** The VM's directory, `<stateDir>/vms/<id>`. */
  dir: string;
  stateDir: string;
  shmRoot: string;
  /** The agent's own chain store: every disk, RAM and state file of a VM is registered in it. */
  chain: ChainStore;
  /** The image store, `<cacheDir>/images`: a base disk is `<imagesRoot>/<hex digest>/rootfs.qcow2`. */
  imagesRoot: string;
  /** This agent's guest artifacts' directory, `<cacheDir>/guest`: `<guestRoot>/<key>/vmlinux`. */
  guestRoot: string;
}

/** An image store entry's name: the hex of its config digest (image/cache.ts imageDir). */
const IMAGE_DIR_RE = /^[0-9a-f]{64}$/;
/** An artifacts key (guest/artifacts.ts): one path component of letters, digits, '.', '_', '-'. */
const ARTIFACTS_KEY_RE = /^(?!\.\.?$)[A-Za-z0-9._-]+$/;

/**
 * Holds `record` to where this agent puts a VM's files, before anything is opened, chowned,
 * bound into a jail or deleted on its word: its id is its directory's name and a VM id; its data
 * dir and tmpfs root are this agent's; its disk, RAM file and state file are registered in the
 * chain store (its RAM file as one), its base disk is an image store entry's disk and its kernel and initramfs are an
 * artifacts key's; each lies, with no symlink on the way (its realpath is itself), under the
 * disks directory, the tmpfs root (a kept snapshot's memory image: the disks directory), the
 * suspended-states directory, the image store and the
 * artifacts directory. A record failing any of these is `vm_record_invalid` naming the first
 * that failed (the VM is lost; nothing outside its directory is touched).
 */
export async function checkVmRecord(record: VmRecord, at: VmRecordPlaces): Promise<Result<VmRecord>> {
  const id = basename(at.dir);
  if (record.vmId !== id || !VM_ID_PATTERN.test(record.vmId))
    return fail(invalid(`the record of ${id} names VM ${JSON.stringify(record.vmId)}`));
  if (record.shape.dataDir !== at.stateDir || record.shape.shmRoot !== at.shmRoot)
    return fail(invalid(`the record of ${id} names another data dir or tmpfs root`));
  const registered = (p: string) => at.chain.get(p) !== undefined;
  const { key, vmlinux, initramfs } = record.shape.artifacts;
  const artifact = (name: string) => (p: string) =>
    ARTIFACTS_KEY_RE.test(key) && p === join(at.guestRoot, key, name);
  const disks = join(at.stateDir, "storage", "disks");
  // A VM started from (or rolled back to) a kept snapshot maps its memory image, kept on the data
  // disk beside the overlays (keep.ts); every other VM maps a RAM file on tmpfs.
  const ramRoot = record.memPath.startsWith(`${disks}/`) ? disks : at.shmRoot;
  const places: [string, string | undefined, string, (p: string) => boolean, string][] = [
    ["disk", record.disk, disks, registered, "in its chain store"],
    [
      "RAM file",
      record.memPath,
      ramRoot,
      (p) => at.chain.get(p)?.kind === "ram",
      "a RAM file in its chain store",
    ],
    [
      "state file",
      record.suspendState,
      join(at.stateDir, "storage", "suspended"),
      registered,
      "in its chain store",
    ],
    [
      "base disk",
      record.shape.baseDisk,
      at.imagesRoot,
      (p) =>
        IMAGE_DIR_RE.test(basename(dirname(p))) && p === join(at.imagesRoot, basename(dirname(p)), DISK_FILE),
      `an image's ${DISK_FILE}`,
    ],
    ["kernel", vmlinux, at.guestRoot, artifact("vmlinux"), `its artifacts key ${key}'s`],
    ["initramfs", initramfs, at.guestRoot, artifact("initramfs.cpio.gz"), `its artifacts key ${key}'s`],
  ];
  for (const [what, path, root, isOurs, ours] of places) {
    if (path === undefined) continue;
    // Symlinks above the root are the operator's (a state dir on a linked volume); none below it.
    const [real, realRoot] = await Promise.all(
      [realpath(path), realpath(root)].map((p) => p.catch(() => "")),
    );
    const resolved =
      path.startsWith(`${root}/`) && real !== "" && real === realRoot + path.slice(root.length);
    if (!resolved || !isOurs(path))
      return fail(
        invalid(
          `the record of ${id} names ${path} as its ${what}: not a file of this agent's under ${root} (a symlink, elsewhere, missing or not ${ours})`,
        ),
      );
  }
  return ok(record);
}
