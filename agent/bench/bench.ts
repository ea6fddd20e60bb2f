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
import { mkdtemp, rm, stat } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { ensureGuestArtifacts } from "../guest/artifacts.ts";
import type { ImageConfig } from "../image/import.ts";
import { importImage } from "../image/import.ts";
import { probeAccelerator } from "../qemu/accel.ts";
import type { Accel } from "../qemu/launch.ts";
import { unwrap } from "../snapshot/errors.ts";
import { forkVm } from "../snapshot/fork.ts";
import { DEFAULT_FORK_METHOD, type ForkMethod, readyForkMethod } from "../snapshot/fork-method.ts";
import { floorRestoreMs, prelaunchFromTemplate, spawnFromTemplate } from "../snapshot/spawn.ts";
import { pauseVm, resumeVm, suspendVm } from "../snapshot/suspend.ts";
import { buildTemplate, deleteTemplate, type TemplateMeta } from "../snapshot/template.ts";
import type { SandboxVm } from "../snapshot/vm.ts";
import { forgetChainStore } from "../storage/chain.ts";
import { bootVm } from "../vm/boot.ts";
import { DEFAULT_VM_HOST, type VmHostSettings } from "../vm/host-settings.ts";
import { killQemusNaming } from "../vm/process.ts";
import { type MemFields, qemuMemory } from "./rss.ts";
import { round1, round2, type Summary, summarize } from "./stats.ts";

export interface BenchOptions {
  /** Data dir whose caches (guest artifacts, imported images) are used. Nothing else is written there. */
  dataDir: string;
  /** Image archive (docker save tar, oci-archive tar or OCI layout dir); it needs a `true` in PATH. */
  image: string;
  memMib: number;
  vcpus: number;
  /** Timed spawns (and as many floor restores, interleaved with them). */
  spawns: number;
  /** Timed `true` round trips on one warm sandbox. */
  execs: number;
  /** Children of the timed fork (default FORK_CHILDREN). */
  forkChildren?: number;
  /** How forks copy memory (default: the agent's default, a background snapshot). */
  forkMethod?: ForkMethod;
  /** The operator's `SANDBOXD_ACCEL` (auto, kvm, tcg); default auto, the probe. */
  accelSetting?: string;
  /** The operator's jail and disk-reserve settings; default DEFAULT_VM_HOST. */
  host?: VmHostSettings;
  /** Aborting kills every VM, removes every file, and makes runBench reject. */
  signal?: AbortSignal;
  log?: (m: string) => void;
}

/** A goal: `spawn_vs_floor` must be at most `limit`, every other figure below it. */
export interface Target {
  limit: number;
  value: number;
  pass: boolean;
}

export interface MemoryBreakdown {
  /** Mean over the idle VMs, MiB: PSS of the whole QEMU process (= host_rss_per_idle_vm_mb). */
  pss: number;
  /** Plain RSS (shared pages counted fully in every process): an upper bound, for reference. */
  rss: number;
  /** Pages only this QEMU has and wrote: QEMU's heap and code cache + the guest's dirtied pages. */
  private_dirty: number;
  /** Guest pages this VM wrote since the restore (copy-on-write copies of template RAM). */
  guest_ram_dirty: number;
  /** Template RAM pages the guest read, shared with the other VMs, PSS (1/N of each page). */
  guest_ram_shared: number;
  /** Everything outside the guest RAM mapping, PSS: QEMU itself (TCG's code cache included). */
  qemu_own: number;
}

export interface BenchResult {
  accel: Accel;
  accel_reason: string;
  guest_mem_mib: number;
  vcpus: number;
  /** QEMU start of a cold boot until the first exec (`true`) answered. */
  boot_ms: number;
  /** Freezing the booted template VM: stop + device-state save (RAM stays in its shared file). */
  template_snapshot_ms: number;
  /**
   * A cold spawn (the agent's pre-launch pool empty): spawnFromTemplate call to its return, overlay
   * made, jail built, QEMU started and restored, HELLO answered, identity set.
   */
  spawn_ms: Summary;
  /** The restore part of spawn_ms (QEMU start to identity set), as the engine times it. */
  spawn_restore_ms: Summary;
  /**
   * A spawn that takes a QEMU pre-launched in its jail (the agent's pool hit, the usual case):
   * spawnFromTemplate with `prelaunched` to its return: state loaded, `cont`, HELLO, identity.
   */
  spawn_prelaunched_ms: Summary;
  /** The pre-launch itself (overlay, jail, QEMU start, QMP), done ahead of the spawn, off its path. */
  prelaunch_ms: Summary;
  /** A bare QEMU restore of the same template, QEMU start to the guest's PING answer (floorRestoreMs). */
  floor_restore_ms: Summary;
  /** spawn_ms.p50 / floor_restore_ms.p50. */
  spawn_vs_floor: number;
  /** `true` round trips on a warm sandbox (exec request to its exit status). */
  exec_rtt_ms: Summary;
  /** The method the forks used (after readyForkMethod: a snapshot may fall back to stop-copy). */
  fork_method: ForkMethod;
  /**
   * Time the parent's vCPUs stood still during a fork, QEMU's STOP to RESUME event timestamps:
   * the p50 of FORK_STALL_SAMPLES one-child forks by `fork_method`.
   */
  fork_parent_stall_ms: number;
  fork_parent_stall_summary_ms: Summary;
  /** The same one-child forks by stop-and-copy, interleaved with those: the reference. */
  fork_stop_copy_stall_ms: Summary;
  /** Snapshot: reading in the unmapped RAM pages before the stop (guest running), per fork. */
  fork_populate_ms: Summary;
  /** The stall of the timed fork of `fork_children` children. */
  fork_children_stall_ms: number;
  fork_children: number;
  /** forkVm call until all children answered an exec. */
  fork_children_ms: number;
  /**
   * The floor for that: as many bare QEMU restores of the template started at once, until every
   * guest answered (floorRestoreMs each): what the host allows that many VMs to come up in.
   */
  fork_children_floor_ms: number;
  /** Suspend to disk of a running sandbox (stop + full RAM save, QEMU ended). */
  suspend_ms: number;
  /** resumeVm call until the guest answered and its identity was set. */
  resume_ms: number;
  idle_vms: number;
  /** Mean PSS of the idle, paused sandboxes' QEMU processes, MiB. */
  host_rss_per_idle_vm_mb: number;
  host_memory_per_idle_vm_mb: MemoryBreakdown;
  /** The template's RAM file on tmpfs (paid once per template, not per VM), MiB. */
  template_ram_file_mb: number;
  total_ms: number;
  targets: {
    spawn_vs_floor: Target;
    exec_rtt_p50_ms: Target;
    fork_parent_stall_ms: Target;
    fork_children_ms: Target;
    host_rss_per_idle_vm_mb: Target;
  };
}

/** The engine's goals. Here only: timed tests never assert speed. */
export const TARGETS = {
  /** Spawn p50 at most 1.3x a bare QEMU restore: our code adds at most 30 %. */
  spawnVsFloorMax: 1.3,
  /** A warm exec round trip below 15 ms. */
  execRttP50BelowMs: 15,
  /** A fork stops the parent for less than 50 ms (forkd pauses its parent 56 ms). */
  forkStallBelowMs: 50,
  /** 8 children all answering within 1 s of the fork call. */
  forkChildrenBelowMs: 1000,
  /** An idle sandbox costs the host less than 40 MiB. */
  rssBelowMb: 40,
} as const;

export const FORK_CHILDREN = 8;
/** One-child forks timed for the stall by each method: a p50 of 3 is steady enough here. */
const FORK_STALL_SAMPLES = 3;
export const IDLE_VMS = 8;
/** Untimed `true` runs before the RTT sample: the first ones after a restore pay TCG's re-translation. */
const EXEC_WARMUP = 5;
/** Guest-side limit of one `true`: it answers in milliseconds; 20 s means the guest is gone. */
const EXEC_TIMEOUT_MS = 20_000;
/** Cold boot budget: ~3 s under TCG here; 60 s covers a loaded CI host. */
const BOOT_TIMEOUT_MS = 60_000;
/** Idle sandboxes run this long before they are paused, then rest this long before the reading. */
const IDLE_RUN_MS = 1000;
const IDLE_PAUSED_MS = 500;

const MIB_KB = 1024;

class Interrupted extends Error {
  constructor() {
    super("benchmark interrupted");
    this.name = "Interrupted";
  }
}

interface Destroyable {
  destroy(): Promise<void>;
}

/** What the run made, so that an error or an abort frees all of it. */
class Scope {
  readonly vms = new Set<Destroyable>();
  template: TemplateMeta | undefined;
  constructor(
    readonly dataDir: string,
    readonly shmRoot: string,
    readonly signal: AbortSignal | undefined,
  ) {}

  get aborted(): boolean {
    return this.signal?.aborted ?? false;
  }

  check(): void {
    if (this.aborted) throw new Interrupted();
  }

  track<T extends Destroyable>(vm: T): T {
    this.vms.add(vm);
    if (this.aborted) {
      this.release(vm).catch(() => {}); // cleanup() retries what is left
      throw new Interrupted();
    }
    return vm;
  }

  async release(vm: Destroyable): Promise<void> {
    this.vms.delete(vm);
    await vm.destroy();
  }

  /** Re-runnable: frees whatever exists now (a step still in flight may add more; run again after it). */
  async cleanup(): Promise<void> {
    await Promise.allSettled([...this.vms].map((vm) => this.release(vm)));
    if (this.template) {
      const id = this.template.id;
      this.template = undefined;
      await deleteTemplate(this.dataDir, id).catch(() => {});
    }
    // A QEMU started by a step that was still in flight is not tracked yet: its command line
    // names our scratch dirs (unique to this run), which is how we find it.
    await killQemusNaming([this.dataDir, this.shmRoot]);
    forgetChainStore(this.dataDir);
    await rm(this.dataDir, { recursive: true, force: true });
    await rm(this.shmRoot, { recursive: true, force: true });
  }
}

function sleep(ms: number, scope: Scope): Promise<void> {
  scope.check();
  return new Promise((resolve) => {
    const t = setTimeout(done, ms);
    function done() {
      clearTimeout(t);
      scope.signal?.removeEventListener("abort", done);
      resolve();
    }
    scope.signal?.addEventListener("abort", done, { once: true });
  });
}

type Execer = { exec: SandboxVm["exec"] };

/** Runs `true` as the image's config says; anything but exit 0 is an error. Returns wall ms. */
async function runTrue(vm: Execer, config: ImageConfig): Promise<number> {
  const t0 = performance.now();
  const r = await vm.exec({ argv: ["true"], env: config.env, cwd: "/", timeoutMs: EXEC_TIMEOUT_MS });
  const ms = performance.now() - t0;
  if (r.exitCode !== 0)
    throw new Error(
      `\`true\` in the guest ${r.timedOut ? "timed out" : `exited ${r.exitCode ?? `by signal ${r.signal}`}`}: ` +
        r.stderr.toString("utf8").slice(-500),
    );
  return ms;
}

function mib(kb: number): number {
  return round1(kb / MIB_KB);
}

function mean(xs: number[]): number {
  return xs.reduce((a, b) => a + b, 0) / Math.max(1, xs.length);
}

export async function runBench(o: BenchOptions): Promise<BenchResult> {
  const log = o.log ?? (() => {});
  const tStart = performance.now();
  const host = o.host ?? DEFAULT_VM_HOST;
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
    const config = image.config;
    log(`accelerator ${accel.accel} (${accel.reason}); ${o.memMib} MiB, ${o.vcpus} vCPU`);

    // -- cold boot
    scope.check();
    const booted = scope.track(
      await bootVm({
        dataDir,
        image,
        artifacts,
        accel: accel.accel,
        memMib: o.memMib,
        vcpus: o.vcpus,
        bringupTimeoutMs: BOOT_TIMEOUT_MS,
        jail: host.jail,
      }),
    );
    const bootMs = booted.bootMs + (await runTrue(booted.guest, config));
    await scope.release(booted);
    log(`boot: ${bootMs.toFixed(0)} ms to the first exec`);

    // -- template
    scope.check();
    const template = unwrap(
      await buildTemplate({
        dataDir,
        image,
        artifacts,
        accel: accel.accel,
        id: "bench",
        memMib: o.memMib,
        vcpus: o.vcpus,
        shmRoot,
        bringupTimeoutMs: BOOT_TIMEOUT_MS,
        host,
      }),
    );
    scope.template = template;
    const templateSnapshotMs = template.timings?.snapshotMs ?? Number.NaN;
    log(`template: snapshot ${templateSnapshotMs.toFixed(1)} ms, state ${template.stateBytes} B`);

    const spawn = async (): Promise<{ vm: SandboxVm; wallMs: number; readyMs: number }> => {
      scope.check();
      const t0 = performance.now();
      const s = unwrap(await spawnFromTemplate({ dataDir, template, host }));
      const wallMs = performance.now() - t0;
      scope.track(s.vm);
      return { vm: s.vm, wallMs, readyMs: s.timings.readyMs };
    };
    const spawnPrelaunched = async (): Promise<{ vm: SandboxVm; wallMs: number; launchMs: number }> => {
      scope.check();
      const t0 = performance.now();
      const pre = unwrap(await prelaunchFromTemplate({ dataDir, template, host }));
      const launchMs = performance.now() - t0;
      scope.track(pre.vm);
      const t1 = performance.now();
      const s = unwrap(await spawnFromTemplate({ dataDir, template, host, prelaunched: pre }));
      return { vm: s.vm, wallMs: performance.now() - t1, launchMs };
    };
    const floor = async (): Promise<number> => {
      scope.check();
      return (await floorRestoreMs({ dataDir, template, host })).totalMs;
    };

    // -- spawn vs. the floor, interleaved (alternating which goes first) so both see the same host
    {
      // One untimed round: the first of each pays for cold code paths on our side and QEMU's.
      const w = await spawn();
      await scope.release(w.vm);
      const p = await spawnPrelaunched();
      await scope.release(p.vm);
      await floor();
    }
    const spawnWall: number[] = [];
    const spawnReady: number[] = [];
    const preWall: number[] = [];
    const preLaunch: number[] = [];
    const floors: number[] = [];
    for (let i = 0; i < o.spawns; i++) {
      if (i % 2 === 1) floors.push(await floor());
      const s = await spawn();
      spawnWall.push(s.wallMs);
      spawnReady.push(s.readyMs);
      await scope.release(s.vm);
      const p = await spawnPrelaunched();
      preWall.push(p.wallMs);
      preLaunch.push(p.launchMs);
      await scope.release(p.vm);
      if (i % 2 === 0) floors.push(await floor());
    }
    const spawnMs = summarize(spawnWall);
    const preMs = summarize(preWall);
    const floorMs = summarize(floors);
    log(`spawn p50: cold ${spawnMs.p50} ms, pre-launched ${preMs.p50} ms; floor p50 ${floorMs.p50} ms`);

    // -- exec round trips on a warm sandbox
    const parent = (await spawn()).vm;
    for (let i = 0; i < EXEC_WARMUP; i++) await runTrue(parent, config);
    const rtts: number[] = [];
    for (let i = 0; i < o.execs; i++) {
      scope.check();
      rtts.push(await runTrue(parent, config));
    }
    const execMs = summarize(rtts);
    log(`exec rtt p50 ${execMs.p50} ms`);

    // -- the parent's stall: one-child forks by the method, interleaved with stop-and-copy ones
    const method = await readyForkMethod(o.forkMethod ?? DEFAULT_FORK_METHOD, log);
    const stalls: number[] = [];
    const stopCopyStalls: number[] = [];
    const populates: number[] = [];
    for (let i = 0; i < FORK_STALL_SAMPLES; i++) {
      for (const [k, m] of [method, "stop-copy" as const].entries()) {
        scope.check();
        const one = unwrap(await forkVm(parent, { count: 1, method: m }));
        for (const c of one.children) scope.track(c);
        (k === 0 ? stalls : stopCopyStalls).push(one.timings.parentStallMs);
        if (k === 0 && one.timings.method === "snapshot") populates.push(one.timings.populateMs);
        await Promise.all(one.children.map((c) => scope.release(c)));
      }
    }
    log(
      `fork stall p50: ${method} ${summarize(stalls).p50} ms, stop-copy ${summarize(stopCopyStalls).p50} ms`,
    );

    // -- fork of the running sandbox into 8 children, each answering an exec
    scope.check();
    const tFork = performance.now();
    const forkChildren = o.forkChildren ?? FORK_CHILDREN;
    const forked = unwrap(await forkVm(parent, { count: forkChildren, method }));
    for (const c of forked.children) scope.track(c);
    await Promise.all(forked.children.map((c) => runTrue(c, config)));
    const forkChildrenMs = performance.now() - tFork;
    const stall = forked.timings.parentStallMs;
    if (!(stall > 0)) throw new Error("the fork's STOP/RESUME events were not seen: no stall figure");
    await Promise.all(forked.children.map((c) => scope.release(c)));
    const tFloor = performance.now();
    await Promise.all(Array.from({ length: forkChildren }, floor));
    const forkChildrenFloorMs = performance.now() - tFloor;
    log(
      `fork: stall ${stall.toFixed(1)} ms, ${forkChildren} children in ${forkChildrenMs.toFixed(0)} ms (floor: ${forkChildren} bare restores at once ${forkChildrenFloorMs.toFixed(0)} ms)`,
    );

    // -- suspend to disk and resume (the parent, which runs on after its fork)
    scope.check();
    await runTrue(parent, config);
    let t0 = performance.now();
    unwrap(await suspendVm(parent));
    const suspendMs = performance.now() - t0;
    scope.check();
    t0 = performance.now();
    unwrap(await resumeVm(parent));
    const resumeMs = performance.now() - t0;
    await runTrue(parent, config);
    await scope.release(parent);
    log(`suspend ${suspendMs.toFixed(0)} ms, resume ${resumeMs.toFixed(0)} ms`);

    // -- host memory of idle sandboxes
    const idle: SandboxVm[] = [];
    for (let i = 0; i < IDLE_VMS; i++) {
      const { vm } = await spawn();
      idle.push(vm);
      await runTrue(vm, config);
    }
    await sleep(IDLE_RUN_MS, scope);
    for (const vm of idle) unwrap(await pauseVm(vm));
    await sleep(IDLE_PAUSED_MS, scope);
    const mems = await Promise.all(
      idle.map((vm) => {
        const pid = vm.process?.pid;
        if (pid === undefined) throw new Error(`idle VM ${vm.id} has no QEMU`);
        return qemuMemory(pid, template.memPath);
      }),
    );
    const avg = (f: (m: { total: MemFields; guestRam: MemFields }) => number) => mib(mean(mems.map(f)));
    const memory: MemoryBreakdown = {
      pss: avg((m) => m.total.pss),
      rss: avg((m) => m.total.rss),
      private_dirty: avg((m) => m.total.privateDirty),
      guest_ram_dirty: avg((m) => m.guestRam.privateDirty),
      guest_ram_shared: avg((m) => m.guestRam.pss - m.guestRam.privateDirty),
      qemu_own: avg((m) => m.total.pss - m.guestRam.pss),
    };
    const ramFileMb = round1(((await stat(template.memPath)).blocks * 512) / 1024 ** 2);
    await Promise.all(idle.map((vm) => scope.release(vm)));
    log(`idle VMs: ${memory.pss} MiB PSS each (guest dirtied ${memory.guest_ram_dirty} MiB)`);

    const spawnVsFloor = round2(spawnMs.p50 / floorMs.p50);
    const result: BenchResult = {
      accel: accel.accel,
      accel_reason: accel.reason,
      guest_mem_mib: o.memMib,
      vcpus: o.vcpus,
      boot_ms: round1(bootMs),
      template_snapshot_ms: round1(templateSnapshotMs),
      spawn_ms: spawnMs,
      spawn_restore_ms: summarize(spawnReady),
      spawn_prelaunched_ms: preMs,
      prelaunch_ms: summarize(preLaunch),
      floor_restore_ms: floorMs,
      spawn_vs_floor: spawnVsFloor,
      exec_rtt_ms: execMs,
      fork_method: method,
      fork_parent_stall_ms: summarize(stalls).p50,
      fork_parent_stall_summary_ms: summarize(stalls),
      fork_stop_copy_stall_ms: summarize(stopCopyStalls),
      fork_populate_ms: summarize(populates),
      fork_children_stall_ms: round1(stall),
      fork_children: forkChildren,
      fork_children_ms: round1(forkChildrenMs),
      fork_children_floor_ms: round1(forkChildrenFloorMs),
      suspend_ms: round1(suspendMs),
      resume_ms: round1(resumeMs),
      idle_vms: IDLE_VMS,
      host_rss_per_idle_vm_mb: memory.pss,
      host_memory_per_idle_vm_mb: memory,
      template_ram_file_mb: ramFileMb,
      total_ms: 0,
      targets: {
        spawn_vs_floor: target(spawnVsFloor, TARGETS.spawnVsFloorMax, "max"),
        exec_rtt_p50_ms: target(execMs.p50, TARGETS.execRttP50BelowMs, "below"),
        fork_parent_stall_ms: target(summarize(stalls).p50, TARGETS.forkStallBelowMs, "below"),
        fork_children_ms: target(round1(forkChildrenMs), TARGETS.forkChildrenBelowMs, "below"),
        host_rss_per_idle_vm_mb: target(memory.pss, TARGETS.rssBelowMb, "below"),
      },
    };
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

function target(value: number, limit: number, kind: "max" | "below"): Target {
  return { limit, value, pass: kind === "max" ? value <= limit : value < limit };
}

export function isInterrupted(err: unknown): boolean {
  return err instanceof Interrupted;
}
