/**
 * The density and burst benchmarks, through a real `up` (density-service.ts): how many idle
 * sandboxes the host holds and what each costs it in memory (density-memory.ts), and how long
 * creates take when many arrive at once.
 */
import { type HostCapacity, hostCapacity } from "../agent/sandbox/capacity.ts";
import { SandboxdError } from "../contracts/errors.ts";
import { hostMemory, measureQemus, mib, type QemuMemorySummary, templateRamKib } from "./density-memory.ts";
import { createSession, deleteSessions, type ServiceLeftovers, withService } from "./density-service.ts";
import { percentile, round1 } from "./stats.ts";

export { hostMemory, measureQemus, type QemuMemorySummary } from "./density-memory.ts";
export type { ServiceLeftovers } from "./density-service.ts";

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
/** A percentile rounded to 0.1, 0 for no samples (JSON has no NaN). */
const pct = (xs: readonly number[], p: number) => (xs.length === 0 ? 0 : round1(percentile(xs, p)));

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
