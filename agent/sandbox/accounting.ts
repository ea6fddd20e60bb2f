/**
 * Accounting hooks: for each VM, the intervals it spent running, paused (idle, vCPUs stopped) and
 * suspended (on disk only), with the resources it held during each. The manager reports a closed
 * interval to `onUsage` as it ends and answers `usage(id)` queries; turning intervals into the
 * spec's usage totals (cpu_core_hours, ram_gb_hours, disk_gb_hours, snapshot_gb_months; spec
 * 2.9) is the gateway's job.
 */
import type { AgentSandboxState } from "./states.ts";

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

  constructor(
    readonly vmId: string,
    readonly templateId: string,
    resources: UsageResources,
    private readonly emit: (iv: UsageInterval) => void,
  ) {
    this.resources = { ...resources };
  }

  /** Enters the phase of `state` at `nowMs`, closing (and reporting) the previous interval. */
  enter(state: AgentSandboxState, nowMs: number): void {
    const phase = phaseOf(state);
    if (this.open?.phase === phase) return;
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
    this.open = phase === undefined ? undefined : { phase, startMs: nowMs };
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
