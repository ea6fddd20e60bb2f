/**
 * `sandboxd bench --gateway --image ARCHIVE [--connections N] [--seconds S] [--execs N]
 * [--keys K] [--data-dir DIR]`: the HTTP service's own share, measured against a real
 * `sandboxd up` (a child process) on a fresh data dir seeded with DIR's guest artifacts, printed
 * as JSON:
 *
 * - `exec`: N session execs through the HTTP API, interleaved one for one with the same exec sent
 *   straight to the agent's own API (the floor: the agent's round trip, measured in the same run,
 *   with the agent's key from `<data>/agent/credentials.json`). `overhead_p50_ms` is the HTTP
 *   exec's p50 minus the agent's p50; `beyond_own_time_p50_ms` is the p50 of each HTTP exec's
 *   wall time minus the `total_time_ms` the exec itself reports.
 * - `read`: `GET /v1/sessions/{id}` (an authenticated read: key, rate limit, one row) from C
 *   keep-alive connections for S seconds; req/s and latency p50/p99. The requests spread over K
 *   keys of one tenant so that no key meets the API's limit of 100 requests per second and the figure is
 *   the service's, not the rate limit's. The service is pinned to one core (`taskset`, when the
 *   host has it) for this part; the load generator runs here, on the others.
 * - `read_floor`: the same reads, connections and pin against a bare Hono app answering the
 *   same route from memory (floor.ts, its own process), in the same run: what the host and
 *   the load generator allow at all, so `read` can be read against it.
 * - `health`: `GET /v1/health` (no key) the same way, for the same time.
 *
 * Not a test: the host's other load shows in every figure, so compare runs made side by side.
 */
import { spawn, spawnSync } from "node:child_process";
import { join } from "node:path";
import { readCredentials } from "../agent/api/enroll.ts";
import { operatorSecrets } from "../cli/settings.ts";
import type { ExecAction } from "../contracts/agent/api.ts";
import { SandboxdError } from "../contracts/errors.ts";
import { openDb } from "../db/client.ts";
import { AgentHttpClient } from "../gateway/agents/client.ts";
import { createKey } from "../gateway/auth/keys.ts";
import { loadSecrets } from "../gateway/auth/secrets.ts";
import {
  call,
  listeningUrl,
  seededDataDir,
  spawnUp,
  stopAndRemove,
  uploadTemplateAndWait,
} from "./service.ts";

const TEMPLATE_ID = "gwbench";
/** Execs before the measured ones: the JIT, the guest's page cache and the db's pages warm up. */
const WARMUP_EXECS = 5;
/** A second of load before the measured window of each load phase, for the same reason. */
const WARMUP_LOAD_MS = 1000;

export interface LoadFigures {
  connections: number;
  seconds: number;
  requests: number;
  errors: number;
  req_per_s: number;
  p50_ms: number;
  p99_ms: number;
}

export interface GatewayBenchResult {
  exec: {
    count: number;
    http_p50_ms: number;
    http_p99_ms: number;
    /** The floor: the same exec on the agent's own API, interleaved with the HTTP ones. */
    agent_p50_ms: number;
    agent_p99_ms: number;
    /** What the exec itself reports (`total_time_ms`) through HTTP. */
    own_time_p50_ms: number;
    /** http_p50_ms - agent_p50_ms: the service's share (goal <= 2). */
    overhead_p50_ms: number;
    /** p50 of (HTTP wall time - the exec's own total_time_ms). */
    beyond_own_time_p50_ms: number;
  };
  read: LoadFigures & { keys: number; pinned_cpu: string | null };
  /** The same reads against a bare Hono app answering from memory (floor.ts), same pin. */
  read_floor: LoadFigures;
  health: LoadFigures;
  total_ms: number;
}

function pct(samples: number[], p: number): number {
  if (samples.length === 0) return 0;
  const s = [...samples].sort((a, b) => a - b);
  return round(s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))]!);
}

const round = (n: number) => Math.round(n * 1000) / 1000;

/**
 * C workers, each one keep-alive connection's worth of sequential requests (Bun's fetch pools
 * and reuses connections), for `ms` after a warm-up; `request(i)` makes the i-th request.
 */
export async function load(
  connections: number,
  ms: number,
  request: (i: number) => Promise<Response>,
): Promise<LoadFigures> {
  let measuring = false;
  let stop = false;
  let errors = 0;
  let n = 0;
  const lat: number[] = [];
  const worker = async () => {
    while (!stop) {
      const i = n++;
      const t0 = performance.now();
      try {
        const res = await request(i);
        await res.arrayBuffer();
        if (res.status !== 200) throw new SandboxdError("internal", String(res.status));
        if (measuring) lat.push(performance.now() - t0);
      } catch {
        if (measuring) errors++;
      }
    }
  };
  const workers = Array.from({ length: connections }, worker);
  await Bun.sleep(WARMUP_LOAD_MS);
  measuring = true;
  const t0 = performance.now();
  await Bun.sleep(ms);
  measuring = false;
  const elapsed = (performance.now() - t0) / 1000;
  stop = true;
  await Promise.all(workers);
  return {
    connections,
    seconds: round(elapsed),
    requests: lat.length,
    errors,
    req_per_s: Math.round(lat.length / elapsed),
    p50_ms: pct(lat, 50),
    p99_ms: pct(lat, 99),
  };
}

interface GatewayBenchOptions {
  image: string;
  cacheDir: string;
  connections: number;
  seconds: number;
  execs: number;
  keys: number;
  log: (m: string) => void;
}

export async function runGatewayBench(o: GatewayBenchOptions): Promise<GatewayBenchResult> {
  const t0 = performance.now();
  const dataDir = await seededDataDir("sbx-gwbench-", o.cacheDir, o.log);
  const keys = await makeKeys(dataDir, o.keys);
  const key = keys[0]!;
  let agentUrl: string | undefined;
  const { up, listening, stderrTail } = spawnUp(dataDir, {}, (line) => {
    agentUrl ??= /agent (http:\/\/\S+),/.exec(line)?.[1];
  });
  try {
    const base = await listening;
    if (!agentUrl)
      throw new SandboxdError("internal", `up did not say where its agent listens: ${stderrTail()}`);
    o.log(`gateway bench: up ${base}, agent ${agentUrl}, data ${dataDir}`);
    await uploadTemplateAndWait(base, key, TEMPLATE_ID, o.image);
    const s = (await call(base, key, "POST", "/v1/sessions", { template_id: TEMPLATE_ID })) as {
      session_id: string;
    };
    const id = s.session_id;
    const exec = await measureExecs(o, { base, key, id }, await agentOf(dataDir, agentUrl));
    const reads = await measureReads(o, { base, id, keys, pid: up.pid! });
    await call(base, key, "DELETE", `/v1/sessions/${id}`);
    return { exec, ...reads, total_ms: Math.round(performance.now() - t0) };
  } finally {
    await stopAndRemove(up, dataDir);
  }
}

/** `n` scale keys, made on the data dir's database before `up` holds it. */
async function makeKeys(dataDir: string, n: number): Promise<string[]> {
  const keys: string[] = [];
  const pepper = loadSecrets(dataDir, operatorSecrets()).keyPepper;
  const h = await openDb({ dataDir });
  try {
    for (let i = 0; i < n; i++)
      keys.push((await createKey(h.db, pepper, { tenant: "gwbench", tier: "scale" })).key);
  } finally {
    await h.close();
  }
  return keys;
}

/** The agent's own API with the agent's own key, and the one VM it runs (the session's). */
async function agentOf(dataDir: string, agentUrl: string): Promise<{ agent: AgentHttpClient; vmId: string }> {
  const creds = await readCredentials(join(dataDir, "agent"));
  if (!creds) throw new SandboxdError("internal", "the agent has no credentials");
  const agent = new AgentHttpClient({ baseUrl: agentUrl, agentId: creds.id, key: creds.key });
  const vms = await agent.listVms();
  if (vms.length !== 1)
    throw new SandboxdError("internal", `expected one VM on the agent, found ${vms.length}`);
  return { agent, vmId: vms[0]!.id };
}

/** The session's exec through HTTP against the same exec on the agent's API (the floor), interleaved. */
async function measureExecs(
  o: GatewayBenchOptions,
  svc: { base: string; key: string; id: string },
  floor: { agent: AgentHttpClient; vmId: string },
): Promise<GatewayBenchResult["exec"]> {
  // `true` answers in milliseconds; 30 s means the guest is gone.
  const action: ExecAction = { files: [], run: { kind: "argv", commands: [["true"]] }, timeoutMs: 30_000 };
  const viaHttp = async () => {
    const t = performance.now();
    const r = (await call(svc.base, svc.key, "POST", `/v1/sessions/${svc.id}/exec`, {
      commands: [["true"]],
    })) as { exit_code: number; total_time_ms: number };
    const wall = performance.now() - t;
    if (r.exit_code !== 0) throw new SandboxdError("internal", `exec answered ${JSON.stringify(r)}`);
    return { wall, own: r.total_time_ms };
  };
  const viaAgent = async () => {
    const t = performance.now();
    const r = await floor.agent.exec(floor.vmId, action);
    if (r.exitCode !== 0) throw new SandboxdError("internal", `agent exec answered ${JSON.stringify(r)}`);
    return performance.now() - t;
  };
  for (let i = 0; i < WARMUP_EXECS; i++) {
    await viaHttp();
    await viaAgent();
  }
  const http: number[] = [];
  const own: number[] = [];
  const beyond: number[] = [];
  const direct: number[] = [];
  for (let i = 0; i < o.execs; i++) {
    // Interleaved, the order alternating, so that drift in the host's load hits both alike.
    const first = i % 2 === 0;
    if (!first) direct.push(await viaAgent());
    const h = await viaHttp();
    http.push(h.wall);
    own.push(h.own);
    beyond.push(h.wall - h.own);
    if (first) direct.push(await viaAgent());
  }
  const httpP50 = pct(http, 50);
  const agentP50 = pct(direct, 50);
  return {
    count: http.length,
    http_p50_ms: httpP50,
    http_p99_ms: pct(http, 99),
    agent_p50_ms: agentP50,
    agent_p99_ms: pct(direct, 99),
    own_time_p50_ms: pct(own, 50),
    overhead_p50_ms: round(httpP50 - agentP50),
    beyond_own_time_p50_ms: pct(beyond, 50),
  };
}

/** Authenticated reads of the session, health checks, and the same reads against the bare floor app. */
async function measureReads(
  o: GatewayBenchOptions,
  svc: { base: string; id: string; keys: string[]; pid: number },
): Promise<Pick<GatewayBenchResult, "read" | "read_floor" | "health">> {
  // Reads on one core: the service's JS runs on one thread; pinning keeps it off the core the
  // load generator uses.
  const pinned = spawnSync("taskset", ["-a", "-p", "-c", "0", String(svc.pid)]).status === 0 ? "0" : null;
  const auth = svc.keys.map((k) => ({ authorization: `Bearer ${k}` }));
  const readUrl = new URL(`/v1/sessions/${svc.id}`, svc.base).href;
  const read = await load(o.connections, o.seconds * 1000, (i) =>
    fetch(readUrl, { headers: auth[i % auth.length]! }),
  );
  const healthUrl = new URL("/v1/health", svc.base).href;
  const health = await load(o.connections, o.seconds * 1000, () => fetch(healthUrl));
  const readFloor = await floorReads(svc.id, auth, o.connections, o.seconds * 1000);
  return { read: { ...read, keys: svc.keys.length, pinned_cpu: pinned }, read_floor: readFloor, health };
}

/**
 * The reads of `read` against floor.ts, in a child process on the same CPU as the service
 * (when `taskset` works here), so that both figures come from one host state.
 */
async function floorReads(
  id: string,
  auth: { authorization: string }[],
  connections: number,
  ms: number,
): Promise<LoadFigures> {
  const child = spawn(process.execPath, [join(import.meta.dirname, "floor.ts")], {
    stdio: ["ignore", "pipe", "pipe"],
  });
  let tail = "";
  child.stderr.on("data", (b: Buffer) => {
    tail = (tail + b.toString()).slice(-4000);
  });
  try {
    const base = await listeningUrl(child, () => tail);
    spawnSync("taskset", ["-a", "-p", "-c", "0", String(child.pid)]);
    const url = new URL(`/v1/sessions/${id}`, base).href;
    return await load(connections, ms, (i) => fetch(url, { headers: auth[i % auth.length]! }));
  } finally {
    child.kill("SIGKILL");
  }
}
