/**
 * Kept snapshots (docs/snapshots.md): a running VM's memory and disk at one instant, kept by the
 * agent under a name (`ref`, the gateway's `snap_` id) until dropped, VMs started from it, and a
 * running VM rolled back to it in place.
 *
 * Taking one is the first half of a fork (fork.ts `captureParent`: the same stall, the parent runs
 * on, its old top overlay frozen read-only). Then, instead of starting children:
 * - the capture arrives as a fork point (ram-split.ts): a RAM file, the memory image, and a ~60 KB
 *   device state in the x-ignore-shared form. Both are copied from tmpfs to the data disk
 *   (`storage/<ref>.mem`, holes kept, and `storage/<ref>.state`): a snapshot may be kept for
 *   months, and tmpfs is host memory. A VM from it maps the image private (copy-on-write) and
 *   reads 60 KB of state instead of the whole RAM: measured on a 256 MiB busybox guest under TCG,
 *   the restore's load fell from ~220 ms (the full 64 MB stream) to a few ms;
 * - past `MAX_CHAIN_DEPTH` the frozen overlay is flattened onto the image base (as fork children's
 *   base is), so VMs started from it never run on a deeper chain than the bound;
 * - the chain store holds the image, the state and the disk base under `kept:<ref>`; the fork's
 *   own hold is released.
 * - `<dataDir>/kept/<ref>.json` records what a start needs; `reclaimSnapshotStorage` keeps the
 *   holder while that file exists, so a kept snapshot survives agent restarts. Records of the
 *   first version (a full RAM stream over a private mapping of the source's RAM file) still load.
 *
 * A VM from it gets a new overlay on the kept base, held by `vm:<id>`. Dropping releases
 * `kept:<ref>` and removes the record: the chain store frees each file once no VM holds it any
 * more, so a drop while VMs made from the snapshot run frees their files with the last of them.
 */
import { copyFile, mkdir, readdir, readFile, rename, rm, stat, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { z } from "zod";
import { type FreeBytes, needFreeSpace } from "../../contracts/disk-space.ts";
import { runTool } from "../host/tool.ts";
import { DEVICE_IDS } from "../qemu/launch.ts";
import { type ChainStore, openChainStore } from "../storage/chain.ts";
import { createOverlayOn, flattenOnto, MAX_CHAIN_DEPTH } from "../storage/qcow2.ts";
import { DEFAULT_VM_HOST } from "../vm/host-settings.ts";
import { claimVm, forgetStandby } from "../vm/process.ts";
import { slotOf } from "../vm/slots.ts";
import { vmsRoot } from "../vm/workdir.ts";
import { asSnapshotError, fail, ok, type Result, SnapshotError } from "./errors.ts";
import { checkedChain, removeStagedLinks } from "./fork/chain.ts";
import { captureParent } from "./fork.ts";
import type { ForkMethod } from "./fork-method.ts";
import { launchStandby, takeStandby } from "./standby.ts";
import {
  finishRestore,
  type RestoreTimings,
  restoreInto,
  SandboxVm,
  type StandbyQemu,
  storageDir,
  type VmShape,
} from "./vm.ts";

/** A kept snapshot's name: the gateway's snapshot id (contracts/agent/schemas.ts SnapshotRefParam). */
export const KEPT_REF = /^snap_[a-z0-9]{1,60}$/;

const KeptRecord = z.object({
  /** 1: `statePath` is the full RAM stream over the source's RAM file; 2: a memory image. */
  version: z.union([z.literal(1), z.literal(2)]),
  ref: z.string().regex(KEPT_REF),
  /** The disk base of VMs started from it (read-only; held by `kept:<ref>`). */
  base: z.string(),
  /**
   * Version 2: the device state saved with x-ignore-shared, and `memPath` the memory image it
   * goes with (mapped private). Version 1: the full RAM + device state over `memPath`.
   */
  statePath: z.string(),
  memPath: z.string(),
  /** The source VM's shape without its host settings (the restoring agent's own apply). */
  shape: z.custom<VmShape>((v) => typeof v === "object" && v !== null),
  /** The owner's notes (the driver's template, size, image config), kept and not read here. */
  notes: z.record(z.string(), z.unknown()),
  sizeBytes: z.number(),
});
export type KeptRecord = z.infer<typeof KeptRecord>;

export const keptRoot = (dataDir: string) => join(dataDir, "kept");
const recordPath = (dataDir: string, ref: string) => join(keptRoot(dataDir), `${ref}.json`);
export const keptHolder = (ref: string) => `kept:${ref}`;
/** Copying a memory image (at most the guest's RAM, from tmpfs) to the data disk: seconds at worst; 5 min catches a stuck disk. */
const KEEP_COPY_TIMEOUT_MS = 5 * 60_000;

export interface Kept {
  record: KeptRecord;
  parentStallMs: number;
}

/** Takes snapshot `ref` of running `parent` (see the file's comment); the parent runs on either way. */
export async function keepVm(
  parent: SandboxVm,
  ref: string,
  o: { method: ForkMethod; notes: Record<string, unknown>; log?: (m: string) => void; freeBytes?: FreeBytes },
): Promise<Result<Kept>> {
  const log = o.log ?? (() => {});
  if (!KEPT_REF.test(ref)) return fail(new SnapshotError("bad_request", `bad snapshot name ${ref}`));
  const dataDir = parent.shape.dataDir;
  const chain = await openChainStore(dataDir);
  if (chain.list().some((f) => f.holders.includes(keptHolder(ref))))
    return fail(new SnapshotError("bad_request", `snapshot ${ref} exists`));
  const captured = await captureParent(parent, o.method, log, o.freeBytes);
  if (!captured.ok) return captured;
  const { run, frozen, forkHolder, parentStallMs } = captured.value;
  const holder = keptHolder(ref);
  const disks = storageDir(dataDir);
  const statePath = join(disks, `${ref}.state`);
  const memPath = join(disks, `${ref}.mem`);
  try {
    let base = frozen;
    if (chain.depth(frozen) >= MAX_CHAIN_DEPTH) {
      const below = await checkedChain(chain, frozen, parent.shape.baseDisk);
      base = join(disks, `${ref}-flat.qcow2`);
      await flattenOnto(frozen, below, base, parent.shape.diskBytes);
      await chain.add(base, { kind: "overlay", holder, depth: 1 });
    } else {
      await chain.hold(holder, [frozen]);
    }
    // The memory image, made on tmpfs (the fork's budget there), then moved to the data disk:
    // what it takes there is measured first, so a short disk refuses the snapshot (507)
    // instead of filling up.
    const imageBytes = (await allocated(run.memPath)) + (await stat(run.statePath)).size;
    await needFreeSpace(
      dataDir,
      "the snapshot's memory image",
      imageBytes,
      (parent.shape.host ?? DEFAULT_VM_HOST).diskReserveBytes,
      o.freeBytes,
    );
    // Holes kept: the image is the guest's whole RAM, mostly never-touched zero pages.
    await runTool(["cp", "--sparse=always", run.memPath, memPath], { timeoutMs: KEEP_COPY_TIMEOUT_MS });
    await copyFile(run.statePath, statePath);
    await chain.add(memPath, { kind: "ram", holder });
    await chain.add(statePath, { kind: "state", holder, deps: [memPath] });
    const { host: _host, ...shape } = parent.shape;
    // What the disk keeps: the image's blocks there (its zero pages are holes) and the base's.
    const sizeBytes = (await allocated(memPath)) + (await stat(statePath)).size + (await allocated(base));
    const record: KeptRecord = {
      version: 2,
      ref,
      base,
      statePath,
      memPath,
      shape,
      notes: o.notes,
      sizeBytes,
    };
    await writeRecord(dataDir, record);
    return ok({ record, parentStallMs });
  } catch (err) {
    await chain.release(holder);
    await rm(statePath, { force: true });
    await rm(memPath, { force: true });
    return fail(asSnapshotError(err, "fork_failed", `keeping snapshot ${ref} of ${parent.id} failed`));
  } finally {
    // The fork point's files on tmpfs go with the fork's hold (the chain store frees them).
    await chain.release(forkHolder);
  }
}

/** A VM `id` from kept snapshot `record`, running, its identity set (a new machine). */
export async function startFromKept(
  record: KeptRecord,
  id: string,
  o: { host?: VmShape["host"]; log?: (m: string) => void; readyTimeoutMs?: number },
): Promise<Result<{ vm: SandboxVm; timings: RestoreTimings }>> {
  const shape: VmShape = { ...record.shape, ...(o.host ? { host: o.host } : {}) };
  const chain: ChainStore = await openChainStore(shape.dataDir);
  const disk = join(storageDir(shape.dataDir), `${id}-0.qcow2`);
  const vm = new SandboxVm(id, join(vmsRoot(shape.dataDir), id), shape, disk, record.memPath, o.log);
  try {
    await chain.hold(vm.holder, [record.base, record.memPath]);
    await createOverlayOn(record.base, disk, shape.diskBytes);
    await chain.add(disk, { kind: "overlay", deps: [record.base], holder: vm.holder });
    const timings = await restoreInto({
      vm,
      mem: { path: record.memPath, share: false },
      statePath: record.statePath,
      ignoreShared: record.version === 2,
      ...(o.readyTimeoutMs ? { readyTimeoutMs: o.readyTimeoutMs } : {}),
    });
    vm.enter("running");
    return ok({ vm, timings });
  } catch (err) {
    await vm.destroy();
    return fail(asSnapshotError(err, "spawn_failed", `VM ${id} did not start from snapshot ${record.ref}`));
  }
}

export interface RestoredInPlace {
  timings: RestoreTimings;
  /** From the old QEMU's stop to the new one's guest answering with its identity set. */
  downMs: number;
  /** The whole rollback, preparation included. */
  totalMs: number;
  /** Whether the standby (standby.ts) was armed before the call, or launched during it. */
  standby: boolean;
}

/**
 * Rolls running (or idle-paused) VM `vm` back to kept snapshot `record` in place: same id,
 * directory and hostname; its memory, processes and disk become the snapshot's.
 *
 * The new QEMU is a standby (standby.ts) in the VM's other launch slot (vm/slots.ts): the one
 * armed ahead for this snapshot, or one launched now, beside the running QEMU. Everything that
 * can be refused (the size check, the standby's overlay, holds and launch) is done while the old
 * QEMU still runs: a refusal leaves the VM running as it was. Then the old QEMU is stopped, the
 * standby loads the snapshot's device state and takes over, and the VM's holds move to the new
 * files (the old overlays go with their last holder). Only a failure of that last step loses the
 * VM (state `dead`, the error says so): its old memory is gone by then. `sameMachine`: the
 * snapshot was taken of this VM, so it keeps its boot id.
 */
export async function restoreInPlace(
  vm: SandboxVm,
  record: KeptRecord,
  o: { sameMachine: boolean; readyTimeoutMs?: number },
): Promise<Result<RestoredInPlace>> {
  const t0 = performance.now();
  const s = vm.shape;
  if (
    record.shape.memMib !== s.memMib ||
    record.shape.vcpus !== s.vcpus ||
    record.shape.baseDisk !== s.baseDisk
  )
    return fail(
      new SnapshotError(
        "bad_request",
        `snapshot ${record.ref} (${record.shape.vcpus} vCPU, ${record.shape.memMib} MiB) is not of VM ${vm.id}'s image and size (${s.vcpus} vCPU, ${s.memMib} MiB)`,
      ),
    );
  const bad = vm.begin(["running", "paused"], "restoring");
  if (bad) return fail(bad);
  const armed = await takeStandby(vm, record.ref);
  let standby: StandbyQemu;
  try {
    standby = armed ?? (await launchStandby(vm, record));
  } catch (err) {
    vm.enter("running");
    return fail(
      asSnapshotError(err, "spawn_failed", `preparing VM ${vm.id}'s rollback to ${record.ref} failed`),
    );
  }
  const chain = await openChainStore(s.dataDir);
  const tDown = performance.now();
  const oldDir = vm.process?.dir ?? vm.dir;
  try {
    // SIGKILLed now; its exit and its jail's cleanup run beside the load into the standby (the
    // two are in separate slots and jails). The guest's connection is closed at once.
    const stopping = vm.detach();
    vm.topNode = DEVICE_IDS.diskNode;
    let timings: RestoreTimings;
    try {
      timings = await finishRestore(
        {
          vm,
          mem: { path: record.memPath, share: false },
          statePath: record.statePath,
          ignoreShared: record.version === 2,
          sameMachine: o.sameMachine,
          ...(o.readyTimeoutMs ? { readyTimeoutMs: o.readyTimeoutMs } : {}),
        },
        standby.process,
        tDown,
        tDown,
      );
    } finally {
      await stopping;
    }
    const tEnd = performance.now();
    const p = standby.process;
    await claimVm(vm.dir, p.pid, p.jailUid, slotOf(vm.dir, p.dir));
    await forgetStandby(vm.dir);
    // The old QEMU's staged hard links (the names it opened in its slot) would keep freed
    // overlays' blocks: they go while the store's own names still make them links. Then the VM's
    // holds move to the new chain (the old overlays, and a RAM file of its own, are freed unless
    // a snapshot or a fork child still holds them), and the old slot's files go.
    await removeStagedLinks(oldDir);
    await chain.release(vm.holder);
    vm.disk = standby.disk;
    vm.memPath = record.memPath;
    await chain.hold(vm.holder, [standby.disk, record.base, record.memPath]);
    if (oldDir !== vm.dir) await rm(oldDir, { recursive: true, force: true });
    vm.enter("running");
    return ok({ timings, downMs: tEnd - tDown, totalMs: tEnd - t0, standby: armed !== undefined });
  } catch (err) {
    await vm.destroy();
    return fail(
      asSnapshotError(err, "spawn_failed", `VM ${vm.id} was stopped but did not restore from ${record.ref}`),
    );
  } finally {
    await chain.release(standby.holder);
  }
}

/** Drops kept snapshot `ref` (idempotent): its files go with the last VM that still holds them. */
export async function dropKept(dataDir: string, ref: string): Promise<void> {
  await rm(recordPath(dataDir, ref), { force: true });
  const chain = await openChainStore(dataDir);
  await chain.release(keptHolder(ref));
}

/** Every kept snapshot recorded in `dataDir` (an agent's start reloads them); unreadable ones are named. */
export async function listKept(dataDir: string): Promise<{ kept: KeptRecord[]; bad: string[] }> {
  let names: string[] = [];
  try {
    names = await readdir(keptRoot(dataDir));
  } catch {
    return { kept: [], bad: [] };
  }
  const kept: KeptRecord[] = [];
  const bad: string[] = [];
  for (const n of names.filter((x) => x.endsWith(".json"))) {
    try {
      kept.push(KeptRecord.parse(JSON.parse(await readFile(join(keptRoot(dataDir), n), "utf8"))));
    } catch (err) {
      bad.push(`${n}: ${err instanceof Error ? err.message : String(err)}`);
    }
  }
  return { kept, bad };
}

async function writeRecord(dataDir: string, record: KeptRecord): Promise<void> {
  await mkdir(keptRoot(dataDir), { recursive: true, mode: 0o700 });
  const path = recordPath(dataDir, record.ref);
  await writeFile(`${path}.tmp`, JSON.stringify(record), { mode: 0o600 });
  await rename(`${path}.tmp`, path);
}

async function allocated(path: string): Promise<number> {
  try {
    return (await stat(path)).blocks * 512;
  } catch {
    return 0;
  }
}
