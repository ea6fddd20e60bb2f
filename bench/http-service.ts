/**
 * The service's half of `bench --http`: bench's operations (create, exec, fork, suspend, resume,
 * delete, a connect-URL tunnel) through the TypeScript SDK against a real `sandboxd up` on a fresh
 * data dir, stopped at the end and counted for what it left behind. Raw samples, ms; http.ts sets
 * them beside the engine's figures.
 */
import { randomBytes } from "node:crypto";
import { readFileSync } from "node:fs";
import { SandboxdError } from "../contracts/errors.ts";
import { type Sandbox, Sandboxd } from "../sdk/typescript/src/index.ts";
import { type Leftovers, leftovers } from "./footprint.ts";
import {
  createKey,
  removeDataDir,
  seededDataDir,
  spawnUp,
  stopUp,
  uploadTemplateAndWait,
} from "./service.ts";
import { round1, summarize } from "./stats.ts";

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

export function check(signal: AbortSignal | undefined): void {
  if (signal?.aborted) throw new SandboxdError("internal", "benchmark interrupted");
}

async function timed<T>(f: () => Promise<T>): Promise<{ ms: number; value: T }> {
  const t0 = performance.now();
  const value = await f();
  return { ms: performance.now() - t0, value };
}

async function execTrue(sb: Sandbox): Promise<number> {
  const r = await sb.exec(["true"]);
  if (r.exitCode !== 0)
    throw new SandboxdError("internal", `\`true\` through the service exited ${r.exitCode}: ${r.stderr}`);
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

export /** The service's raw samples, ms (bench's figures, through the HTTP API). */
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

/** A client on the service that remembers what it created, so that the end deletes what is left. */
interface Session {
  o: HttpBenchOptions;
  live: Set<Sandbox>;
  create(): Promise<{ ms: number; sb: Sandbox }>;
  destroy(sb: Sandbox): Promise<number>;
}

function session(o: HttpBenchOptions, base: string, key: string, live: Set<Sandbox>): Session {
  // No retries: a 429 or 503 is a failure of the run, not a slower figure.
  const client = new Sandboxd({ baseUrl: base, apiKey: key, retry: false, timeoutMs: CALL_TIMEOUT_MS });
  return {
    o,
    live,
    async create() {
      check(o.signal);
      const { ms, value } = await timed(() => client.sandboxes.create({ template: TEMPLATE_ID }));
      live.add(value);
      return { ms, sb: value };
    },
    async destroy(sb) {
      const { ms } = await timed(() => sb.delete());
      live.delete(sb);
      return ms;
    },
  };
}

/** Bench's operations through a real `sandboxd up` on a fresh data dir, stopped at the end. */
export async function measureService(o: HttpBenchOptions): Promise<ServiceSamples> {
  const { log } = o;
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
    const s = session(o, base, pro, live);
    const creates = await measureCreates(s);
    const { sb } = await s.create();
    const execs = await measureExecs(s, sb);
    const fork = await measureFork(s, sb);
    const suspends = await measureSuspends(s, sb);
    const tunnel = await measureTunnel(s, sb);
    await s.destroy(sb);

    // Leftovers are counted once the service has stopped (its pre-launched QEMUs are its own).
    await stopUp(up);
    return { ...creates, ...execs, ...fork, ...suspends, ...tunnel, leftovers: await leftovers(dataDir) };
  } finally {
    await Promise.allSettled([...live].map((s) => s.delete()));
    if (up) await stopUp(up);
    await removeDataDir(dataDir);
  }
}

/** Create (and delete), one untimed round first: cold code paths on both sides. */
async function measureCreates(s: Session): Promise<Pick<ServiceSamples, "create" | "delete">> {
  {
    const w = await s.create();
    await execTrue(w.sb);
    await s.destroy(w.sb);
  }
  const createMs: number[] = [];
  const deleteMs: number[] = [];
  for (let i = 0; i < s.o.creates; i++) {
    const c = await s.create();
    createMs.push(c.ms);
    await execTrue(c.sb);
    deleteMs.push(await s.destroy(c.sb));
  }
  s.o.log(`http create p50 ${summarize(createMs).p50} ms`);
  return { create: createMs, delete: deleteMs };
}

/** Exec round trips on one warm sandbox, with the exec's own time as the service reports it. */
async function measureExecs(s: Session, sb: Sandbox): Promise<Pick<ServiceSamples, "exec" | "execReported">> {
  for (let i = 0; i < EXEC_WARMUP; i++) await execTrue(sb);
  const execMs: number[] = [];
  const reported: number[] = [];
  for (let i = 0; i < s.o.execs; i++) {
    check(s.o.signal);
    const r = await timed(() => execTrue(sb));
    execMs.push(r.ms);
    reported.push(r.value);
  }
  s.o.log(`http exec p50 ${summarize(execMs).p50} ms`);
  return { exec: execMs, execReported: reported };
}

/** A fork of `sb`, each child answering an exec. */
async function measureFork(s: Session, sb: Sandbox): Promise<Pick<ServiceSamples, "fork" | "forkCall">> {
  check(s.o.signal);
  const tFork = performance.now();
  const call = await timed(() => sb.fork({ count: s.o.forkChildren }));
  for (const c of call.value) s.live.add(c);
  await Promise.all(call.value.map((c) => execTrue(c)));
  const forkMs = performance.now() - tFork;
  await Promise.all(call.value.map((c) => s.destroy(c)));
  s.o.log(`http fork: ${s.o.forkChildren} children answering in ${round1(forkMs)} ms`);
  return { fork: forkMs, forkCall: call.ms };
}

/** Suspend and resume pairs, each between two execs. */
async function measureSuspends(s: Session, sb: Sandbox): Promise<Pick<ServiceSamples, "suspend" | "resume">> {
  const suspendMs: number[] = [];
  const resumeMs: number[] = [];
  for (let i = 0; i < s.o.suspends; i++) {
    check(s.o.signal);
    await execTrue(sb);
    suspendMs.push((await timed(() => sb.suspend())).ms);
    resumeMs.push((await timed(() => sb.resume())).ms);
    await execTrue(sb);
  }
  return { suspend: suspendMs, resume: resumeMs };
}

/** The connect-URL tunnel to busybox httpd in the guest: opens, then one large GET for its throughput. */
async function measureTunnel(
  s: Session,
  sb: Sandbox,
): Promise<Pick<ServiceSamples, "tunnelOpen" | "tunnel">> {
  const { o } = s;
  const blob = `/b${randomBytes(4).toString("hex")}`;
  const setup = await sb.exec([
    "sh",
    "-c",
    `mkdir -p /srv && echo ok > /srv/small && dd if=/dev/urandom of=/srv${blob} bs=1048576 count=${o.tunnelMib} 2>/dev/null && setsid busybox httpd -p 127.0.0.1:${o.port} -h /srv`,
  ]);
  if (setup.exitCode !== 0)
    throw new SandboxdError("internal", `starting httpd in the guest: ${setup.stderr}`);
  await Bun.sleep(HTTPD_START_WAIT_MS);
  const openMs: number[] = [];
  for (let i = 0; i < o.tunnels; i++) {
    check(o.signal);
    const tOpen = performance.now();
    const { url } = await sb.connectUrl({ port: o.port, ttlSeconds: CONNECT_TTL_S });
    const g = await tunnelGet(url, "/small");
    // connect-url minted, WebSocket open, first byte of the guest's answer.
    openMs.push(performance.now() - tOpen - (g.endMs - g.firstByteMs));
  }
  const { url } = await sb.connectUrl({ port: o.port, ttlSeconds: CONNECT_TTL_S });
  const big = await tunnelGet(url, blob);
  if (big.bytes < o.tunnelMib * 2 ** 20)
    throw new SandboxdError(
      "internal",
      `tunnel GET: ${big.bytes} bytes, expected ${o.tunnelMib} MiB and headers`,
    );
  return { tunnelOpen: openMs, tunnel: { bytes: big.bytes, ms: big.endMs - big.openMs } };
}
