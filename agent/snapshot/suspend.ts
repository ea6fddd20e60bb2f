/**
 * Suspend to disk / resume, and pause / unpause for idle VMs.
 *
 * Suspend: `stop`, migrate the whole RAM and device state, end QEMU. The stream is split as it
 * arrives (ram-split.ts) into a memory image, `<dataDir>/storage/suspended/<id>-<tag>.mem` (the
 * guest's RAM at its offsets, zero pages as holes), and a ~60 KB device state beside it (`.state`,
 * x-ignore-shared form). The overlay stays where it is. Resume: a new QEMU on the same overlay
 * mapping the memory image private (copy-on-write: pages come in from the page cache as the guest
 * touches them), loading only the device state, then a fresh clock and entropy (the guest slept;
 * its CRNG state was on disk). Measured on a 256 MiB busybox guest under TCG: loading the whole
 * 64 MB stream made a resume ~390 ms, about 4x its suspend; loading 60 KB makes it about a spawn.
 *
 * The suspended VM then needs nothing on tmpfs: its RAM file is the image on the data disk (the
 * RAM file it mapped before, a template's or a fork point's, is released). Suspends of VMs saved
 * by an older agent (one full stream over the old RAM file: `splitSuspend` false) still resume.
 */
import { randomBytes } from "node:crypto";
import { mkdir, rm, stat } from "node:fs/promises";
import { join } from "node:path";
import { bestEffort } from "../../contracts/best-effort.ts";
import { needFreeSpace } from "../../contracts/disk-space.ts";
import { DEVICE_IDS } from "../qemu/launch.ts";
import { openChainStore } from "../storage/chain.ts";
import { DEFAULT_VM_HOST } from "../vm/host-settings.ts";
import { asSnapshotError, fail, ok, type Result, SnapshotError } from "./errors.ts";
import { LOCAL_MIGRATION_MAX_BANDWIDTH, qmp, setCapabilities, setMigrationParameters } from "./migrate.ts";
import { digZeroHoles } from "./sparse.ts";
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
  // A name of its own per suspend: the image of the previous one may still be this VM's RAM file.
  const name = `${vm.id}-${randomBytes(3).toString("hex")}`;
  const statePath = join(dir, `${name}.state`);
  const ramPath = join(dir, `${name}.mem`);
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
      // The stream's header form the resume loads (ram-split.ts); no block is ignored, as the
      // VM maps its RAM private.
      "x-ignore-shared": true,
      "pause-before-switchover": false,
      // Cleared by the fork that set it; cleared here too, as it would turn this save into a live one.
      "background-snapshot": false,
    });
    // No downtime-limit: the guest is stopped and dirties nothing, and QEMU lifts the cap for
    // the final pass anyway; 1 ms, QEMU's 300 ms and 2000 s measured the same (docs/snapshots-and-forks.md "Saves run with migration bandwidth uncapped").
    await setMigrationParameters(proc, { maxBandwidth: SUSPEND_MAX_BANDWIDTH });
    // No fsync (~30 ms of a 64 MB state): resuming also needs the VM's RAM file on tmpfs,
    // which a host crash loses anyway; an agent crash leaves the written pages in the page cache.
    await saveToFile(proc, {
      path: statePath,
      split: {
        ramBlock: DEVICE_IDS.memBackend,
        ramBytes: vm.shape.memMib * 1024 * 1024,
        ramPath,
        statePath,
      },
      maxBytes: migrationByteCap(vm.shape.memMib),
      timeoutMs: SUSPEND_TIMEOUT_MS,
    });
    const chain = await openChainStore(vm.shape.dataDir);
    await chain.add(ramPath, { kind: "ram", holder: vm.holder });
    await chain.add(statePath, { kind: "state", holder: vm.holder, deps: [ramPath] });
    // What the disk keeps: the image's blocks (its zero pages are holes) and the device state.
    const memBytes = (await stat(ramPath)).blocks * 512 + (await stat(statePath)).size;
    await vm.detach();
    const formerRam = vm.memPath;
    vm.memPath = ramPath;
    vm.suspendState = statePath;
    vm.splitSuspend = true;
    vm.enter("suspended");
    // The RAM file it mapped is no longer its own (a fork point's is freed with its last user).
    await chain.release(vm.holder, [formerRam]);
    // The save read every guest page through the private mapping of the shared RAM file, which
    // filled the file's holes with zero pages (sparse.ts): punch them again, off the caller's
    // path, where the file is still in use by others.
    if (chain.get(formerRam) !== undefined) void digZeroHoles(formerRam, vm.log);
    return ok({ memBytes, suspendMs: performance.now() - t0 });
  } catch (err) {
    const e = asSnapshotError(err, "suspend_failed", `suspending VM ${vm.id} failed`);
    await rm(statePath, { force: true });
    await rm(ramPath, { force: true });
    if (proc.isAlive()) {
      // The save failed but the VM is whole: let it run on.
      await bestEffort(vm.log, `resuming VM ${vm.id} after its save failed`, proc.qmp.execute("cont"));
      vm.enter("running");
    } else await vm.destroy();
    return fail(e);
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
    const split = vm.splitSuspend;
    const timings = await restoreInto({
      sameMachine: true,
      vm,
      mem: { path: vm.memPath, share: false },
      statePath,
      ignoreShared: split,
      ...(o.readyTimeoutMs ? { readyTimeoutMs: o.readyTimeoutMs } : {}),
    });
    vm.suspendState = undefined;
    vm.splitSuspend = false;
    vm.enter("running");
    const chain = await openChainStore(vm.shape.dataDir);
    await chain.release(vm.holder, [statePath]);
    // An older agent's full stream wrote every page of the private mapping, and each first write
    // faulted a zero page into the shared file's hole before copying it (sparse.ts): punch them
    // again. A split suspend's load writes no page.
    if (!split) void digZeroHoles(vm.memPath, vm.log);
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
