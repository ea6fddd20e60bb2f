/**
 * `sandboxd bench --soak N --image ARCHIVE [--data-dir DIR] [--json]`: N create -> exec -> delete
 * cycles of a sessions API session through the HTTP API of a real `sandboxd up` (a child process, so
 * what is measured is the service alone), on a fresh data dir seeded with the guest artifacts of
 * DIR. It prints the service's RSS, open fds, its RAM files on /dev/shm and its data dir's size at
 * the start (after one warm-up cycle: caches, the template's pages, the database's first pages),
 * the middle and the end, each right after a full GC of the service with its JS heap
 * (cli/heap-stats.ts), a series of RSS and heap every SOAK_SAMPLE_EVERY cycles (a plateau is
 * warm-up, a slope a leak),
 * the JS types that grew, and everything the runs leave behind once the service has stopped: QEMU
 * processes, VM directories, cgroups, jail uid locks. Not a timed benchmark: the figures say
 * whether the service leaks.
 */
import { HEAP_STATS_ENV, type HeapStatsLine, parseHeapStatsLine } from "../cli/heap-stats.ts";
import { SandboxdError } from "../contracts/errors.ts";
import { type Leftovers, leftovers, type SoakSample, sample } from "./footprint.ts";
import { call, createKey, seededDataDir, spawnUp, stopAndRemove, uploadTemplateAndWait } from "./service.ts";

const TEMPLATE_ID = "soak";
/** Cycles between two points of the RSS/heap series: 20 points over 1,000 cycles. */
export const SOAK_SAMPLE_EVERY = 50;
/** A full collection of the service's heap takes tens of ms; 10 s means it does not answer. */
const HEAP_STATS_TIMEOUT_MS = 10_000;
/** Types whose live count grew most from start to end, reported. */
const GROWING_TYPES = 12;

/** The service's JS heap after a full GC (what each field is: HeapStatsLine in cli/heap-stats.ts). */
export type SoakHeap = Pick<
  HeapStatsLine,
  "heap_bytes" | "external_bytes" | "heap_capacity_bytes" | "object_count"
>;

/** One point of the series: after `cycle` cycles, with a full GC first. */
export type SoakPoint = { cycle: number } & Pick<SoakSample, "rss_kib" | "rss_anon_kib" | "rss_jit_kib"> &
  SoakHeap;

export interface SoakResult {
  cycles: number;
  failures: number;
  /** Failures' first messages (at most 5). */
  errors: string[];
  /** Samples are taken after a full GC of the service (cli/heap-stats.ts), so RSS is comparable. */
  start: SoakSample & SoakHeap;
  middle: SoakSample & SoakHeap;
  end: SoakSample & SoakHeap;
  /** RSS and live heap every SOAK_SAMPLE_EVERY cycles: a plateau is warm-up, a slope is a leak. */
  series: SoakPoint[];
  /** Live object counts per type that grew most from start to end (end - start). */
  growing_types: Record<string, number>;
  leftovers: Leftovers;
  total_ms: number;
}

interface SoakOptions {
  cycles: number;
  image: string;
  /** The cache whose guest artifacts seed the soak's data dir. */
  cacheDir: string;
  signal?: AbortSignal;
  log: (m: string) => void;
}

/** A sample of the service after a full GC, with its live object counts per type. */
type Measure = () => Promise<{ s: SoakSample & SoakHeap; types: Record<string, number> }>;

export async function runSoak(o: SoakOptions): Promise<SoakResult> {
  const t0 = performance.now();
  const dataDir = await seededDataDir("sbx-soak-", o.cacheDir, o.log);
  // The guest artifacts (kernel, initramfs) are built once in the cache and copied: each soak's
  // `up` then starts without a download.
  const live = createKey(dataDir, "soak", "live");
  const scale = createKey(dataDir, "soak", "scale");
  const heapWaiters: ((h: HeapStatsLine) => void)[] = [];
  // The service answers SIGUSR2 with its heap after a full GC (cli/heap-stats.ts).
  const { up, listening } = spawnUp(dataDir, { [HEAP_STATS_ENV]: "1" }, (line) => {
    const h = parseHeapStatsLine(line);
    if (h) heapWaiters.shift()?.(h);
  });
  try {
    const base = await listening;
    const pid = up.pid!;
    o.log(`soak: up ${base} (pid ${pid}), data ${dataDir}`);
    await uploadTemplateAndWait(base, scale, TEMPLATE_ID, o.image);
    const cycle = () => soakCycle(base, live);
    const measure = heapMeasure(pid, dataDir, heapWaiters);
    await cycle(); // warm-up: not counted
    const first = await measure();
    const run = await runCycles(o, cycle, measure, first.s);
    // Destroys finish in the background of the API's answer (the VM's directory, its cgroup).
    await Bun.sleep(1000);
    const last = await measure();
    run.series.push(point(run.done, last.s));
    // Leftovers are counted once the service has stopped: while it runs, the QEMUs it keeps
    // pre-launched for the template (agent/sandbox/prelaunch-pool.ts) are its own, and it frees
    // them at stop; a deleted sandbox's QEMU would outlive the stop and be counted.
    up.kill("SIGTERM");
    await new Promise((r) => (up.exitCode !== null ? r(undefined) : up.once("exit", r)));
    return {
      cycles: run.done,
      failures: run.failures,
      errors: run.errors,
      start: first.s,
      middle: run.middle,
      end: last.s,
      series: run.series,
      growing_types: growingTypes(first.types, last.types),
      leftovers: await leftovers(dataDir),
      total_ms: Math.round(performance.now() - t0),
    };
  } finally {
    await stopAndRemove(up, dataDir);
  }
}

/** One create -> exec -> delete cycle of a sessions API session; an exec that does not echo fails it. */
async function soakCycle(base: string, key: string): Promise<void> {
  const s = (await call(base, key, "POST", "/v1/sessions", { template_id: TEMPLATE_ID })) as {
    session_id: string;
  };
  const r = (await call(base, key, "POST", `/v1/sessions/${s.session_id}/exec`, {
    commands: [["echo", "soak"]],
  })) as { stdout: string; exit_code: number };
  await call(base, key, "DELETE", `/v1/sessions/${s.session_id}`);
  if (r.exit_code !== 0 || r.stdout.trim() !== "soak")
    throw new SandboxdError("internal", `exec answered ${JSON.stringify(r)}`);
}

/**
 * The service's heap after a full GC (asked for by SIGUSR2, read from its log), and its RSS and
 * files right after.
 */
function heapMeasure(pid: number, dataDir: string, heapWaiters: ((h: HeapStatsLine) => void)[]): Measure {
  return async () => {
    const h = await new Promise<HeapStatsLine>((ok, fail) => {
      const timer = setTimeout(
        () => fail(new Error("the service printed no heap stats")),
        HEAP_STATS_TIMEOUT_MS,
      );
      heapWaiters.push((v) => {
        clearTimeout(timer);
        ok(v);
      });
      process.kill(pid, "SIGUSR2");
    });
    return {
      s: {
        ...sample(pid, dataDir),
        heap_bytes: h.heap_bytes,
        external_bytes: h.external_bytes,
        object_count: h.object_count,
        heap_capacity_bytes: h.heap_capacity_bytes,
      },
      types: h.types,
    };
  };
}

/**
 * The counted cycles, until `o.cycles` or the abort: failures counted (the first 5 messages kept),
 * a series point every SOAK_SAMPLE_EVERY cycles and the middle sample at half-way.
 */
async function runCycles(
  o: SoakOptions,
  cycle: () => Promise<void>,
  measure: Measure,
  start: SoakSample & SoakHeap,
): Promise<{
  done: number;
  failures: number;
  errors: string[];
  middle: SoakSample & SoakHeap;
  series: SoakPoint[];
}> {
  const series: SoakPoint[] = [point(0, start)];
  let middle = start;
  let failures = 0;
  const errors: string[] = [];
  let done = 0;
  for (; done < o.cycles && !o.signal?.aborted; done++) {
    try {
      await cycle();
    } catch (err) {
      failures++;
      if (errors.length < 5) errors.push(err instanceof Error ? err.message : String(err));
    }
    const n = done + 1;
    const half = n === Math.floor(o.cycles / 2);
    if ((n % SOAK_SAMPLE_EVERY === 0 || half) && n < o.cycles) {
      const m = (await measure()).s;
      series.push(point(n, m));
      if (half) middle = m;
      o.log(`soak: ${n}/${o.cycles} rss ${m.rss_kib} KiB heap ${m.heap_bytes} B`);
    }
  }
  return { done, failures, errors, middle, series };
}

function point(cycle: number, m: SoakSample & SoakHeap): SoakPoint {
  return {
    cycle,
    rss_kib: m.rss_kib,
    rss_anon_kib: m.rss_anon_kib,
    rss_jit_kib: m.rss_jit_kib,
    heap_bytes: m.heap_bytes,
    external_bytes: m.external_bytes,
    heap_capacity_bytes: m.heap_capacity_bytes,
    object_count: m.object_count,
  };
}

/** The GROWING_TYPES types whose live count grew most from `a` to `b`, by growth. */
export function growingTypes(a: Record<string, number>, b: Record<string, number>): Record<string, number> {
  return Object.fromEntries(
    Object.entries(b)
      .map(([t, n]) => [t, n - (a[t] ?? 0)] as const)
      .filter(([, d]) => d > 0)
      .sort((x, y) => y[1] - x[1])
      .slice(0, GROWING_TYPES),
  );
}
