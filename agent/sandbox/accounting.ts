/**
 * Accounting hooks: for each VM, the intervals it spent running, paused (idle, vCPUs stopped) and
 * suspended (on disk only), with the resources it held during each. The manager reports a closed
 * interval to `onUsage` as it ends and answers `usage(id)` queries; turning intervals into the
 * API's usage totals (cpu_core_hours, ram_gb_hours, disk_gb_hours, snapshot_gb_months;
 * docs/quotas-and-usage.md "Usage metering") is the gateway's job.
 *
 * The meter also says what the gateway must hear (`onEvent`, sent by agent/api/events.ts): every
 * change of phase after the first (the gateway learns of a new VM from the create answer), the
 * VM's end (`failed` with its reason, or `destroyed`), and a measured change of its disk.
 */
import type { VmEvent } from "../../contracts/agent/events.ts";
import type { AgentSandboxState } from "./states.ts";

/** An event before the sender numbers it. */
export type MeterEvent = Omit<VmEvent, "seq">;

/**
 * A disk that changed by less than this since the last event is not news: an overlay grows by a
 * few KB with every exec (logs, caches), and an event per exec would split the gateway's intervals
 * for sub-cent differences. 1 MiB is 0.001 GiB: below what a GB-hour report shows.
 */
export const DISK_EVENT_MIN_BYTES = 1024 * 1024;

export type UsagePhase = "running" | "paused" | "suspended";

/** Which metering phase a state is in; none for states without a VM or a snapshot. */
export function phaseOf(state: AgentSandboxState): UsagePhase | undefined {
  switch (state) {
    case "creating":
    case "running":
    case "busy":
    case "forking":
    case "suspending":
    case "resuming":
      return "running";
    case "paused":
      return "paused";
    case "suspended":
      return "suspended";
    case "destroying":
    case "destroyed":
    case "failed":
    case "lost":
      return undefined;
  }
}

export interface UsageResources {
  vcpus: number;
  memMib: number;
  /** Bytes of the VM's own disk (overlay), last measured. */
  diskBytes: number;
}

export interface UsageInterval extends UsageResources {
  vmId: string;
  templateId: string;
  phase: UsagePhase;
  startMs: number;
  endMs: number;
}

export interface UsageReport {
  vmId: string;
  resources: UsageResources;
  /** Closed intervals plus the open one up to now, ms per phase. */
  totalsMs: Record<UsagePhase, number>;
  current: { phase: UsagePhase; sinceMs: number } | undefined;
}

/** The meter of one VM: one open interval at a time, closed on every phase change. */
export class UsageMeter {
  private open: { phase: UsagePhase; startMs: number } | undefined;
  private readonly totals: Record<UsagePhase, number> = { running: 0, paused: 0, suspended: 0 };
  resources: UsageResources;
  /** Bytes of the memory image a suspended VM keeps on disk (set by the suspend). */
  memImageBytes = 0;
  /** The disk size the gateway was last told (or will be told by the create answer). */
  private reportedDisk = 0;

  constructor(
    readonly vmId: string,
    readonly templateId: string,
    resources: UsageResources,
    private readonly emit: (iv: UsageInterval) => void,
    private readonly onEvent: (e: MeterEvent) => void = () => {},
  ) {
    this.resources = { ...resources };
  }

  /**
   * Enters the phase of `state` at `nowMs`, closing (and reporting) the previous interval; the
   * gateway hears of the change unless this is the meter's first phase. `reason`: why the VM
   * failed, when `state` is `failed` or `lost`.
   */
  enter(state: AgentSandboxState, nowMs: number, reason?: string): void {
    const phase = phaseOf(state);
    if (this.open?.phase === phase) return;
    if (this.open) {
      const ended = state === "failed" || state === "lost" ? "failed" : "destroyed";
      const e: MeterEvent = {
        vmId: this.vmId,
        state: phase ?? ended,
        atMs: nowMs,
        resources: this.held(phase),
      };
      if (e.state === "failed" && reason !== undefined) e.reason = reason;
      this.close(nowMs);
      this.reportedDisk = this.resources.diskBytes;
      this.onEvent(e);
    }
    this.open = phase === undefined ? undefined : { phase, startMs: nowMs };
  }

  /**
   * A new measurement of the VM's disk overlay. A change of at least DISK_EVENT_MIN_BYTES since
   * the gateway last heard starts a new interval of the same phase with the new size.
   */
  setDisk(bytes: number, nowMs: number): void {
    if (!this.open || Math.abs(bytes - this.reportedDisk) < DISK_EVENT_MIN_BYTES) {
      this.resources.diskBytes = bytes;
      return;
    }
    const phase = this.open.phase;
    this.close(nowMs);
    this.resources.diskBytes = bytes;
    this.open = { phase, startMs: nowMs };
    this.reportedDisk = bytes;
    this.onEvent({ vmId: this.vmId, state: phase, atMs: nowMs, resources: this.held(phase) });
  }

  /** What the VM holds in `phase`: a suspended one only its disk and its memory image. */
  private held(phase: UsagePhase | undefined): UsageResources {
    if (phase !== "suspended") return { ...this.resources };
    return { vcpus: 0, memMib: 0, diskBytes: this.resources.diskBytes + this.memImageBytes };
  }

  private close(nowMs: number): void {
    if (this.open) {
      const iv: UsageInterval = {
        vmId: this.vmId,
        templateId: this.templateId,
        phase: this.open.phase,
        startMs: this.open.startMs,
        endMs: nowMs,
        ...this.resources,
      };
      this.totals[iv.phase] += iv.endMs - iv.startMs;
      this.emit(iv);
    }
  }

  report(nowMs: number): UsageReport {
    const totalsMs = { ...this.totals };
    if (this.open) totalsMs[this.open.phase] += nowMs - this.open.startMs;
    return {
      vmId: this.vmId,
      resources: { ...this.resources },
      totalsMs,
      current: this.open ? { phase: this.open.phase, sinceMs: this.open.startMs } : undefined,
    };
  }
}
