import { readFileSync } from "node:fs";
import { readdir, stat } from "node:fs/promises";
import { join } from "node:path";
import { type HostCapacity, hostCapacity } from "../agent/sandbox/capacity.ts";
import { defaultShmRoot } from "../agent/snapshot/template.ts";
import { qemuPidsNaming } from "../agent/vm/process.ts";
import { ifExists } from "../contracts/best-effort.ts";
import { SandboxdError } from "../contracts/errors.ts";
import { type Leftovers, leftovers } from "./footprint.ts";
import { qemuMemory } from "./rss.ts";
import {
  createKey,
  seededDataDir,
  spawnUp,
  stopAndRemove,
  stopUp,
  uploadTemplateAndWait,
} from "./service.ts";
import { percentile, round1 } from "./stats.ts";

const TEMPLATE_ID = "bench";
/**
 * How long the density's sandboxes sit idle before their memory is read: long enough for the
 * guests' post-restore work (clock set, reseed) to finish and the QEMUs to settle.
 */
const IDLE_SETTLE_MS = 2_000;
/**
 * Host memory kept free by default while filling it: 2 GiB leaves the page cache, the service,
 * the template's RAM file and a build room to breathe; `--reserve-mib` changes it.
 */
export const DEFAULT_RESERVE_MIB = 2048;
/**
 * Default cap on density's sandboxes: 60 idle VMs take a few minutes to create under TCG on a
 * 2-core host, so a run stays under ~10 minutes; raise `--max` on a bigger host.
 */
export const DEFAULT_DENSITY_MAX = 60;
/** Margin over the measured per-VM PSS when asking whether one more fits the host's memory. */
const NEXT_VM_MARGIN = 1.5;
/** Before any VM is measured, the next one is assumed to cost this much (MiB): an idle VM's PSS. */
const FIRST_VM_ESTIMATE_MIB = 64;
/** Destroys finish in the background of the API's answer (the VM's directory, its cgroup). */
const DESTROY_SETTLE_MS = 1_000;

interface Service {
  base: string;
  pid: number;
  dataDir: string;
  key: string;
  logTail(): string;
}

export interface ServiceLeftovers {
  leftovers: Leftovers;
}

interface Answer {
  status: number;
  body: Record<string, unknown>;
}

/** One request that never throws on an HTTP error: the status and the parsed body. */
async function request(svc: Service, method: string, path: string, body?: unknown): Promise<Answer> {
  const res = await fetch(new URL(path, svc.base), {
    method,
    headers: {
      authorization: `Bearer ${svc.key}`,
      ...(body === undefined ? {} : { "content-type": "application/json" }),
    },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await res.text();
  let parsed: Record<string, unknown> = {};
  try {
    parsed = text === "" ? {} : (JSON.parse(text) as Record<string, unknown>);
  } catch {
    parsed = { message: text.slice(0, 300) };
  }
  return { status: res.status, body: parsed };
}

/** The error code of a failed answer (`{code, message}` envelope), or the status. */
function codeOf(a: Answer): string {
  return typeof a.body.code === "string" ? a.body.code : `http_${a.status}`;
}

/**
 * Starts `up` on a fresh data dir with a live and a scale key of one tenant, uploads `image` as
 * the template, runs `body`, then deletes nothing itself: `body` frees what it made. Stops the
 * service, counts its leftovers, and removes the data dir and its RAM files.
 */
async function withService<T>(
  o: { image: string; cacheDir: string; log: (m: string) => void },
  body: (svc: Service) => Promise<T>,
): Promise<T & ServiceLeftovers> {
  const dataDir = await seededDataDir("sbx-density-", o.cacheDir, o.log);
  const live = createKey(dataDir, "bench", "live");
  const scale = createKey(dataDir, "bench", "scale");
  const { up, listening, stderrTail: logTail } = spawnUp(dataDir, {});
  try {
    const base = await listening;
    o.log(`bench: up ${base} (pid ${up.pid}), data ${dataDir}`);
    await uploadTemplateAndWait(base, scale, TEMPLATE_ID, o.image);
    const result = await body({ base, pid: up.pid!, dataDir, key: live, logTail });
    await Bun.sleep(DESTROY_SETTLE_MS);
    // Counted once the service has stopped: its pre-launched QEMUs are its own until then.
    await stopUp(up);
    return { ...result, leftovers: await leftovers(dataDir) };
  } finally {
    await stopAndRemove(up, dataDir);
  }
}

interface Created {
  ms: number;
  id?: string;
  code?: string;
  answer?: Answer;
}

async function createSession(svc: Service): Promise<Created> {
  const t0 = performance.now();
  try {
    const a = await request(svc, "POST", "/v1/sessions", { template_id: TEMPLATE_ID });
    const ms = performance.now() - t0;
    if (a.status < 300 && typeof a.body.session_id === "string") return { ms, id: a.body.session_id };
    return { ms, code: codeOf(a), answer: a };
  } catch (err) {
    return {
      ms: performance.now() - t0,
      code: `network: ${err instanceof Error ? err.message : String(err)}`,
    };
  }
}

/** Deletes the sessions; returns how many deletes failed. */
async function deleteSessions(svc: Service, ids: readonly string[]): Promise<number> {
  const answers = await Promise.all(
    ids.map((id) => request(svc, "DELETE", `/v1/sessions/${id}`).catch(() => ({ status: 0, body: {} }))),
  );
  return answers.filter((a) => a.status >= 300 || a.status === 0).length;
}

/** `MemAvailable` and `MemTotal` of /proc/meminfo, MiB. */
export function hostMemory(): { totalMib: number; availableMib: number } {
  const text = readFileSync("/proc/meminfo", "utf8");
  const kib = (f: string) => Number(new RegExp(`^${f}:\\s+(\\d+)`, "m").exec(text)?.[1] ?? 0);
  return {
    totalMib: Math.round(kib("MemTotal") / 1024),
    availableMib: Math.round(kib("MemAvailable") / 1024),
  };
}

const mib = (kib: number) => round1(kib / 1024);
/** A percentile rounded to 0.1, 0 for no samples (JSON has no NaN). */
const pct = (xs: readonly number[], p: number) => (xs.length === 0 ? 0 : round1(percentile(xs, p)));

/** The RAM file a QEMU maps (its `mem-path=`), from its command line. */
function memPathOf(pid: number): string | undefined {
  try {
    return /mem-path=([^,\0]+)/.exec(readFileSync(`/proc/${pid}/cmdline`, "utf8"))?.[1];
  } catch {
    return undefined;
  }
}

export interface QemuMemorySummary {
  /** QEMU processes of the service: its sandboxes' and the ones pre-launched for the template. */
  qemu_processes: number;
  /** Of those, the ones running a restored guest (their guest RAM has pages): the sandboxes. */
  running_vms: number;
  /** Mean PSS of a running VM's QEMU, MiB: what one more idle sandbox costs the host. */
  pss_per_vm_mib: number;
  /** The same, split: outside guest RAM (QEMU's heap, TCG's code cache) ... */
  qemu_own_per_vm_mib: number;
  /** ... and the guest RAM mapping (its copy-on-write copies plus its share of template pages). */
  guest_ram_per_vm_mib: number;
  /** Mean PSS of a pre-launched QEMU (no guest restored yet), MiB; 0 when there is none. */
  pss_per_prelaunched_mib: number;
  /** PSS of all the service's QEMUs together, MiB. */
  pss_total_mib: number;
}

/** PSS of the QEMUs of `dataDir`, split by whether they run a guest. */
export async function measureQemus(dataDir: string): Promise<QemuMemorySummary> {
  const mems: Awaited<ReturnType<typeof qemuMemory>>[] = [];
  for (const pid of await qemuPidsNaming([dataDir])) {
    const path = memPathOf(pid);
    if (!path) continue;
    // A QEMU that exited between the listing and the read has no memory left to count.
    const m = await qemuMemory(pid, path).catch(() => undefined);
    if (m) mems.push(m);
  }
  const running = mems.filter((m) => m.guestRam.rss > 0);
  const pooled = mems.filter((m) => m.guestRam.rss === 0);
  const avg = (xs: typeof mems, f: (m: (typeof mems)[number]) => number) =>
    xs.length === 0 ? 0 : mib(xs.reduce((s, m) => s + f(m), 0) / xs.length);
  return {
    qemu_processes: mems.length,
    running_vms: running.length,
    pss_per_vm_mib: avg(running, (m) => m.total.pss),
    qemu_own_per_vm_mib: avg(running, (m) => m.total.pss - m.guestRam.pss),
    guest_ram_per_vm_mib: avg(running, (m) => m.guestRam.pss),
    pss_per_prelaunched_mib: avg(pooled, (m) => m.total.pss),
    pss_total_mib: mib(mems.reduce((s, m) => s + m.total.pss, 0)),
  };
}

/** KiB allocated by the template RAM files (`tpl-*.mem`) of the service's shm root. */
async function templateRamKib(dataDir: string): Promise<number> {
  const root = defaultShmRoot(join(dataDir, "agent"));
  let kib = 0;
  for (const name of (await ifExists(readdir(root))) ?? [])
    if (name.startsWith("tpl-")) kib += ((await ifExists(stat(join(root, name))))?.blocks ?? 0) / 2;
  return kib;
}

export type DensityStop = "max" | "agent_capacity" | "session_cap" | "host_memory" | "error" | "interrupted";

export interface DensityResult {
  mode: "density";
  /** Idle sandboxes created and held at once. */
  count: number;
  stopped_by: DensityStop;
  /** What the refusal or the error said (the agent's capacity and what it held, for at_capacity). */
  stop_detail?: unknown;
  /**
   * The admission limits `up` gives its agent on this host (agent/sandbox/capacity.ts defaults:
   * VM slots, vCPUs overcommitted 4x per core, 75% of memory as guest RAM): what `agent_capacity`
   * ran into.
   */
  agent_capacity: HostCapacity;
  max: number;
  reserve_mib: number;
  host_mem_total_mib: number;
  host_mem_available_before_mib: number;
  host_mem_available_at_peak_mib: number;
  memory: QemuMemorySummary;
  /**
   * Host memory the template's RAM files hold on tmpfs (allocated, not apparent size), MiB: paid
   * once per template, beside the per-VM PSS.
   */
  template_ram_files_mib: number;
  /** Create latency while filling, ms (each create alone). */
  create_ms: { p50: number; p95: number; max: number };
  /**
   * Sandboxes host memory alone would hold at this PSS: (available before - reserve) / PSS per
   * VM. An extrapolation, not a measurement; what stopped the run is `stopped_by`.
   */
  memory_bound_estimate: number;
  delete_failures: number;
  total_ms: number;
}

export async function runDensity(o: {
  image: string;
  cacheDir: string;
  max: number;
  reserveMib: number;
  signal?: AbortSignal;
  log: (m: string) => void;
}): Promise<DensityResult & ServiceLeftovers> {
  const t0 = performance.now();
  return withService(o, async (svc) => {
    const before = hostMemory();
    const ids: string[] = [];
    const createMs: number[] = [];
    let stoppedBy: DensityStop = "max";
    let detail: unknown;
    let perVmMib = FIRST_VM_ESTIMATE_MIB;
    try {
      while (ids.length < o.max) {
        if (o.signal?.aborted) {
          stoppedBy = "interrupted";
          break;
        }
        const avail = hostMemory().availableMib;
        if (avail - perVmMib * NEXT_VM_MARGIN < o.reserveMib) {
          stoppedBy = "host_memory";
          detail = { available_mib: avail, next_vm_estimate_mib: perVmMib };
          break;
        }
        const c = await createSession(svc);
        if (c.id) {
          ids.push(c.id);
          createMs.push(c.ms);
          // Re-estimated every 8 VMs: reading every QEMU's smaps on each step would dominate.
          if (ids.length % 8 === 1) {
            const measured = (await measureQemus(svc.dataDir)).pss_per_vm_mib;
            if (measured > 0) perVmMib = measured;
          }
          continue;
        }
        stoppedBy =
          c.code === "at_capacity"
            ? "agent_capacity"
            : c.answer?.status === 429 && c.code !== "rate_limited"
              ? "session_cap"
              : "error";
        detail = c.answer?.body ?? c.code;
        break;
      }
      o.log(`density: ${ids.length} idle sandboxes, stopped by ${stoppedBy}`);
      await Bun.sleep(IDLE_SETTLE_MS);
      const memory = await measureQemus(svc.dataDir);
      const peak = hostMemory();
      const sorted = [...createMs].sort((a, b) => a - b);
      const result: DensityResult = {
        mode: "density",
        count: ids.length,
        stopped_by: stoppedBy,
        ...(detail !== undefined ? { stop_detail: detail } : {}),
        agent_capacity: hostCapacity(undefined),
        max: o.max,
        reserve_mib: o.reserveMib,
        host_mem_total_mib: before.totalMib,
        host_mem_available_before_mib: before.availableMib,
        host_mem_available_at_peak_mib: peak.availableMib,
        memory,
        template_ram_files_mib: mib(await templateRamKib(svc.dataDir)),
        create_ms: {
          p50: pct(sorted, 0.5),
          p95: pct(sorted, 0.95),
          max: round1(sorted.at(-1) ?? 0),
        },
        memory_bound_estimate:
          memory.pss_per_vm_mib > 0
            ? Math.floor((before.availableMib - o.reserveMib) / memory.pss_per_vm_mib)
            : 0,
        delete_failures: 0,
        total_ms: 0,
      };
      result.delete_failures = await deleteSessions(svc, ids.splice(0));
      result.total_ms = Math.round(performance.now() - t0);
      return result;
    } finally {
      // A throw above still frees what was made before the service stops.
      if (ids.length > 0) await deleteSessions(svc, ids);
    }
  });
}

export interface LatencyStats {
  p50: number;
  p95: number;
  p99: number;
  max: number;
}

export interface BurstResult {
  mode: "burst";
  n: number;
  /** One create alone on the idle service first: the floor each burst create is compared with. */
  single_create_ms: number;
  /** Latency of the burst's successful creates, ms, each from its own send to its answer. */
  create_ms: LatencyStats;
  /** Send of the first create to the answer of the last, ms. */
  wall_ms: number;
  successes: number;
  failures: number;
  /** Failed creates by error code (e.g. `at_capacity` once the agent is full). */
  failures_by_code: Record<string, number>;
  /** p50 of the burst over the single create. */
  p50_vs_single: number;
  delete_failures: number;
  total_ms: number;
}

export async function runBurst(o: {
  image: string;
  cacheDir: string;
  n: number;
  log: (m: string) => void;
}): Promise<BurstResult & ServiceLeftovers> {
  const t0 = performance.now();
  return withService(o, async (svc) => {
    const made: string[] = [];
    try {
      const single = await createSession(svc);
      if (!single.id)
        throw new SandboxdError(
          "internal",
          `the single create failed: ${JSON.stringify(single.answer?.body ?? single.code)}`,
        );
      await deleteSessions(svc, [single.id]);
      const tb = performance.now();
      const all = await Promise.all(Array.from({ length: o.n }, () => createSession(svc)));
      const wallMs = performance.now() - tb;
      for (const c of all) if (c.id) made.push(c.id);
      const ok = all
        .filter((c) => c.id)
        .map((c) => c.ms)
        .sort((a, b) => a - b);
      const byCode: Record<string, number> = {};
      for (const c of all) if (!c.id) byCode[c.code ?? "unknown"] = (byCode[c.code ?? "unknown"] ?? 0) + 1;
      o.log(`burst: ${ok.length}/${o.n} created in ${wallMs.toFixed(0)} ms`);
      const p50 = pct(ok, 0.5);
      const result: BurstResult = {
        mode: "burst",
        n: o.n,
        single_create_ms: round1(single.ms),
        create_ms: {
          p50: pct(ok, 0.5),
          p95: pct(ok, 0.95),
          p99: pct(ok, 0.99),
          max: round1(ok.at(-1) ?? 0),
        },
        wall_ms: Math.round(wallMs),
        successes: ok.length,
        failures: o.n - ok.length,
        failures_by_code: byCode,
        p50_vs_single: ok.length > 0 ? Math.round((p50 / single.ms) * 100) / 100 : 0,
        delete_failures: await deleteSessions(svc, made.splice(0)),
        total_ms: 0,
      };
      result.total_ms = Math.round(performance.now() - t0);
      return result;
    } finally {
      if (made.length > 0) await deleteSessions(svc, made);
    }
  });
}
