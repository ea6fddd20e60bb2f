/**
 * `sandboxd bench --http --image ARCHIVE`: the figures of `bench` measured through the HTTP API of
 * a real `sandboxd up` (a child process on a fresh data dir, service.ts), next to the
 * engine's own figures measured in the same run, before and after it (engine.ts), so
 * the service's share of each one is visible: `share_ms` = HTTP p50 - the engine's p50 (the mean
 * of its two runs; `engine_drift_ms` says how far they differ). The client is the TypeScript
 * SDK (`sdk/typescript`), as a user would call the service; the tunnel is a WebSocket to a
 * connect URL carrying HTTP/1.0 to busybox httpd in the guest (the image must have busybox and
 * expose `--port`). Beside them, the floor of both engine runs: a bare QEMU restore.
 *
 * It ends by stopping the service and counting what it left (QEMUs, VM dirs, cgroups, uid locks).
 */
import { cpus, loadavg } from "node:os";
import { hostCapacity } from "../agent/sandbox/capacity.ts";
import { FORK_CHILDREN, runBench } from "./engine.ts";
import type { BenchResult } from "./engine-result.ts";
import type { Leftovers } from "./footprint.ts";
import { check, type HttpBenchOptions, measureService } from "./http-service.ts";
import { round1, round2, type Summary, summarize } from "./stats.ts";

/**
 * The forks' default child count: bench's, within what the service admits here. Its
 * agent hands out at most hostCapacity().vcpus vCPUs (4 per core); the parent holds one and its
 * pre-launch pool may hold two more while the fork is admitted. On 2 cores: 5 children.
 */
export function defaultForkChildren(): number {
  return Math.max(1, Math.min(FORK_CHILDREN, hostCapacity(undefined).vcpus - 3));
}

/** One operation: through the service and on the engine, p50 apart. */
export interface Compared {
  http: Summary;
  /** The engine's figure for the same work, run before the service, or null where it has none. */
  engine: Summary | null;
  /** The same, run after the service. */
  engine_after: Summary | null;
  /** Which engine figure `engine` is (a key of the engine's JSON). */
  engine_figure: string | null;
  /** engine_after.p50 - engine.p50: how much the host changed meanwhile (noise, others' load). */
  engine_drift_ms: number | null;
  /**
   * http.p50 - the mean of the two engine p50s: what the service adds (gateway, database, the
   * agent's API, the client).
   */
  share_ms: number | null;
}

export interface HttpBenchResult {
  accel: string;
  guest_mem_mib: number;
  vcpus: number;
  /** 1-minute load average at the start and the end, and the host's cores: how loaded it was. */
  host_load: { before: number; after: number; cpus: number };
  /** A bare QEMU restore of the engine's template, in both engine runs (bench's floor_restore_ms). */
  floor_restore_ms: { before: Summary; after: Summary };
  /** http create p50 / the mean of the two floor p50s: the whole service against a bare restore. */
  create_vs_floor: number;
  operations: {
    create: Compared;
    exec: Compared & {
      /** The exec's own time as the service reports it (`total_time_ms`): its agent path. */
      service_reported: Summary;
    };
    fork: Compared & {
      /** Children of both forks (the engine's and the service's). */
      children: number;
      /** The fork call alone, to its answer (the children not yet asked). */
      fork_call: Summary;
    };
    suspend: Compared;
    resume: Compared;
    delete: Compared;
    tunnel_open: Compared;
  };
  /** One GET of `bytes` through the tunnel (WebSocket -> gateway -> agent -> guest), MiB/s. */
  tunnel_throughput: { bytes: number; ms: number; mib_per_s: number };
  /** The engine's own runs, whole (bench's JSON), before and after the service's. */
  engine: { before: BenchResult; after: BenchResult };
  /** What the service left behind once stopped: all empty when it frees everything. */
  leftovers: Leftovers;
  total_ms: number;
}

function compare(http: number[], engine: [Summary, Summary] | null, figure: string | null): Compared {
  const h = summarize(http);
  if (!engine)
    return {
      http: h,
      engine: null,
      engine_after: null,
      engine_figure: null,
      engine_drift_ms: null,
      share_ms: null,
    };
  const [before, after] = engine;
  return {
    http: h,
    engine: before,
    engine_after: after,
    engine_figure: figure,
    engine_drift_ms: round1(after.p50 - before.p50),
    share_ms: round1(h.p50 - (before.p50 + after.p50) / 2),
  };
}

/** An engine figure measured once, as a summary of one sample. */
const once = (ms: number): Summary => summarize([ms]);

/** The engine's figures (engine.ts) at the shape and counts of the service's. */
function engineRun(o: HttpBenchOptions): Promise<BenchResult> {
  return runBench({
    dataDir: o.cacheDir,
    image: o.image,
    memMib: o.memMib,
    vcpus: o.vcpus,
    spawns: o.creates,
    execs: o.execs,
    // As many children as the service's fork, so that the two compare.
    forkChildren: o.forkChildren,
    signal: o.signal,
    log: o.log,
  });
}

/**
 * The engine before and after the service, so that a host whose load changed during the run
 * shows it (`engine_drift_ms`) instead of passing it off as the service's share.
 */
export async function runHttpBench(o: HttpBenchOptions): Promise<HttpBenchResult> {
  const t0 = performance.now();
  const loadBefore = loadavg()[0]!;
  o.log("bench --http: the engine's figures (before)");
  const before = await engineRun(o);
  check(o.signal);
  const svc = await measureService(o);
  check(o.signal);
  o.log("bench --http: the engine's figures (after)");
  const after = await engineRun(o);
  const pair = (f: (r: BenchResult) => Summary): [Summary, Summary] => [f(before), f(after)];
  const http = summarize(svc.create);
  const floorP50 = (before.floor_restore_ms.p50 + after.floor_restore_ms.p50) / 2;
  return {
    accel: before.accel,
    guest_mem_mib: o.memMib,
    vcpus: o.vcpus,
    host_load: { before: round2(loadBefore), after: round2(loadavg()[0]!), cpus: cpus().length },
    floor_restore_ms: { before: before.floor_restore_ms, after: after.floor_restore_ms },
    create_vs_floor: round2(http.p50 / floorP50),
    operations: {
      // The service's create takes a QEMU its agent pre-launched when its pool has one.
      create: compare(
        svc.create,
        pair((r) => r.spawn_prelaunched_ms),
        "spawn_prelaunched_ms",
      ),
      exec: {
        ...compare(
          svc.exec,
          pair((r) => r.exec_rtt_ms),
          "exec_rtt_ms",
        ),
        service_reported: summarize(svc.execReported),
      },
      fork: {
        ...compare(
          [svc.fork],
          pair((r) => once(r.fork_children_ms)),
          "fork_children_ms",
        ),
        children: o.forkChildren,
        fork_call: summarize([svc.forkCall]),
      },
      suspend: compare(
        svc.suspend,
        pair((r) => once(r.suspend_ms)),
        "suspend_ms",
      ),
      resume: compare(
        svc.resume,
        pair((r) => once(r.resume_ms)),
        "resume_ms",
      ),
      delete: compare(svc.delete, null, null),
      tunnel_open: compare(svc.tunnelOpen, null, null),
    },
    tunnel_throughput: {
      bytes: svc.tunnel.bytes,
      ms: round1(svc.tunnel.ms),
      mib_per_s: round1(svc.tunnel.bytes / 2 ** 20 / (svc.tunnel.ms / 1000)),
    },
    engine: { before, after },
    leftovers: svc.leftovers,
    total_ms: round1(performance.now() - t0),
  };
}
