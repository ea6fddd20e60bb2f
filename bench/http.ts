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
import { randomBytes } from "node:crypto";
import { readFileSync } from "node:fs";
import { cpus, loadavg } from "node:os";
import { hostCapacity } from "../agent/sandbox/capacity.ts";
import { type Sandbox, Sandboxd } from "../sdk/typescript/src/index.ts";
import { type BenchResult, FORK_CHILDREN, runBench } from "./engine.ts";
import { type Leftovers, leftovers } from "./footprint.ts";
import {
  createKey,
  removeDataDir,
  seededDataDir,
  spawnUp,
  stopUp,
  uploadTemplateAndWait,
} from "./service.ts";
import { round1, round2, type Summary, summarize } from "./stats.ts";

const TEMPLATE_ID = "bench-http";
/** Untimed `true` runs before the exec sample, as the engine bench does (TCG re-translation). */
const EXEC_WARMUP = 5;
/** One request's deadline: a create or fork under TCG on a loaded host takes seconds, not minutes. */
const CALL_TIMEOUT_MS = 120_000;
/** A tunnel exchange (one GET through the WebSocket) that has not ended by then is broken. */
const TUNNEL_TIMEOUT_MS = 60_000;
/** httpd needs a moment to bind after the exec that starts it returns. */
const HTTPD_START_WAIT_MS = 300;
/** Connect URLs live this long: the run needs seconds; 300 s leaves room on a loaded host. */
const CONNECT_TTL_S = 300;

/**
 * The forks' default child count: bench's, within what the service admits here. Its
 * agent hands out at most hostCapacity().vcpus vCPUs (4 per core); the parent holds one and its
 * pre-launch pool may hold two more while the fork is admitted. On 2 cores: 5 children.
 */
export function defaultForkChildren(): number {
  return Math.max(1, Math.min(FORK_CHILDREN, hostCapacity(undefined).vcpus - 3));
}

export interface HttpBenchOptions {
  image: string;
  /** Data dir whose caches (guest artifacts, imported images) are used, as `bench`. */
  cacheDir: string;
  memMib: number;
  vcpus: number;
  /** Timed creates through the service (and as many spawns of the engine bench). */
  creates: number;
  /** Timed `true` execs through the service (and as many on the engine). */
  execs: number;
  /** Timed suspend + resume pairs through the service. */
  suspends: number;
  /** Timed tunnel opens (connect-url, WebSocket, one small GET). */
  tunnels: number;
  /** Size of the file fetched through the tunnel for its throughput, MiB. */
  tunnelMib: number;
  /** Children of the timed forks, the engine's and the service's (bench forks FORK_CHILDREN). */
  forkChildren: number;
  /** The guest port the image exposes. */
  port: number;
  signal?: AbortSignal;
  log: (m: string) => void;
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

function check(signal: AbortSignal | undefined): void {
  if (signal?.aborted) throw new Error("benchmark interrupted");
}

async function timed<T>(f: () => Promise<T>): Promise<{ ms: number; value: T }> {
  const t0 = performance.now();
  const value = await f();
  return { ms: performance.now() - t0, value };
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

async function execTrue(sb: Sandbox): Promise<number> {
  const r = await sb.exec(["true"]);
  if (r.exitCode !== 0) throw new Error(`\`true\` through the service exited ${r.exitCode}: ${r.stderr}`);
  return r.totalTimeMs;
}

/**
 * One HTTP/1.0 GET of `path` through the connect URL `url`: ms to the WebSocket's open, ms to
 * the first byte of the answer, ms to its end, and the bytes received (headers included).
 */
function tunnelGet(
  url: string,
  path: string,
): Promise<{ openMs: number; firstByteMs: number; endMs: number; bytes: number }> {
  return new Promise((resolve, reject) => {
    const t0 = performance.now();
    const ws = new WebSocket(url);
    ws.binaryType = "arraybuffer";
    let openMs = 0;
    let firstByteMs = 0;
    let bytes = 0;
    const timer = setTimeout(() => {
      ws.close();
      reject(new Error(`tunnel GET ${path}: no end within ${TUNNEL_TIMEOUT_MS} ms`));
    }, TUNNEL_TIMEOUT_MS);
    ws.onopen = () => {
      openMs = performance.now() - t0;
      ws.send(new TextEncoder().encode(`GET ${path} HTTP/1.0\r\n\r\n`));
    };
    ws.onmessage = (e) => {
      if (bytes === 0) firstByteMs = performance.now() - t0;
      bytes += typeof e.data === "string" ? e.data.length : (e.data as ArrayBuffer).byteLength;
    };
    ws.onerror = () => {
      clearTimeout(timer);
      reject(new Error(`tunnel GET ${path}: WebSocket error`));
    };
    ws.onclose = () => {
      clearTimeout(timer);
      if (bytes === 0) reject(new Error(`tunnel GET ${path}: closed with no answer`));
      else resolve({ openMs, firstByteMs, endMs: performance.now() - t0, bytes });
    };
  });
}

/** The service's raw samples, ms (bench's figures, through the HTTP API). */
interface ServiceSamples {
  create: number[];
  delete: number[];
  exec: number[];
  execReported: number[];
  fork: number;
  forkCall: number;
  suspend: number[];
  resume: number[];
  tunnelOpen: number[];
  tunnel: { bytes: number; ms: number };
  leftovers: Leftovers;
}

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

/** Bench's operations through a real `sandboxd up` on a fresh data dir, stopped at the end. */
async function measureService(o: HttpBenchOptions): Promise<ServiceSamples> {
  const { log, signal } = o;
  log("bench --http: the same through `sandboxd up`");
  const dataDir = await seededDataDir("sbx-bench-http-", o.cacheDir, log);
  const live = new Set<Sandbox>();
  let up: ReturnType<typeof spawnUp>["up"] | undefined;
  try {
    const scale = createKey(dataDir, "bench", "scale");
    const pro = createKey(dataDir, "bench", "pro");
    const started = spawnUp(dataDir, {});
    up = started.up;
    const base = await started.listening;
    log(`bench --http: up ${base}, data ${dataDir}`);
    await uploadTemplateAndWait(
      base,
      scale,
      TEMPLATE_ID,
      readFileSync(o.image),
      `&mem_mib=${o.memMib}&vcpu_count=${o.vcpus}`,
    );
    // No retries: a 429 or 503 is a failure of the run, not a slower figure.
    const client = new Sandboxd({ baseUrl: base, apiKey: pro, retry: false, timeoutMs: CALL_TIMEOUT_MS });
    const create = async (): Promise<{ ms: number; sb: Sandbox }> => {
      check(signal);
      const { ms, value } = await timed(() => client.sandboxes.create({ template: TEMPLATE_ID }));
      live.add(value);
      return { ms, sb: value };
    };
    const destroy = async (sb: Sandbox): Promise<number> => {
      const { ms } = await timed(() => sb.delete());
      live.delete(sb);
      return ms;
    };

    // -- create (and delete), one untimed round first: cold code paths on both sides.
    {
      const w = await create();
      await execTrue(w.sb);
      await destroy(w.sb);
    }
    const createMs: number[] = [];
    const deleteMs: number[] = [];
    for (let i = 0; i < o.creates; i++) {
      const c = await create();
      createMs.push(c.ms);
      await execTrue(c.sb);
      deleteMs.push(await destroy(c.sb));
    }
    log(`http create p50 ${summarize(createMs).p50} ms`);

    // -- exec round trips on one warm sandbox
    const { sb } = await create();
    for (let i = 0; i < EXEC_WARMUP; i++) await execTrue(sb);
    const execMs: number[] = [];
    const reported: number[] = [];
    for (let i = 0; i < o.execs; i++) {
      check(signal);
      const r = await timed(() => execTrue(sb));
      execMs.push(r.ms);
      reported.push(r.value);
    }
    log(`http exec p50 ${summarize(execMs).p50} ms`);

    // -- fork, each child answering an exec
    check(signal);
    const tFork = performance.now();
    const call = await timed(() => sb.fork({ count: o.forkChildren }));
    for (const c of call.value) live.add(c);
    await Promise.all(call.value.map((c) => execTrue(c)));
    const forkMs = performance.now() - tFork;
    await Promise.all(call.value.map((c) => destroy(c)));
    log(`http fork: ${o.forkChildren} children answering in ${round1(forkMs)} ms`);

    // -- suspend and resume
    const suspendMs: number[] = [];
    const resumeMs: number[] = [];
    for (let i = 0; i < o.suspends; i++) {
      check(signal);
      await execTrue(sb);
      suspendMs.push((await timed(() => sb.suspend())).ms);
      resumeMs.push((await timed(() => sb.resume())).ms);
      await execTrue(sb);
    }

    // -- the connect-URL tunnel: opens, then one large GET for its throughput
    const blob = `/b${randomBytes(4).toString("hex")}`;
    const setup = await sb.exec([
      "sh",
      "-c",
      `mkdir -p /srv && echo ok > /srv/small && dd if=/dev/urandom of=/srv${blob} bs=1048576 count=${o.tunnelMib} 2>/dev/null && setsid busybox httpd -p 127.0.0.1:${o.port} -h /srv`,
    ]);
    if (setup.exitCode !== 0) throw new Error(`starting httpd in the guest: ${setup.stderr}`);
    await Bun.sleep(HTTPD_START_WAIT_MS);
    const openMs: number[] = [];
    for (let i = 0; i < o.tunnels; i++) {
      check(signal);
      const tOpen = performance.now();
      const { url } = await sb.connectUrl({ port: o.port, ttlSeconds: CONNECT_TTL_S });
      const g = await tunnelGet(url, "/small");
      // connect-url minted, WebSocket open, first byte of the guest's answer.
      openMs.push(performance.now() - tOpen - (g.endMs - g.firstByteMs));
    }
    const { url } = await sb.connectUrl({ port: o.port, ttlSeconds: CONNECT_TTL_S });
    const big = await tunnelGet(url, blob);
    const xferMs = big.endMs - big.openMs;
    if (big.bytes < o.tunnelMib * 2 ** 20)
      throw new Error(`tunnel GET: ${big.bytes} bytes, expected ${o.tunnelMib} MiB and headers`);
    await destroy(sb);

    // Leftovers are counted once the service has stopped (its pre-launched QEMUs are its own).
    await stopUp(up);
    return {
      create: createMs,
      delete: deleteMs,
      exec: execMs,
      execReported: reported,
      fork: forkMs,
      forkCall: call.ms,
      suspend: suspendMs,
      resume: resumeMs,
      tunnelOpen: openMs,
      tunnel: { bytes: big.bytes, ms: xferMs },
      leftovers: await leftovers(dataDir),
    };
  } finally {
    await Promise.allSettled([...live].map((s) => s.delete()));
    if (up) await stopUp(up);
    await removeDataDir(dataDir);
  }
}
