/**
 * Suspend to disk / resume, and pause / unpause for idle VMs.
 *
 * Suspend: `stop`, migrate the RAM and device state to `<dataDir>/storage/suspended/<id>.state`,
 * end QEMU. The overlay stays where it is. Resume: a new QEMU on the same overlay and RAM mapping,
 * `-incoming`, then a fresh clock and entropy (the guest slept; its CRNG state was on disk).
 *
 * The state holds only the VM's own pages: a VM maps its RAM file (a template's, a fork point's)
 * private, so every page it never wrote shows that file, which the VM keeps holding while
 * suspended and which never changes. QEMU still sends every page; the agent keeps in the state
 * the records of the pages the VM wrote (its private copies, read from /proc/<pid>/pagemap while
 * it is stopped: populate.ts `ownPages`) and drops the rest as they arrive (ram-split.ts, `keep`).
 * The resume loads that delta over the same mapping. Measured on a 256 MiB busybox guest under
 * TCG: the state fell from ~64 MB to a few MB, the resume from ~390 ms to about a spawn.
 */
import { mkdir, rm, stat } from "node:fs/promises";
import { join } from "node:path";
import { bestEffort } from "../../contracts/best-effort.ts";
import { needFreeSpace } from "../../contracts/disk-space.ts";
import { DEVICE_IDS } from "../qemu/launch.ts";
import { openChainStore } from "../storage/chain.ts";
import { DEFAULT_VM_HOST } from "../vm/host-settings.ts";
import { asSnapshotError, fail, ok, type Result, SnapshotError } from "./errors.ts";
import { LOCAL_MIGRATION_MAX_BANDWIDTH, qmp, setCapabilities, setMigrationParameters } from "./migrate.ts";
import { ownPages } from "./populate.ts";
import { PAGE_BYTES, type SplitTarget } from "./ram-split.ts";
import { digLater } from "./sparse.ts";
import { migrationByteCap, saveToFile } from "./stream.ts";
import { type RestoreTimings, restoreInto, type SandboxVm } from "./vm.ts";

/** Writing a full 256 MiB guest takes ~0.5 s; a minute means the disk or QEMU is stuck. */
const SUSPEND_TIMEOUT_MS = 60_000;

/**
 * Bandwidth of the suspend's migration: uncapped. The sink is a local file and the guest is
 * stopped, so QEMU's default cap (128 MiB/s) would only stretch the stop.
 */
export const SUSPEND_MAX_BANDWIDTH = LOCAL_MIGRATION_MAX_BANDWIDTH;

export interface Suspended {
  /** Size of the on-disk memory image (state file), bytes. */
  memBytes: number;
  suspendMs: number;
}

export async function suspendVm(vm: SandboxVm): Promise<Result<Suspended>> {
  const bad = vm.begin(["running", "paused"], "suspending");
  if (bad) return fail(bad);
  // A rollback's standby (standby.ts) would hold a second QEMU while the VM holds none.
  await vm.dropStandby();
  const proc = vm.process;
  if (!proc) return fail(new SnapshotError("suspend_failed", `VM ${vm.id}: no QEMU`));
  const dir = join(vm.shape.dataDir, "storage", "suspended");
  const statePath = join(dir, `${vm.id}.state`);
  const t0 = performance.now();
  try {
    // Asked while the VM still runs: a short disk refuses the suspend and the sandbox runs on.
    // The state file holds at most the guest's RAM (zero pages compress to nothing).
    await needFreeSpace(
      vm.shape.dataDir,
      "the suspended sandbox's memory image",
      vm.shape.memMib * 1024 * 1024,
      (vm.shape.host ?? DEFAULT_VM_HOST).diskReserveBytes,
    );
    await mkdir(dir, { recursive: true, mode: 0o700 });
    await qmp(proc, "stop");
    await setCapabilities(proc, {
      events: true,
      "x-ignore-shared": false,
      "pause-before-switchover": false,
      // Cleared by the fork that set it; cleared here too, as it would turn this save into a live one.
      "background-snapshot": false,
    });
    // No downtime-limit: the guest is stopped and dirties nothing, and QEMU lifts the cap for
    // the final pass anyway; 1 ms, QEMU's 300 ms and 2000 s measured the same (docs/snapshots-and-forks.md "Saves run with migration bandwidth uncapped").
    await setMigrationParameters(proc, { maxBandwidth: SUSPEND_MAX_BANDWIDTH });
    // No fsync (~30 ms of a 64 MB state): resuming also needs the VM's RAM file on tmpfs,
    // which a host crash loses anyway; an agent crash leaves the written pages in the page cache.
    const delta = await ownPagesDelta(vm, proc.pid, statePath);
    await saveToFile(proc, {
      path: statePath,
      ...(delta ? { split: delta } : {}),
      maxBytes: migrationByteCap(vm.shape.memMib),
      timeoutMs: SUSPEND_TIMEOUT_MS,
    });
    // What the disk keeps for its memory: the state file.
    const memBytes = (await stat(statePath)).size;
    const chain = await openChainStore(vm.shape.dataDir);
    await chain.add(statePath, { kind: "state", holder: vm.holder, deps: [vm.memPath] });
    await vm.detach();
    // The save read every guest page through the private mapping of the shared RAM file, which
    // filled the file's holes with zero pages (sparse.ts): punched again later, once for the
    // suspends that come meanwhile (sparse.ts DIG_DELAY_MS).
    digLater(vm.memPath, vm.log);
    vm.suspendState = statePath;
    vm.enter("suspended");
    return ok({ memBytes, suspendMs: performance.now() - t0 });
  } catch (err) {
    const e = asSnapshotError(err, "suspend_failed", `suspending VM ${vm.id} failed`);
    await rm(statePath, { force: true });
    if (proc.isAlive()) {
      // The save failed but the VM is whole: let it run on.
      await bestEffort(vm.log, `resuming VM ${vm.id} after its save failed`, proc.qmp.execute("cont"));
      vm.enter("running");
    } else await vm.destroy();
    return fail(e);
  }
}

/**
 * The suspend's delta over the VM's RAM file: its own pages, read while it is stopped. Without
 * them (the mapping not found, a pagemap that cannot be read), undefined: the whole RAM is saved,
 * as correct and only bigger.
 */
async function ownPagesDelta(
  vm: SandboxVm,
  pid: number,
  statePath: string,
): Promise<SplitTarget | undefined> {
  const ramBytes = vm.shape.memMib * 1024 * 1024;
  try {
    const keep = await ownPages(pid, vm.memPath);
    if (keep.length * PAGE_BYTES !== ramBytes)
      throw new SnapshotError("suspend_failed", `a mapping of ${keep.length} pages`);
    return { ramBlock: DEVICE_IDS.memBackend, ramBytes, statePath, keep };
  } catch (err) {
    vm.log(`suspend ${vm.id}: its own pages are unknown (${String(err)}); saving the whole RAM`);
    return undefined;
  }
}

/** `readyTimeoutMs`: restore to the guest's first answer (default RESTORE_READY_TIMEOUT_MS, vm.ts). */
export async function resumeVm(
  vm: SandboxVm,
  o: { readyTimeoutMs?: number } = {},
): Promise<Result<RestoreTimings>> {
  const bad = vm.begin(["suspended"], "resuming");
  if (bad) return fail(bad);
  const statePath = vm.suspendState;
  if (!statePath) {
    vm.enter("suspended");
    return fail(new SnapshotError("spawn_failed", `VM ${vm.id} cannot resume: no state file`));
  }
  try {
    const timings = await restoreInto({
      sameMachine: true,
      vm,
      mem: { path: vm.memPath, share: false },
      statePath,
      ignoreShared: false,
      ...(o.readyTimeoutMs ? { readyTimeoutMs: o.readyTimeoutMs } : {}),
    });
    vm.suspendState = undefined;
    vm.enter("running");
    const chain = await openChainStore(vm.shape.dataDir);
    await chain.release(vm.holder, [statePath]);
    // Each page the load wrote (the VM's own pages; all of them for an older agent's full state)
    // faulted a zero page into the shared file's hole first, where it had one (sparse.ts).
    digLater(vm.memPath, vm.log);
    return ok(timings);
  } catch (err) {
    // The state file is intact: the VM stays suspended and may be resumed again (or destroyed).
    vm.enter("suspended");
    return fail(asSnapshotError(err, "spawn_failed", `resuming VM ${vm.id} failed`));
  }
}

/** Idle: stop the vCPUs (QEMU keeps the RAM). */
export async function pauseVm(vm: SandboxVm): Promise<Result<void>> {
  const bad = vm.begin(["running"], "paused");
  if (bad) return fail(bad);
  try {
    if (!vm.process) throw new SnapshotError("vm_died", `VM ${vm.id} has no QEMU`);
    await qmp(vm.process, "stop");
    return ok(undefined);
  } catch (err) {
    const e = asSnapshotError(err, "vm_died", `pausing VM ${vm.id} failed`);
    if (vm.process?.isAlive()) vm.enter("running");
    else await vm.destroy();
    return fail(e);
  }
}

/** Back from idle: `cont`, then the wall clock (it stood still while paused). */
export async function unpauseVm(vm: SandboxVm): Promise<Result<void>> {
  const bad = vm.begin(["paused"], "running");
  if (bad) return fail(bad);
  try {
    if (!vm.process || !vm.guest) throw new SnapshotError("vm_died", `VM ${vm.id} has no QEMU`);
    await qmp(vm.process, "cont");
    await vm.guest.setClock(new Date());
    return ok(undefined);
  } catch (err) {
    const e = asSnapshotError(err, "vm_died", `unpausing VM ${vm.id} failed`);
    if (!vm.process?.isAlive()) await vm.destroy();
    return fail(e);
  }
}
