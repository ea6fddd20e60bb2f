/**
 * What the gateway needs from a host agent: the gateway decides *where* a sandbox runs and
 * records that it runs; the agent owns *how*. Every call is a typed action; nothing here knows
 * about HTTP. The agent serves it over HTTP (agent/api/app.ts, docs/agent-api.md); the gateway
 * calls it through `AgentHttpClient` (gateway/agents/client.ts), and its tests through an
 * in-memory stand-in (tests/support/memory-agent.ts).
 *
 * The wire data is defined once, as the zod schemas in schemas.ts; the types below are inferred
 * from them. Only what never crosses the wire as JSON is written by hand: the method sets
 * (`AgentHostApi`, `AgentVmApi`, and `AgentApi`, both of them), the byte `Tunnel`, and the upload
 * source's local file path.
 *
 * Errors: an implementation throws `SandboxdError` (contracts/errors.ts) with one of the
 * `AgentErrorCode`s; the agent's status for each is `AGENT_STATUS_OF_CODE` (agent/api/errors.ts),
 * and the gateway maps them to public codes in one place (gateway/errors.ts). The client adds
 * `agent_unavailable` for an agent that does not answer.
 */
import type { z } from "zod";
import type { FileList, FileWritten } from "../api/files.ts";
import type { TunnelProtocol } from "../api/sandboxes-api.ts";
import type { FsOp, FsOpAnswer } from "./fs-ops.ts";
import type { ProcessInfo, ProcessLogs, ProcessStart, ProcessStdin } from "./processes.ts";
import type { PtyOpen } from "./pty.ts";
import type * as S from "./schemas.ts";

/** Every route of the agent's HTTP API is under this prefix. */
export const AGENT_API_PREFIX = "/v1";

export type VmId = z.infer<typeof S.VmIdParam>;
export type TemplateRef = z.infer<typeof S.TemplateRefParam>;

export type VmResources = z.infer<typeof S.ResourcesSchema>;
export type CreateVmOpts = Omit<z.infer<typeof S.CreateBody>, "template">;
export type CreatedVm = z.infer<typeof S.CreatedVmSchema>;

export type FileWriteAction = z.infer<typeof S.FileWrite>;
export type RunAction = z.infer<typeof S.RunAction>;
/**
 * An exec as the gateway sends it: the wire body with its timeout always set, since the client
 * derives the call's own deadline from it.
 */
export type ExecAction = z.infer<typeof S.ExecBody> & { timeoutMs: number };
export type ExecResult = z.infer<typeof S.ExecResultSchema>;
export type OneShotResult = z.infer<typeof S.OneShotResultSchema>;
export type SuspendResult = z.infer<typeof S.SuspendResultSchema>;
export type ResumeResult = z.infer<typeof S.ResumeResultSchema>;
export type VmEgress = z.infer<typeof S.EgressSchema>;
export type SnapshotRef = z.infer<typeof S.SnapshotRefParam>;
export type SnapshotTaken = z.infer<typeof S.SnapshotTakenSchema>;
export type SnapshotRestored = z.infer<typeof S.SnapshotRestoredSchema>;

export type TemplateSource =
  /**
   * The sessions API: an uploaded image at `path`, a file of the side that holds it (the gateway streams
   * it as the body of `PUT /templates/{ref}/upload`; the agent stages it again). The receiver owns
   * the file from then on (moves or deletes it).
   */
  | ({ kind: "upload"; path: string } & z.infer<typeof S.UploadQuery>)
  /** The sandboxes API (Pro): bake from an OCI reference, optionally into a ready state (docs/templates.md "Rules of templates"). */
  | ({ kind: "oci" } & z.infer<typeof S.OciBuildBody>);
export type TemplateBuildStatus = z.infer<typeof S.TemplateStatusSchema>;

export type AgentCapacity = z.infer<typeof S.CapacitySchema>;
export type VmSummary = z.infer<typeof S.VmSummarySchema>;
export type VmMetrics = z.infer<typeof S.VmMetricsSchema>;
export type AgentHealth = z.infer<typeof S.HealthSchema>;

export interface ExecStreamOptions {
  onOutput: (stream: "stdout" | "stderr", chunk: Uint8Array) => Promise<void> | void;
  signal: AbortSignal;
  /** Called once the agent has accepted the call, before any output. */
  onOpen?: () => void;
}

/**
 * A call of the file API (contracts/api/files.ts) on a live VM; `user` as in the query. An
 * upload's or a download's `signal` is the client gone: the upload is cancelled (the guest drops
 * its temp file), the download stops reading the guest.
 */
export type FileCall = { path: string; user?: string | undefined } & (
  | { op: "upload"; body: ReadableStream<Uint8Array>; signal: AbortSignal }
  | { op: "download"; signal: AbortSignal }
  | { op: "list" }
  | { op: "remove" }
);
export type FileAnswer =
  | { op: "upload"; written: z.infer<typeof FileWritten> }
  /** The file's bytes; an error after the first of them ends the stream with an error. */
  | { op: "download"; body: ReadableStream<Uint8Array> }
  | { op: "list"; list: z.infer<typeof FileList> }
  | { op: "remove" };

/** A byte tunnel to a guest port (connect-from-outside). */
export interface Tunnel {
  readable: ReadableStream<Uint8Array>;
  writable: WritableStream<Uint8Array>;
  close(): void;
}

/** A terminal's byte stream (`openPty`): a tunnel that can also change the terminal's size. */
export interface PtyTunnel extends Tunnel {
  resize(cols: number, rows: number): void;
  /** The shell's pid in the guest (a terminal; undefined from an agent that does not say it). */
  pid?: number;
}

/** The agent's `/vms/{id}/pty` upgrade answer header carrying the shell's guest pid (decimal). */
export const PTY_PID_HEADER = "x-sandboxd-pty-pid";

/**
 * The calls that name no VM: what a gateway asks of its agents as a whole. One agent serves them
 * for itself; the gateway's router (gateway/agents/router.ts) serves them across every live agent
 * of a region (a create goes to the one with room, a template is built on all of them).
 */
export interface AgentHostApi {
  /** Spawn a VM from a ready template. */
  createSandbox(template: TemplateRef, opts: CreateVmOpts): Promise<CreatedVm>;
  /** Run one action in a throwaway VM that is destroyed afterwards (sessions API /v1/exec). */
  execOnce(template: TemplateRef, action: ExecAction): Promise<OneShotResult>;
  /** Start a build in the background and return at once; poll `templateStatus`. */
  buildTemplate(template: TemplateRef, source: TemplateSource): Promise<void>;
  templateStatus(template: TemplateRef): Promise<TemplateBuildStatus>;
  /** In-flight VMs finish, then the template's resources are reclaimed. */
  deleteTemplate(template: TemplateRef): Promise<void>;
  /** Pro: pre-warm capacity for the next session of this width; `releaseTemplate` ends it. */
  expectWidth(template: TemplateRef, width: number): Promise<void>;
  releaseTemplate(template: TemplateRef): Promise<void>;
  health(): Promise<AgentHealth>;
}

/**
 * The calls on the VMs of one agent: only the agent that holds a VM can serve them, so the
 * gateway reaches them through the agent recorded on the sandbox's row (`Placement.agentFor`).
 */
export interface AgentVmApi {
  /** Run an action in a live VM. Serialized per VM: a concurrent call throws `busy`. */
  exec(vmId: VmId, action: ExecAction): Promise<ExecResult>;
  /**
   * `exec` with its output handed over as the guest produces it, uncapped: `onOutput` is awaited
   * before more is read (a slow consumer slows the guest's output, never the agent's memory), and
   * aborting `signal` cancels the command (the guest kills its process group). The result's
   * stdout/stderr are empty: the output went through `onOutput`. Errors before the first output
   * throw as `exec` does; later ones reject the promise the same way.
   */
  execStream(vmId: VmId, action: ExecAction, opts: ExecStreamOptions): Promise<ExecResult>;
  /** Branch a running VM into `count` copy-on-write children; `busy` while an exec is in flight. */
  fork(vmId: VmId, count: number): Promise<CreatedVm[]>;
  suspend(vmId: VmId): Promise<SuspendResult>;
  resume(vmId: VmId): Promise<ResumeResult>;
  /**
   * Keeps the running VM's memory and disk as snapshot `ref` on this agent (docs/snapshots.md);
   * the VM runs on after a fork's stall. `busy` while an exec is in flight.
   */
  takeSnapshot(vmId: VmId, ref: SnapshotRef): Promise<SnapshotTaken>;
  /**
   * Rolls running VM `vmId` back to kept snapshot `ref` of this agent in place (same id; its
   * tunnels and background processes end, saying so). `conflict` for a snapshot of another
   * template or size, `busy` while an exec or fork is in flight; a failure after its QEMU stopped
   * leaves the VM failed (`details.lost`).
   */
  restoreSnapshot(vmId: VmId, ref: SnapshotRef): Promise<SnapshotRestored>;
  /** A VM from a kept snapshot of this agent: its processes, memory and files as they were. */
  createFromSnapshot(ref: SnapshotRef, opts: CreateVmOpts): Promise<CreatedVm>;
  /**
   * Drops snapshot `ref` (idempotent): gone for `createFromSnapshot` at once, its files freed when
   * the last VM whose disk chain or memory rests on them ends.
   */
  deleteSnapshot(ref: SnapshotRef): Promise<void>;
  /** `force` aborts an in-flight exec; otherwise it is allowed to finish first. Idempotent. */
  destroy(vmId: VmId, opts: { force: boolean }): Promise<void>;
  /** Open a byte tunnel to a guest port of a running VM (throws `port_not_exposed`). */
  openTunnel(vmId: VmId, port: number, protocol: TunnelProtocol): Promise<Tunnel>;
  /**
   * Background processes (contracts/agent/processes.ts): started beside the foreground exec,
   * never `busy`; `pid` is the agent's number for one in its VM. `followProcess` hands over the
   * kept output, then new output, as `execStream` does, and resolves with the process's info once
   * it has ended; aborting `signal` stops following (the process runs on).
   */
  startProcess(vmId: VmId, req: ProcessStart): Promise<ProcessInfo>;
  listProcesses(vmId: VmId): Promise<ProcessInfo[]>;
  processLogs(vmId: VmId, pid: number): Promise<ProcessLogs>;
  followProcess(vmId: VmId, pid: number, opts: ExecStreamOptions): Promise<ProcessInfo>;
  processStdin(vmId: VmId, pid: number, input: ProcessStdin): Promise<void>;
  /** Kills the process group (CANCEL) and resolves with its info once it has ended. */
  killProcess(vmId: VmId, pid: number): Promise<ProcessInfo>;
  /**
   * An interactive shell (or `opts.argv`) on a new pseudo-terminal in a running VM, killed when
   * the tunnel closes; `env`, `cwd` and `user` as an exec's (contracts/agent/pty.ts). An unknown
   * user is `bad_request`.
   */
  openPty(vmId: VmId, opts: PtyOpen): Promise<PtyTunnel>;
  /** Upload, download, list or remove a file in a live VM, beside any exec (never `busy`). */
  files(vmId: VmId, call: FileCall): Promise<FileAnswer>;
  /** A filesystem op of contracts/agent/fs-ops.ts in a live VM, beside any exec (never `busy`). */
  fsOp(vmId: VmId, op: FsOp): Promise<FsOpAnswer>;
  /** Every VM this agent holds for sandboxes (not its warm pools), for reconciliation. */
  listVms(): Promise<VmSummary[]>;
  /** The refs of the kept snapshots this agent holds (`GET /snapshots`), for reconciliation. */
  listSnapshots(): Promise<SnapshotRef[]>;
  /** The VM's live metrics, sampled by the host (docs/metrics.md); a suspended VM's last ones. */
  metrics(vmId: VmId): Promise<VmMetrics>;
  /**
   * Replaces the VM's egress allow-list (docs/egress.md): new connections follow it at once, open
   * ones it no longer allows are closed, and the record keeps it (a suspended VM resumes under it,
   * a fork inherits it). `bad_request` for a malformed list, `conflict` while it is created or
   * destroyed.
   */
  setEgress(vmId: VmId, egressAllow: string[]): Promise<VmEgress>;
}

/** Everything one agent serves: its host calls and the calls on its own VMs. */
/**
 * A ready template copied between agents (docs/templates.md "Agents that join later"): the
 * gateway streams one agent's bundle into another, so neither dials the other (a BYOC agent
 * takes no inbound connection).
 */
export interface AgentCopyApi {
  /** The bundle of a ready template on this agent (`GET /templates/{ref}/bundle`). */
  exportTemplate(template: TemplateRef): Promise<ReadableStream<Uint8Array>>;
  /**
   * Reads `bundle` into template `template` on this agent (`PUT /templates/{ref}/copy`); returns
   * once it is staged, the copy going on as a build does (poll `templateStatus`).
   */
  copyTemplate(template: TemplateRef, bundle: ReadableStream<Uint8Array>): Promise<void>;
}

export interface AgentApi extends AgentHostApi, AgentVmApi, AgentCopyApi {}
