/**
 * The shapes the sandbox manager (manager.ts) works with: its options, what `info` answers, the
 * live record it keeps per VM and what of it goes on disk. Apart from manager.ts so that file stays
 * about behaviour.
 */
import type { EgressFence } from "../egress/fence.ts";
import type { EgressDefault, EgressPolicy } from "../egress/policy.ts";
import type { EgressAttempt, OpenEgress } from "../egress/proxy.ts";
import type { GuestTunnel } from "../guest/client.ts";
import { type MeterEvent, type UsageInterval, UsageMeter } from "./accounting.ts";
import type { HostCapacity } from "./capacity.ts";
import type { DriverVm, SandboxDriver, VmExitInfo, VmSize } from "./drivers/driver.ts";
import type { ProcessTable } from "./processes.ts";
import { persistedState, type SandboxRecord } from "./records.ts";
import type { AgentSandboxState } from "./states.ts";

export interface ManagerOptions {
  driver: SandboxDriver;
  /** Records and VM directories live here. */
  stateDir: string;
  /** Size of a VM whose template does not say (sessions API `mem_mib`, `vcpu_count`). */
  defaultSize?: VmSize;
  /** What this host may hand out; defaults below. */
  capacity?: Partial<HostCapacity>;
  /** QEMUs kept pre-launched per template (prelaunch-pool.ts); default 0, the CLI's agent 1. */
  prelaunch?: number;
  idlePauseMs?: number;
  /** Template builds run at once on this host (templates.ts); default MAX_CONCURRENT_BUILDS. */
  buildSlots?: number;
  /** Egress of a sandbox created without `egress` (the API leaves it to the deployment: docs/egress.md "Egress: choices"). */
  egressDefault?: EgressDefault;
  /**
   * Which addresses egress may reach and how names resolve (agent/egress/fence.ts); default: the
   * operator's fence from `SANDBOXD_EGRESS_ALLOW_INTERNAL`. Never set from the API.
   */
  fence?: EgressFence;
  onUsage?: (iv: UsageInterval) => void;
  /** State changes the gateway must hear of (accounting.ts; sent by agent/api/events.ts). */
  onEvent?: (e: MeterEvent) => void;
  log?: (msg: string) => void;
}

export interface SandboxInfo {
  id: string;
  templateId: string;
  kind: "session" | "sandbox";
  state: AgentSandboxState;
  reason?: string;
  createdAtMs: number;
  lastUsedAtMs: number;
  execCount: number;
  endpoints: Record<string, string>;
  qemuPid?: number;
  /** The allow-list in force (`["*"]`: everything, `[]`: nothing). */
  egressAllow: readonly string[];
  /** The latest refused egress attempts, oldest first (at most EGRESS_REFUSED_KEPT, guest-access.ts). */
  egressRefused: EgressAttempt[];
  /** A one-shot exec's VM (`execOnce`): gone with its call, no gateway row names it. */
  oneShot?: true;
}

/** One VM the manager holds, as it keeps it in memory (records.ts has the part on disk). */
export interface Sandbox {
  id: string;
  templateId: string;
  kind: "session" | "sandbox";
  state: AgentSandboxState;
  reason?: string;
  size: VmSize;
  vm?: DriverVm;
  createdAtMs: number;
  lastUsedAtMs: number;
  execCount: number;
  endpoints: Record<string, string>;
  egress: EgressPolicy;
  egressRefused: EgressAttempt[];
  /** Egress connections open now, closed by a new allow-list that refuses them (guest-access.ts). */
  egressOpen: Set<OpenEgress>;
  memBytes: number;
  /** The exec in flight (state busy), abortable by a force destroy. */
  inflight?: { abort: AbortController; done: Promise<unknown> };
  /** The driver operation in flight (spawn, fork, suspend, resume); destroy waits for it. */
  op?: Promise<unknown>;
  destroying?: Promise<void>;
  idleTimer?: ReturnType<typeof setTimeout>;
  /** Serializes QMP stop/cont; `stopped` is what the last one left. */
  vcpus: Promise<void>;
  stopped: boolean;
  died?: VmExitInfo;
  onDied: Array<() => void>;
  meter: UsageMeter;
  /** Open tunnels to guest ports; while any is open (or opening) the VM is not idle-paused. */
  tunnels: Set<GuestTunnel>;
  tunnelOpens: number;
  /** Background processes (processes.ts), made on first use. */
  procs?: ProcessTable;
  oneShot?: true;
}

/** What a new live record starts from (a create, a fork child, a record read back at start). */
export interface NewSandbox {
  id: string;
  templateId: string;
  kind: "session" | "sandbox";
  state: AgentSandboxState;
  size: VmSize;
  endpoints: Record<string, string>;
  egress: EgressPolicy;
  now: number;
}

/** A live record in state `o.state` since `o.now`, its meter already in that state. */
export function makeSandbox(
  o: NewSandbox,
  hooks: { onUsage: (iv: UsageInterval) => void; onEvent: (e: MeterEvent) => void },
): Sandbox {
  const sb: Sandbox = {
    id: o.id,
    templateId: o.templateId,
    kind: o.kind,
    state: o.state,
    size: o.size,
    createdAtMs: o.now,
    lastUsedAtMs: o.now,
    execCount: 0,
    endpoints: o.endpoints,
    egress: o.egress,
    egressRefused: [],
    egressOpen: new Set(),
    memBytes: 0,
    vcpus: Promise.resolve(),
    stopped: false,
    onDied: [],
    tunnels: new Set(),
    tunnelOpens: 0,
    meter: new UsageMeter(o.id, o.templateId, { ...o.size, diskBytes: 0 }, hooks.onUsage, hooks.onEvent),
  };
  sb.meter.enter(o.state, o.now);
  return sb;
}

/** What `info` answers for a live record: a copy, so callers cannot change the record. */
export function infoOf(sb: Sandbox): SandboxInfo {
  const out: SandboxInfo = {
    id: sb.id,
    templateId: sb.templateId,
    kind: sb.kind,
    state: sb.state,
    createdAtMs: sb.createdAtMs,
    lastUsedAtMs: sb.lastUsedAtMs,
    execCount: sb.execCount,
    endpoints: sb.endpoints,
    egressAllow: sb.egress.entries,
    egressRefused: [...sb.egressRefused],
  };
  if (sb.reason !== undefined) out.reason = sb.reason;
  if (sb.vm) out.qemuPid = sb.vm.qemuPid;
  if (sb.oneShot) out.oneShot = true;
  return out;
}

/** What goes on disk for a live record (records.ts); in-flight states as a restart should assume them. */
export function recordOf(sb: Sandbox): SandboxRecord {
  const record: SandboxRecord = {
    version: 1,
    id: sb.id,
    templateId: sb.templateId,
    kind: sb.kind,
    state: persistedState(sb.state),
    size: sb.size,
    createdAtMs: sb.createdAtMs,
    lastUsedAtMs: sb.lastUsedAtMs,
    execCount: sb.execCount,
    endpoints: sb.endpoints,
    egressAllow: [...sb.egress.entries],
  };
  if (sb.reason !== undefined) record.reason = sb.reason;
  if (sb.vm) record.qemuPid = sb.vm.qemuPid;
  return record;
}
