/**
 * `sandboxd bench`: the snapshot engine's figures on this host, measured end to end on real VMs,
 * next to a bare QEMU restore of the same snapshot measured in the same run (`floorRestoreMs`).
 * docs/benchmarks.md says what each figure is; the targets live here (never in timed tests).
 *
 * Everything the benchmark makes (VM dirs, overlays, the template and its RAM file, fork and
 * suspend state) lives in two scratch dirs of its own: `$TMPDIR/sandboxd-bench-XXXXXX` (used as
 * the engine's data dir) and `/dev/shm/sandboxd-bench-XXXXXX` (RAM files). Both are removed at
 * the end, on error and on abort, after every QEMU whose command line names them is killed. Only
 * the caches of the real data dir are used: guest artifacts and the imported image (as `run`).
 */
import { mkdtemp } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { ensureGuestArtifacts } from "../agent/guest/artifacts.ts";
import { importImage } from "../agent/image/import.ts";
import { probeAccelerator } from "../agent/qemu/accel.ts";
import { DEFAULT_VM_HOST } from "../agent/vm/host-settings.ts";
import { measureKept } from "./engine-kept.ts";
import { type BenchResult, TARGETS, target } from "./engine-result.ts";
import { Interrupted, Scope } from "./engine-scope.ts";
import {
  type BenchOptions,
  IDLE_VMS,
  makeTemplate,
  measureBoot,
  measureExec,
  measureForkChildren,
  measureForkStalls,
  measureIdleMemory,
  measureSpawns,
  measureSuspendResume,
  type Run,
  spawner,
} from "./engine-steps.ts";
import { round1, round2, summarize } from "./stats.ts";

export { type BenchOptions, FORK_CHILDREN, IDLE_VMS } from "./engine-steps.ts";

export async function runBench(o: BenchOptions): Promise<BenchResult> {
  const log = o.log ?? (() => {});
  const tStart = performance.now();
  const dataDir = await mkdtemp(join(tmpdir(), "sandboxd-bench-"));
  const shmRoot = await mkdtemp("/dev/shm/sandboxd-bench-");
  const scope = new Scope(dataDir, shmRoot, o.signal);
  log(`scratch dirs ${dataDir} ${shmRoot} (removed at the end)`);
  let cleaning: Promise<void> | undefined;
  const onAbort = () => {
    log("interrupted: freeing every VM and file of the run");
    cleaning = scope.cleanup();
  };
  o.signal?.addEventListener("abort", onAbort, { once: true });
  try {
    const result = await measureAll(o, log, scope);
    await scope.cleanup();
    result.total_ms = round1(performance.now() - tStart);
    return result;
  } catch (err) {
    throw scope.aborted ? new Interrupted() : err;
  } finally {
    o.signal?.removeEventListener("abort", onAbort);
    await cleaning;
    await scope.cleanup();
  }
}

/** Every figure, step by step, on the caches of `o.dataDir` and the scratch dirs of `scope`. */
async function measureAll(o: BenchOptions, log: (m: string) => void, scope: Scope): Promise<BenchResult> {
  const { run, vmSpec, accel } = await prepareRun(o, log, scope);
  const bootMs = await measureBoot(run, vmSpec);
  const { template, templateSnapshotMs } = await makeTemplate(run, vmSpec);

  const sp = spawner(run, template);
  const spawns = await measureSpawns(run, sp);
  const parent = (await sp.spawn()).vm;
  const execMs = await measureExec(run, parent);
  const stalls = await measureForkStalls(run, parent);
  const fork = await measureForkChildren(run, sp, parent, stalls.method);
  // Before the suspend and resume: a snapshot's capture reads every page of its source's RAM,
  // which fills the template's RAM file's holes, and those dig them again (template_ram_file_mb).
  const kept = await measureKept(run, sp, stalls.method);
  const suspend = await measureSuspendResume(run, parent);
  await scope.release(parent);
  const idle = await measureIdleMemory(run, sp, template);

  const spawnVsFloor = round2(spawns.spawnMs.p50 / spawns.floorMs.p50);
  const forkVsFloor = round2(fork.fork.readyMs / fork.floorMs);
  const stallSummary = summarize(stalls.stalls);
  const vsFloor = (s: { p50: number }) => round2(s.p50 / spawns.floorMs.p50);
  const restoreGoal = target(kept.rollbackMs.p50, TARGETS.restoreInPlaceBelowMs, "below");
  // A finding, not a failure: the run goes on and exits 0 either way.
  log(
    `restore in place p50 ${restoreGoal.value} ms: goal < ${restoreGoal.limit} ms ${restoreGoal.pass ? "met" : "not met"}`,
  );
  return {
    accel: accel.accel,
    accel_reason: accel.reason,
    guest_mem_mib: o.memMib,
    vcpus: o.vcpus,
    boot_ms: round1(bootMs),
    template_snapshot_ms: round1(templateSnapshotMs),
    spawn_ms: spawns.spawnMs,
    spawn_restore_ms: spawns.spawnRestoreMs,
    spawn_parts_ms: spawns.spawnParts,
    spawn_prelaunched_ms: spawns.preMs,
    prelaunch_ms: spawns.prelaunchMs,
    floor_restore_ms: spawns.floorMs,
    spawn_vs_floor: spawnVsFloor,
    exec_rtt_ms: execMs,
    fork_method: stalls.method,
    fork_parent_stall_ms: stallSummary.p50,
    fork_parent_stall_summary_ms: stallSummary,
    fork_stop_copy_stall_ms: summarize(stalls.stopCopyStalls),
    fork_populate_ms: summarize(stalls.populates),
    fork_children_stall_ms: round1(fork.fork.stallMs),
    fork_children: fork.children,
    fork_children_ms: round1(fork.fork.ms),
    fork_children_ready_ms: round1(fork.fork.readyMs),
    fork_children_floor_ms: round1(fork.floorMs),
    fork_children_vs_floor: forkVsFloor,
    fork_children_exec_vs_floor: round2(fork.fork.ms / fork.floorMs),
    fork_children_breakdown_ms: fork.fork.breakdown,
    fork_children_stop_copy: {
      stall_ms: round1(fork.stopCopy.stallMs),
      ready_ms: round1(fork.stopCopy.readyMs),
      ms: round1(fork.stopCopy.ms),
      vs_floor: round2(fork.stopCopy.readyMs / fork.floorMs),
      breakdown_ms: fork.stopCopy.breakdown,
    },
    snapshot_stall_ms: round1(kept.stallMs),
    snapshot_stall_vs_fork_stall: round2(kept.stallMs / stallSummary.p50),
    snapshot_ms: round1(kept.takeMs),
    snapshot_bytes: kept.bytes,
    restore_in_place_ms: kept.rollbackMs,
    restore_in_place_down_ms: kept.downMs,
    restore_in_place_cold_ms: kept.coldRollbackMs,
    restore_in_place_parts_ms: kept.parts,
    restore_in_place_vs_floor: vsFloor(kept.rollbackMs),
    restore_in_place_down_vs_floor: vsFloor(kept.downMs),
    from_snapshot_ms: kept.fromSnapshotMs,
    from_snapshot_vs_floor: vsFloor(kept.fromSnapshotMs),
    from_snapshot_vs_spawn_restore: round2(kept.fromSnapshotMs.p50 / spawns.spawnRestoreMs.p50),
    suspend_ms: round1(suspend.suspendMs),
    resume_ms: round1(suspend.resumeMs),
    idle_vms: IDLE_VMS,
    host_rss_per_idle_vm_mb: idle.memory.pss,
    host_memory_per_idle_vm_mb: idle.memory,
    template_ram_file_mb: idle.ramFileMb,
    total_ms: 0,
    targets: {
      spawn_vs_floor: target(spawnVsFloor, TARGETS.spawnVsFloorMax, "max"),
      exec_rtt_p50_ms: target(execMs.p50, TARGETS.execRttP50BelowMs, "below"),
      fork_parent_stall_ms: target(stallSummary.p50, TARGETS.forkStallBelowMs, "below"),
      fork_children_ms: target(round1(fork.fork.ms), TARGETS.forkChildrenBelowMs, "below"),
      fork_children_vs_floor: target(forkVsFloor, TARGETS.forkChildrenVsFloorMax, "max"),
      host_rss_per_idle_vm_mb: target(idle.memory.pss, TARGETS.rssBelowMb, "below"),
      restore_in_place_ms: restoreGoal,
    },
  };
}

/** The run's inputs: the guest artifacts and the image from the data dir's caches, the accelerator. */
async function prepareRun(o: BenchOptions, log: (m: string) => void, scope: Scope) {
  const host = o.host ?? DEFAULT_VM_HOST;
  scope.check();
  const artifacts = await ensureGuestArtifacts({ dataDir: o.dataDir, log });
  const [accel, image] = await Promise.all([
    probeAccelerator({
      artifacts,
      log,
      ...(o.accelSetting !== undefined ? { setting: o.accelSetting } : {}),
    }),
    importImage({
      source: o.image,
      dataDir: o.dataDir,
      log,
      trustedSource: true,
      diskReserveBytes: host.diskReserveBytes,
    }),
  ]);
  log(`accelerator ${accel.accel} (${accel.reason}); ${o.memMib} MiB, ${o.vcpus} vCPU`);
  const run: Run = {
    o,
    log,
    scope,
    dataDir: scope.dataDir,
    shmRoot: scope.shmRoot,
    config: image.config,
    host,
  };
  const vmSpec = {
    dataDir: run.dataDir,
    image,
    artifacts,
    accel: accel.accel,
    memMib: o.memMib,
    vcpus: o.vcpus,
  };
  return { run, vmSpec, accel };
}
