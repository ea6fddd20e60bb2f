/**
 * An engine VM saved beside itself: `<vm dir>/snapshot-vm.json` holds what another agent process
 * needs to drive the VM again (its disk chain top and QEMU node name, RAM file, overlay
 * generation, the template's shape, and while suspended the state file), plus the notes its owner
 * keeps with it (template, size, image config). `saveVm` turns a live `SandboxVm` into that
 * record and `restoreVm` a record back into a `SandboxVm` without a QEMU; the caller then adopts
 * the running QEMU or resumes from the state file.
 *
 * What is read back was written by an earlier process, possibly an older agent, possibly torn by
 * a crash or put there by hand: it is parsed with the zod schema below, and a file that does not
 * pass is a `vm_record_invalid` error naming the reason, never a half-trusted object.
 */
import { randomBytes } from "node:crypto";
import { readFile, rename, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { z } from "zod";
import type { GuestArtifacts } from "../guest/artifacts.ts";
import { StoredImageConfig } from "../image/config.ts";
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

/** Writes the record into `dir` atomically (temp file + rename: the old record or the new one). */
export async function writeVmRecord(dir: string, record: VmRecord): Promise<void> {
  const path = join(dir, VM_RECORD_FILE);
  const tmp = `${path}.${randomBytes(4).toString("hex")}.tmp`;
  await writeFile(tmp, JSON.stringify(record), { mode: 0o600 });
  await rename(tmp, path);
}

/**
 * The record in `dir`: `undefined` when there is none; `vm_record_invalid` when the file is not
 * JSON (torn), is of another version, or is not a VM record.
 */
export async function readVmRecord(dir: string): Promise<Result<VmRecord | undefined>> {
  const path = join(dir, VM_RECORD_FILE);
  let text: string;
  try {
    text = await readFile(path, "utf8");
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === "ENOENT") return ok(undefined);
    return fail(invalid(`cannot read ${path}`, err));
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
