/**
 * Live metrics of every sandbox on this host (docs/metrics.md): CPU %, memory used and disk used,
 * sampled from the host's view of each VM, never from the guest (the guest is hostile: anything it
 * reports it can make up). CPU and memory come from its QEMU process (agent/vm/proc-stats.ts),
 * disk from its qcow2 overlay's allocated blocks (the driver's `diskBytes`, a `stat`).
 *
 * One timer samples every VM every METRICS_INTERVAL_MS into a fixed ring of METRICS_SAMPLES per
 * VM. Always, not only while someone watches: the question a chart answers is often "what just
 * happened" (a burst that made an exec slow), which a sampler started by the first look cannot
 * show; and a sample is two small /proc reads and a stat per VM (the figure the VM test prints, a
 * few tens of microseconds per VM), far below what the VMs themselves cost. A VM without a QEMU
 * (suspended) is not sampled: its ring keeps the last figures until it runs again or goes.
 */
import { readProcStats } from "../vm/proc-stats.ts";

/**
 * Seconds between samples: 2 s. Short enough that a burst of a few seconds shows as more than one
 * point, and it is the idle pause's grace (manager.ts DEFAULT_IDLE_PAUSE_MS), so a VM's pause
 * shows within a sample; long enough that a host of a hundred VMs spends milliseconds per sweep.
 */
export const METRICS_INTERVAL_MS = 2_000;
/**
 * Samples kept per VM: 60, two minutes at 2 s: the span a console chart shows and a client
 * polling once a minute loses nothing. Five numbers each in typed arrays: 2.4 KB per VM, fixed.
 */
export const METRICS_SAMPLES = 60;

export interface MetricsSample {
  atMs: number;
  /** Host CPU time of the VM's QEMU (all its threads) per wall time, % of one host core; null on the first sample of a QEMU. */
  cpuPercent: number | null;
  /** The QEMU's private memory (RssAnon): what this VM alone holds in host RAM. */
  memUsedBytes: number;
  /** The QEMU's resident set (VmRSS), shared RAM-file pages included. */
  memResidentBytes: number;
  /** Allocated bytes of the VM's own disk overlay. */
  diskBytes: number;
}

/** A VM to sample: `pid` is its QEMU's host pid, undefined while it has none (suspended). */
export interface MetricsTarget {
  id: string;
  pid: number | undefined;
}

export interface LiveMetricsDeps {
  /** The VMs held now; a VM that is no longer listed has its ring dropped. */
  targets: () => Iterable<MetricsTarget>;
  /** Allocated bytes of a VM's disk overlay. */
  diskBytes: (id: string) => Promise<number>;
  intervalMs?: number;
  samples?: number;
  now?: () => number;
}

/** A fixed ring of samples: the oldest is overwritten once it is full. */
class Ring {
  private readonly cols: {
    at: Float64Array;
    cpu: Float64Array;
    used: Float64Array;
    res: Float64Array;
    disk: Float64Array;
  };
  private next = 0;
  private count = 0;
  constructor(private readonly size: number) {
    const col = () => new Float64Array(size);
    this.cols = { at: col(), cpu: col(), used: col(), res: col(), disk: col() };
  }
  push(s: MetricsSample): void {
    const { at, cpu, used, res, disk } = this.cols;
    at[this.next] = s.atMs;
    cpu[this.next] = s.cpuPercent ?? Number.NaN;
    used[this.next] = s.memUsedBytes;
    res[this.next] = s.memResidentBytes;
    disk[this.next] = s.diskBytes;
    this.next = (this.next + 1) % this.size;
    this.count = Math.min(this.count + 1, this.size);
  }
  /** Oldest first. */
  list(): MetricsSample[] {
    const { at, cpu, used, res, disk } = this.cols;
    const out: MetricsSample[] = [];
    for (let k = 0; k < this.count; k++) {
      const i = (this.next - this.count + k + this.size) % this.size;
      const c = cpu[i] as number;
      out.push({
        atMs: at[i] as number,
        cpuPercent: Number.isNaN(c) ? null : c,
        memUsedBytes: used[i] as number,
        memResidentBytes: res[i] as number,
        diskBytes: disk[i] as number,
      });
    }
    return out;
  }
}

interface VmSeries {
  ring: Ring;
  /** The last CPU reading, for the next sample's rate; a new QEMU (resume) starts over. */
  last?: { pid: number; cpuMs: number; monoMs: number };
  /** The last disk figure, kept when a `stat` of the overlay fails once. */
  diskBytes: number;
}

export class LiveMetrics {
  readonly intervalMs: number;
  private readonly size: number;
  private readonly now: () => number;
  private readonly series = new Map<string, VmSeries>();
  private timer: ReturnType<typeof setInterval> | undefined;
  private sweeping = false;
  /** How long the last sweep took and how many VMs it sampled: its cost, for tests and logs. */
  lastSweep = { ms: 0, vms: 0 };

  constructor(private readonly deps: LiveMetricsDeps) {
    this.intervalMs = deps.intervalMs ?? METRICS_INTERVAL_MS;
    this.size = deps.samples ?? METRICS_SAMPLES;
    this.now = deps.now ?? Date.now;
  }

  start(): void {
    if (this.timer) return;
    this.timer = setInterval(() => void this.sweep(), this.intervalMs);
    this.timer.unref?.(); // never keeps the agent process alive
  }

  stop(): void {
    clearInterval(this.timer);
    this.timer = undefined;
  }

  /** The samples of `id`, oldest first (empty before its first sample). */
  history(id: string): MetricsSample[] {
    return this.series.get(id)?.ring.list() ?? [];
  }

  /**
   * Samples every VM once. A sweep still running when the timer fires again (a host so loaded
   * that reading /proc takes seconds) is not doubled: that tick is skipped.
   */
  async sweep(): Promise<void> {
    if (this.sweeping) return;
    this.sweeping = true;
    const t0 = performance.now();
    let vms = 0;
    try {
      const seen = new Set<string>();
      const work: Promise<void>[] = [];
      for (const t of this.deps.targets()) {
        seen.add(t.id);
        if (t.pid === undefined) continue;
        vms++;
        work.push(this.sample(t.id, t.pid));
      }
      await Promise.all(work);
      for (const id of this.series.keys()) if (!seen.has(id)) this.series.delete(id);
    } finally {
      this.sweeping = false;
      this.lastSweep = { ms: performance.now() - t0, vms };
    }
  }

  private async sample(id: string, pid: number): Promise<void> {
    const [stats, disk] = await Promise.all([
      readProcStats(pid),
      // An overlay that cannot be stat'ed this once (being replaced by a resume): the last figure stays.
      this.deps.diskBytes(id).catch(() => undefined),
    ]);
    if (!stats) return; // QEMU gone between the listing and the read: its exit is the table's news
    const monoMs = performance.now();
    let s = this.series.get(id);
    if (!s) {
      s = { ring: new Ring(this.size), diskBytes: 0 };
      this.series.set(id, s);
    }
    const prev = s.last?.pid === pid ? s.last : undefined;
    const cpuPercent =
      prev && monoMs > prev.monoMs
        ? Math.max(0, ((stats.cpuMs - prev.cpuMs) / (monoMs - prev.monoMs)) * 100)
        : null;
    s.last = { pid, cpuMs: stats.cpuMs, monoMs };
    if (disk !== undefined) s.diskBytes = disk;
    s.ring.push({
      atMs: this.now(),
      cpuPercent: cpuPercent === null ? null : Math.round(cpuPercent * 10) / 10,
      memUsedBytes: stats.anonBytes,
      memResidentBytes: stats.residentBytes,
      diskBytes: s.diskBytes,
    });
  }
}
