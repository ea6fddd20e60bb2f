/**
 * The options of one engine run and its measurements, one function per figure on the run's
 * template (engine.ts runs them in order and puts the figures together). Every VM a step makes is
 * tracked by the run's scope and released before the step returns.
 */
import { stat } from "node:fs/promises";
import type { ImageConfig } from "../agent/image/import.ts";
import { unwrap } from "../agent/snapshot/errors.ts";
import { forkVm } from "../agent/snapshot/fork.ts";
import { DEFAULT_FORK_METHOD, type ForkMethod, readyForkMethod } from "../agent/snapshot/fork-method.ts";
import { digScheduledNow } from "../agent/snapshot/sparse.ts";
import { floorRestoreMs, prelaunchFromTemplate, spawnFromTemplate } from "../agent/snapshot/spawn.ts";
import { pauseVm, resumeVm, suspendVm } from "../agent/snapshot/suspend.ts";
import { buildTemplate, type TemplateMeta } from "../agent/snapshot/template.ts";
import type { RestoreTimings, SandboxVm } from "../agent/snapshot/vm.ts";
import { type BootOptions, bootVm } from "../agent/vm/boot.ts";
import type { VmHostSettings } from "../agent/vm/host-settings.ts";
import { SandboxdError } from "../contracts/errors.ts";
import type { ForkBreakdown, MemoryBreakdown, SpawnParts } from "./engine-result.ts";
import { runTrue, type Scope, sleep } from "./engine-scope.ts";
import { type MemFields, qemuMemory } from "./rss.ts";
import { round1, type Summary, summarize } from "./stats.ts";

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

export const FORK_CHILDREN = 8;
/** One-child forks timed for the stall by each method: a p50 of 3 is steady enough here. */
const FORK_STALL_SAMPLES = 3;
export const IDLE_VMS = 8;
/** Untimed `true` runs before the RTT sample: the first ones after a restore pay TCG's re-translation. */
const EXEC_WARMUP = 5;
/** Cold boot budget: ~3 s under TCG here; 60 s covers a loaded CI host. */
const BOOT_TIMEOUT_MS = 60_000;
/** Idle sandboxes run this long before they are paused, then rest this long before the reading. */
const IDLE_RUN_MS = 1000;
const IDLE_PAUSED_MS = 500;

const MIB_KB = 1024;

function mib(kb: number): number {
  return round1(kb / MIB_KB);
}

function mean(xs: number[]): number {
  return xs.reduce((a, b) => a + b, 0) / Math.max(1, xs.length);
}

/** What every step of one run works with: its options, its scope, the engine's inputs. */
export interface Run {
  o: BenchOptions;
  log: (m: string) => void;
  scope: Scope;
  /** The run's scratch data dir (the engine's data dir for everything the run makes). */
  dataDir: string;
  shmRoot: string;
  config: ImageConfig;
  /** The operator's jail and disk-reserve settings every VM of the run gets. */
  host: VmHostSettings;
}

/** Boots, spawns and restores from the run's template, each tracked by the run's scope. */
export interface Spawner {
  /** A cold spawn (no pre-launched QEMU): its wall time and the engine's restore time. */
  spawn(): Promise<{ vm: SandboxVm; wallMs: number; timings: RestoreTimings }>;
  /** A pre-launch, then a spawn that takes it: the spawn's wall time and the launch's. */
  spawnPrelaunched(): Promise<{ vm: SandboxVm; wallMs: number; launchMs: number }>;
  /** A bare QEMU restore of the template: the floor. */
  floor(): Promise<number>;
}

/** What every VM of the run is made from: its image, the guest artifacts, the accelerator, its size. */
export type VmSpec = Pick<BootOptions, "dataDir" | "image" | "artifacts" | "accel" | "memMib" | "vcpus">;

/** A cold boot to the first exec's answer. */
export async function measureBoot(run: Run, vmSpec: VmSpec): Promise<number> {
  const { scope, host, log } = run;
  scope.check();
  const booted = scope.track(await bootVm({ ...vmSpec, bringupTimeoutMs: BOOT_TIMEOUT_MS, jail: host.jail }));
  const bootMs = booted.bootMs + (await runTrue(booted.guest, run.config));
  await scope.release(booted);
  log(`boot: ${bootMs.toFixed(0)} ms to the first exec`);
  return bootMs;
}

/** The run's template, which every spawn, fork and idle VM restores from. */
export async function makeTemplate(
  run: Run,
  vmSpec: VmSpec,
): Promise<{ template: TemplateMeta; templateSnapshotMs: number }> {
  const { scope, host, log } = run;
  scope.check();
  const template = unwrap(
    await buildTemplate({
      ...vmSpec,
      id: "bench",
      shmRoot: run.shmRoot,
      bringupTimeoutMs: BOOT_TIMEOUT_MS,
      host,
    }),
  );
  scope.template = template;
  const templateSnapshotMs = template.timings?.snapshotMs ?? Number.NaN;
  log(`template: snapshot ${templateSnapshotMs.toFixed(1)} ms, state ${template.stateBytes} B`);
  return { template, templateSnapshotMs };
}

export function spawner(run: Run, template: TemplateMeta): Spawner {
  const { scope, dataDir, host } = run;
  return {
    async spawn() {
      scope.check();
      const t0 = performance.now();
      const s = unwrap(await spawnFromTemplate({ dataDir, template, host }));
      const wallMs = performance.now() - t0;
      scope.track(s.vm);
      return { vm: s.vm, wallMs, timings: s.timings };
    },
    async spawnPrelaunched() {
      scope.check();
      const t0 = performance.now();
      const pre = unwrap(await prelaunchFromTemplate({ dataDir, template, host }));
      const launchMs = performance.now() - t0;
      scope.track(pre.vm);
      const t1 = performance.now();
      const s = unwrap(await spawnFromTemplate({ dataDir, template, host, prelaunched: pre }));
      return { vm: s.vm, wallMs: performance.now() - t1, launchMs };
    },
    async floor() {
      scope.check();
      return (await floorRestoreMs({ dataDir, template, host })).totalMs;
    },
  };
}

/** Spawn vs. the floor, interleaved (alternating which goes first) so both see the same host. */
export async function measureSpawns(
  run: Run,
  sp: Spawner,
): Promise<{
  spawnMs: Summary;
  spawnRestoreMs: Summary;
  spawnParts: SpawnParts;
  preMs: Summary;
  prelaunchMs: Summary;
  floorMs: Summary;
}> {
  const { scope } = run;
  {
    // One untimed round: the first of each pays for cold code paths on our side and QEMU's.
    const w = await sp.spawn();
    await scope.release(w.vm);
    const p = await sp.spawnPrelaunched();
    await scope.release(p.vm);
    await sp.floor();
  }
  const spawnWall: number[] = [];
  const spawnReady: number[] = [];
  const parts: Record<keyof SpawnParts, number[]> = {
    setup: [],
    launch: [],
    load: [],
    hello: [],
    identity: [],
  };
  const preWall: number[] = [];
  const preLaunch: number[] = [];
  const floors: number[] = [];
  for (let i = 0; i < run.o.spawns; i++) {
    if (i % 2 === 1) floors.push(await sp.floor());
    const s = await sp.spawn();
    spawnWall.push(s.wallMs);
    spawnReady.push(s.timings.readyMs);
    parts.setup.push(s.wallMs - s.timings.readyMs);
    parts.launch.push(s.timings.launchMs);
    parts.load.push(s.timings.incomingMs);
    parts.hello.push(s.timings.helloMs);
    parts.identity.push(s.timings.identityMs);
    await scope.release(s.vm);
    const p = await sp.spawnPrelaunched();
    preWall.push(p.wallMs);
    preLaunch.push(p.launchMs);
    await scope.release(p.vm);
    if (i % 2 === 0) floors.push(await sp.floor());
  }
  const spawnMs = summarize(spawnWall);
  const preMs = summarize(preWall);
  const floorMs = summarize(floors);
  run.log(`spawn p50: cold ${spawnMs.p50} ms, pre-launched ${preMs.p50} ms; floor p50 ${floorMs.p50} ms`);
  return {
    spawnMs,
    spawnRestoreMs: summarize(spawnReady),
    spawnParts: {
      setup: summarize(parts.setup),
      launch: summarize(parts.launch),
      load: summarize(parts.load),
      hello: summarize(parts.hello),
      identity: summarize(parts.identity),
    },
    preMs,
    prelaunchMs: summarize(preLaunch),
    floorMs,
  };
}

/** Exec round trips on a warm sandbox. */
export async function measureExec(run: Run, parent: SandboxVm): Promise<Summary> {
  for (let i = 0; i < EXEC_WARMUP; i++) await runTrue(parent, run.config);
  const rtts: number[] = [];
  for (let i = 0; i < run.o.execs; i++) {
    run.scope.check();
    rtts.push(await runTrue(parent, run.config));
  }
  const execMs = summarize(rtts);
  run.log(`exec rtt p50 ${execMs.p50} ms`);
  return execMs;
}

/** The parent's stall: one-child forks by the method, interleaved with stop-and-copy ones. */
export async function measureForkStalls(
  run: Run,
  parent: SandboxVm,
): Promise<{ method: ForkMethod; stalls: number[]; stopCopyStalls: number[]; populates: number[] }> {
  const { scope } = run;
  const method = await readyForkMethod(run.o.forkMethod ?? DEFAULT_FORK_METHOD, run.log);
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
  run.log(
    `fork stall p50: ${method} ${summarize(stalls).p50} ms, stop-copy ${summarize(stopCopyStalls).p50} ms`,
  );
  return { method, stalls, stopCopyStalls, populates };
}

/** One timed fork into `children` children, each answering an exec. */
export interface ForkFigures {
  stallMs: number;
  /** Fork call until every child answered with its identity set. */
  readyMs: number;
  /** Fork call until every child answered an exec. */
  ms: number;
  breakdown: ForkBreakdown;
}

/**
 * A fork of the running sandbox into `forkChildren` children by `method`, each answering an exec,
 * then the same fork by stop-and-copy, then the floor: as many bare restores at once.
 */
export async function measureForkChildren(
  run: Run,
  sp: Spawner,
  parent: SandboxVm,
  method: ForkMethod,
): Promise<{ children: number; fork: ForkFigures; stopCopy: ForkFigures; floorMs: number }> {
  const children = run.o.forkChildren ?? FORK_CHILDREN;
  const fork = await timedFork(run, parent, children, method);
  const stopCopy = await timedFork(run, parent, children, "stop-copy");
  const tFloor = performance.now();
  await Promise.all(Array.from({ length: children }, sp.floor));
  const floorMs = performance.now() - tFloor;
  run.log(
    `fork (${method}): stall ${fork.stallMs.toFixed(1)} ms, ${children} children answering in ${fork.readyMs.toFixed(0)} ms, an exec in ${fork.ms.toFixed(0)} ms; stop-copy: stall ${stopCopy.stallMs.toFixed(1)} ms, answering in ${stopCopy.readyMs.toFixed(0)} ms (floor: ${children} bare restores at once ${floorMs.toFixed(0)} ms)`,
  );
  return { children, fork, stopCopy, floorMs };
}

async function timedFork(
  run: Run,
  parent: SandboxVm,
  children: number,
  method: ForkMethod,
): Promise<ForkFigures> {
  const { scope } = run;
  scope.check();
  const tFork = performance.now();
  const forked = unwrap(await forkVm(parent, { count: children, method }));
  for (const c of forked.children) scope.track(c);
  const tReady = performance.now();
  await Promise.all(forked.children.map((c) => runTrue(c, run.config)));
  const ms = performance.now() - tFork;
  const t = forked.timings;
  if (!(t.parentStallMs > 0))
    throw new SandboxdError("internal", "the fork's STOP/RESUME events were not seen: no stall figure");
  await Promise.all(forked.children.map((c) => scope.release(c)));
  const per = (f: (c: RestoreTimings) => number) => {
    const s = summarize(t.children.map(f));
    return { p50: s.p50, max: round1(Math.max(...t.children.map(f))) };
  };
  return {
    stallMs: t.parentStallMs,
    readyMs: t.totalMs,
    ms,
    breakdown: {
      prepare: round1(t.prepareMs),
      populate: round1(t.populateMs),
      parent_stall: round1(t.parentStallMs),
      stream: round1(t.method === "snapshot" ? t.precopyMs : 0),
      child_base: round1(t.childBaseMs),
      child_launch: per((c) => c.launchMs),
      child_load: per((c) => c.incomingMs),
      child_hello: per((c) => c.helloMs),
      child_identity: per((c) => c.identityMs),
      first_exec: round1(ms - (tReady - tFork)),
    },
  };
}

/** Suspend to disk and resume (the parent, which runs on after its fork). */
export async function measureSuspendResume(
  run: Run,
  parent: SandboxVm,
): Promise<{ suspendMs: number; resumeMs: number }> {
  run.scope.check();
  await runTrue(parent, run.config);
  let t0 = performance.now();
  unwrap(await suspendVm(parent));
  const suspendMs = performance.now() - t0;
  run.scope.check();
  t0 = performance.now();
  unwrap(await resumeVm(parent));
  const resumeMs = performance.now() - t0;
  await runTrue(parent, run.config);
  run.log(`suspend ${suspendMs.toFixed(0)} ms, resume ${resumeMs.toFixed(0)} ms`);
  return { suspendMs, resumeMs };
}

/** Host memory of IDLE_VMS idle, paused sandboxes, and the template's RAM file they share. */
export async function measureIdleMemory(
  run: Run,
  sp: Spawner,
  template: TemplateMeta,
): Promise<{ memory: MemoryBreakdown; ramFileMb: number }> {
  const { scope } = run;
  const idle: SandboxVm[] = [];
  for (let i = 0; i < IDLE_VMS; i++) {
    const { vm } = await sp.spawn();
    idle.push(vm);
    await runTrue(vm, run.config);
  }
  await sleep(IDLE_RUN_MS, scope);
  for (const vm of idle) unwrap(await pauseVm(vm));
  await sleep(IDLE_PAUSED_MS, scope);
  const mems = await Promise.all(
    idle.map((vm) => {
      const pid = vm.process?.pid;
      if (pid === undefined) throw new SandboxdError("internal", `idle VM ${vm.id} has no QEMU`);
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
  // What the file settles at: the digs the suspend and resume scheduled (sparse.ts), run now.
  await digScheduledNow();
  const ramFileMb = round1(((await stat(template.memPath)).blocks * 512) / 1024 ** 2);
  await Promise.all(idle.map((vm) => scope.release(vm)));
  run.log(`idle VMs: ${memory.pss} MiB PSS each (guest dirtied ${memory.guest_ram_dirty} MiB)`);
  return { memory, ramFileMb };
}
