/**
 * What the gateway needs from a host agent (style.md habit 7: the gateway decides *where* a
 * sandbox runs and records that it runs; the agent owns *how*). Pure types: every call is a typed
 * action, nothing here knows about HTTP. The real agent (agent/, another team) satisfies this
 * interface, in-process or behind an HTTP+JWT client; tests use an in-memory stand-in.
 *
 * Errors: an implementation throws `SandboxdError` (contracts/errors.ts) with these codes, which
 * gateway/errors.ts maps to HTTP statuses:
 *   not_found (vm or template unknown to the agent), gone (VM reclaimed), busy (an exec is in
 *   flight on that VM; exec and fork), template_not_ready, template_in_use, at_capacity
 *   (no room on this host), spawn_failed (VM spawn or restore failed), bringup_timeout
 *   (environment bring-up timed out), conflict (state does not allow the action), internal.
 * Any other code or a plain Error becomes a 500 `internal` with no detail leaked to the client.
 */
import type { BakePhase, ReadySpec, TunnelProtocol } from "../api/family-b.ts";

/** Every route of the agent's HTTP API is under this prefix. */
export const AGENT_API_PREFIX = "/v1";

/** The agent's handle for a VM; the gateway's sess_/sbx_ ids map to it in the db. */
export type VmId = string;
/**
 * The agent's key for a template. The gateway chooses it (unique across tenants: the template id
 * for public templates, `<tenantId>.<templateId>` for a tenant's own) and passes it everywhere.
 */
export type TemplateRef = string;

export interface VmResources {
  vcpus: number;
  memMib: number;
  /** Bytes of the VM's own writable disk (its copy-on-write overlay), for metering. */
  diskBytes: number;
}

export interface CreateVmOpts {
  /** What the VM is for: affects idle handling only (sessions pause between calls). */
  kind: "session" | "sandbox";
  /** Egress policy; host names the guest may reach. Undefined = the deployment default. */
  egressAllow?: string[];
}

export interface CreatedVm {
  vmId: VmId;
  /** Spawn time, ms (a per-call measurement). */
  forkTimeMs: number;
  /** Total bring-up including the readiness probe, ms. */
  createTimeMs: number;
  /** Exposed guest port (decimal string) -> connect hint (not a dialable address). */
  endpoints: Record<string, string>;
  resources: VmResources;
}

export interface FileWriteAction {
  path: string;
  content: string;
}

/** What to run after the files are written. */
export type RunAction =
  /** Source code, run by the template's interpreter/entrypoint (Family A `code`). */
  | { kind: "code"; code: string }
  /** One command line run by /bin/sh -c (Family B `command`). */
  | { kind: "shell"; command: string }
  /** Argv arrays run in order, no shell; the result is the last one's (`commands`). */
  | { kind: "argv"; commands: string[][] }
  /** Only write files. */
  | { kind: "none" };

export interface ExecAction {
  /** Written (created or overwritten) before anything runs. */
  files: FileWriteAction[];
  run: RunAction;
  /** Hard limit for the whole action, ms; on expiry the process group is killed. */
  timeoutMs: number;
  /** Family B `seed`, handed to the guest; the agent reports `seedAck`. */
  seed?: string;
}

export interface ExecResult {
  stdout: string;
  stderr: string;
  exitCode: number;
  execTimeMs: number;
  totalTimeMs: number;
  /** e.g. "verified" when the guest saw the seed. */
  seedAck?: string;
}

export interface OneShotResult extends ExecResult {
  forkTimeMs: number;
}

export interface SuspendResult {
  /** Size of the on-disk memory image, bytes. */
  memBytes: number;
  /** Bytes the suspended VM keeps on disk in all (memory image + disk overlay), for metering. */
  snapshotBytes: number;
}

export interface ResumeResult {
  memBytes: number;
  resources: VmResources;
}

export type TemplateSource =
  /**
   * Family A: an uploaded image the gateway streamed to `path`. The agent owns the file from
   * then on (moves or deletes it).
   */
  | { kind: "upload"; path: string; memMib?: number; vcpuCount?: number; waitSecs?: number }
  /** Family B (Pro): bake from an OCI reference, optionally into a ready state (spec 4.3). */
  | { kind: "oci"; image: string; ready?: ReadySpec; width?: number; expectedWidth?: number };

export interface TemplateBuildStatus {
  status: "building" | "ready" | "failed";
  /** Family B bake phase; `Live` when ready, `Failed` when failed. */
  phase: BakePhase;
  /** Readable error when failed (never a crash; spec 3.1). */
  error?: string;
  /** Unix ms when the template became ready. */
  readyAtMs?: number;
  /** Guest ports exposed by forks of this template (`ready.ports`). */
  exposedPorts: number[];
  /** Readiness telemetry, passed through to clients as is. */
  telemetry: Record<string, unknown>;
}

export interface AgentCapacity {
  /** How many more VMs of a default size this host can start now. */
  slotsFree: number;
  slotsTotal: number;
  vcpusFree: number;
  memMibFree: number;
}

export interface AgentHealth {
  ok: boolean;
  version: string;
  capacity: AgentCapacity;
}

/** A byte tunnel to a guest port (connect-from-outside). */
export interface Tunnel {
  readable: ReadableStream<Uint8Array>;
  writable: WritableStream<Uint8Array>;
  close(): void;
}

export interface AgentApi {
  /** Spawn a VM from a ready template. */
  createSandbox(template: TemplateRef, opts: CreateVmOpts): Promise<CreatedVm>;
  /** Run one action in a throwaway VM that is destroyed afterwards (Family A /v1/exec). */
  execOnce(template: TemplateRef, action: ExecAction): Promise<OneShotResult>;
  /** Run an action in a live VM. Serialized per VM: a concurrent call throws `busy`. */
  exec(vmId: VmId, action: ExecAction): Promise<ExecResult>;
  /** Branch a running VM into `count` copy-on-write children; `busy` while an exec is in flight. */
  fork(vmId: VmId, count: number): Promise<CreatedVm[]>;
  suspend(vmId: VmId): Promise<SuspendResult>;
  resume(vmId: VmId): Promise<ResumeResult>;
  /** `force` aborts an in-flight exec; otherwise it is allowed to finish first. Idempotent. */
  destroy(vmId: VmId, opts: { force: boolean }): Promise<void>;
  /** Start a build in the background and return at once; poll `templateStatus`. */
  buildTemplate(template: TemplateRef, source: TemplateSource): Promise<void>;
  templateStatus(template: TemplateRef): Promise<TemplateBuildStatus>;
  /** In-flight VMs finish, then the template's resources are reclaimed. */
  deleteTemplate(template: TemplateRef): Promise<void>;
  /** Pro: pre-warm capacity for the next session of this width; `releaseTemplate` ends it. */
  expectWidth(template: TemplateRef, width: number): Promise<void>;
  releaseTemplate(template: TemplateRef): Promise<void>;
  /** Open a byte tunnel to a guest port of a running VM (throws `port_not_exposed`). */
  openTunnel(vmId: VmId, port: number, protocol: TunnelProtocol): Promise<Tunnel>;
  health(): Promise<AgentHealth>;
}
