/**
 * `AgentApi` (contracts/agent/api.ts) over the agent's HTTP API (docs/agent-api.md): the
 * gateway's handle on one host agent. Each call is one request of agent-http.ts (signed, its
 * answer checked, an agent that does not answer `agent_unavailable`) with the deadline its kind
 * of call needs (`AgentTimeouts`).
 */
import { createReadStream } from "node:fs";
import { rm, stat } from "node:fs/promises";
import { Readable } from "node:stream";
import type {
  AgentApi,
  AgentHealth,
  CreatedVm,
  CreateVmOpts,
  ExecAction,
  ExecResult,
  ExecStreamOptions,
  FileAnswer,
  FileCall,
  OneShotResult,
  PtyTunnel,
  ResumeResult,
  SnapshotRef,
  SnapshotRestored,
  SnapshotTaken,
  SuspendResult,
  TemplateBuildStatus,
  TemplateRef,
  TemplateSource,
  Tunnel,
  VmEgress,
  VmId,
  VmMetrics,
  VmSummary,
} from "../../contracts/agent/api.ts";
import { type FsOp, type FsOpAnswer, FsOpAnswerSchema } from "../../contracts/agent/fs-ops.ts";
import {
  type ProcessInfo,
  ProcessInfoSchema,
  ProcessListSchema,
  type ProcessLogs,
  ProcessLogsSchema,
  type ProcessStart,
  type ProcessStdin,
} from "../../contracts/agent/processes.ts";
import { type PtyOpen, PtyOpenSchema, ptyQueryOf } from "../../contracts/agent/pty.ts";
import {
  CreatedVmSchema,
  EgressSchema,
  ExecResultSchema,
  ForkResultSchema,
  HealthSchema,
  MAX_EXEC_TIMEOUT_MS,
  OneShotResultSchema,
  ResumeResultSchema,
  SnapshotListSchema,
  SnapshotRestoredSchema,
  SnapshotTakenSchema,
  SuspendResultSchema,
  TemplateStatusSchema,
  VmListSchema,
  VmMetricsSchema,
} from "../../contracts/agent/schemas.ts";
import { FileList, FileWritten } from "../../contracts/api/files.ts";
import type { TunnelProtocol } from "../../contracts/api/sandboxes-api.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { type AgentCallTelemetry, AgentHttp } from "./agent-http.ts";
import { connectTunnel } from "./tunnel-client.ts";

/** Deadlines per kind of call, ms. Each is the longest the agent can legitimately take. */
export interface AgentTimeouts {
  /** Health and template status: answered from memory in ms; 5 s means the agent is stuck. */
  quick: number;
  /** Create, exec-once, fork, suspend, resume: a cold boot's 60 s bring-up deadline + queueing. */
  vmOp: number;
  /** Added to an exec's own timeout: file writes, the guest's kill + drain, the trip back. */
  execGrace: number;
  /** A normal destroy waits for the in-flight exec, which may run up to its own timeout. */
  destroy: number;
  /** Streaming a template image (multi-GB, docs/sessions.md "Rules of the sessions API") to the agent. */
  upload: number;
}

export const DEFAULT_AGENT_TIMEOUTS: AgentTimeouts = {
  quick: 5_000,
  vmOp: 120_000,
  execGrace: 30_000,
  destroy: MAX_EXEC_TIMEOUT_MS + 60_000,
  upload: 30 * 60_000,
};

export interface AgentHttpClientOptions {
  /** e.g. `http://10.0.0.5:7070` */
  baseUrl: string;
  /** The agent this client speaks to: its tokens are for this id only. */
  agentId: string;
  /** That agent's key (gateway/agents/enrollment.ts). */
  key: string | Uint8Array;
  timeouts?: Partial<AgentTimeouts>;
  /** Where its calls are counted, timed and traced. */
  telemetry?: AgentCallTelemetry;
}

export class AgentHttpClient implements AgentApi {
  private readonly http: AgentHttp;
  private readonly t: AgentTimeouts;

  constructor(opts: AgentHttpClientOptions) {
    this.http = new AgentHttp(opts);
    this.t = { ...DEFAULT_AGENT_TIMEOUTS, ...opts.timeouts };
  }

  createSandbox(template: TemplateRef, opts: CreateVmOpts): Promise<CreatedVm> {
    return this.http.call("POST", "/vms", { template, ...opts }, this.t.vmOp, CreatedVmSchema);
  }

  execOnce(template: TemplateRef, action: ExecAction): Promise<OneShotResult> {
    return this.http.call(
      "POST",
      "/exec-once",
      { template, action },
      this.t.vmOp + action.timeoutMs + this.t.execGrace,
      OneShotResultSchema,
    );
  }

  exec(vmId: VmId, action: ExecAction): Promise<ExecResult> {
    return this.http.call(
      "POST",
      `/vms/${enc(vmId)}/exec`,
      action,
      action.timeoutMs + this.t.execGrace,
      ExecResultSchema,
    );
  }

  /** `POST /vms/{id}/exec?stream=1`: frames (`frames` below), one deadline as for `exec`. */
  execStream(vmId: VmId, action: ExecAction, opts: ExecStreamOptions): Promise<ExecResult> {
    const deadlineMs = action.timeoutMs + this.t.execGrace;
    return this.http.frames(
      "POST",
      `/vms/${enc(vmId)}/exec?stream=1`,
      action,
      deadlineMs,
      opts,
      ExecResultSchema,
    );
  }

  startProcess(vmId: VmId, req: ProcessStart): Promise<ProcessInfo> {
    // Wakes an idle-paused VM and may look the user up in the guest: a VM operation's deadline.
    return this.http.call("POST", `/vms/${enc(vmId)}/processes`, req, this.t.vmOp, ProcessInfoSchema);
  }

  async listProcesses(vmId: VmId): Promise<ProcessInfo[]> {
    const path = `/vms/${enc(vmId)}/processes`;
    return (await this.http.call("GET", path, undefined, this.t.quick, ProcessListSchema)).processes;
  }

  processLogs(vmId: VmId, pid: number): Promise<ProcessLogs> {
    const path = `/vms/${enc(vmId)}/processes/${pid}/logs`;
    // Up to 2 MiB of kept output from memory: quick.
    return this.http.call("GET", path, undefined, this.t.quick, ProcessLogsSchema);
  }

  /** No deadline: a process may run for ever; the follower's `signal` ends it. */
  followProcess(vmId: VmId, pid: number, opts: ExecStreamOptions): Promise<ProcessInfo> {
    const path = `/vms/${enc(vmId)}/processes/${pid}/logs?follow=1`;
    return this.http.frames("GET", path, undefined, undefined, opts, ProcessInfoSchema);
  }

  async processStdin(vmId: VmId, pid: number, input: ProcessStdin): Promise<void> {
    await this.http.call("POST", `/vms/${enc(vmId)}/processes/${pid}/stdin`, input, this.t.vmOp, null);
  }

  killProcess(vmId: VmId, pid: number): Promise<ProcessInfo> {
    // Wakes the VM, CANCELs, and waits for the guest's answer (its own grace is 10 s).
    return this.http.call(
      "DELETE",
      `/vms/${enc(vmId)}/processes/${pid}`,
      undefined,
      this.t.vmOp,
      ProcessInfoSchema,
    );
  }

  async fork(vmId: VmId, count: number): Promise<CreatedVm[]> {
    const r = await this.http.call(
      "POST",
      `/vms/${enc(vmId)}/fork`,
      { count },
      this.t.vmOp,
      ForkResultSchema,
    );
    return r.children;
  }

  restoreSnapshot(vmId: VmId, ref: SnapshotRef): Promise<SnapshotRestored> {
    return this.http.call(
      "POST",
      `/vms/${enc(vmId)}/restore`,
      { snapshot: ref },
      this.t.vmOp,
      SnapshotRestoredSchema,
    );
  }

  takeSnapshot(vmId: VmId, ref: SnapshotRef): Promise<SnapshotTaken> {
    return this.http.call(
      "POST",
      `/vms/${enc(vmId)}/snapshots`,
      { snapshot: ref },
      this.t.vmOp,
      SnapshotTakenSchema,
    );
  }

  createFromSnapshot(ref: SnapshotRef, opts: CreateVmOpts): Promise<CreatedVm> {
    return this.http.call("POST", `/snapshots/${enc(ref)}/vms`, opts, this.t.vmOp, CreatedVmSchema);
  }

  async deleteSnapshot(ref: SnapshotRef): Promise<void> {
    await this.http.call("DELETE", `/snapshots/${enc(ref)}`, undefined, this.t.vmOp, null);
  }

  suspend(vmId: VmId): Promise<SuspendResult> {
    return this.http.call("POST", `/vms/${enc(vmId)}/suspend`, undefined, this.t.vmOp, SuspendResultSchema);
  }

  resume(vmId: VmId): Promise<ResumeResult> {
    return this.http.call("POST", `/vms/${enc(vmId)}/resume`, undefined, this.t.vmOp, ResumeResultSchema);
  }

  async destroy(vmId: VmId, opts: { force: boolean }): Promise<void> {
    // A force destroy kills at once; a normal one may wait for the in-flight exec.
    const timeout = opts.force ? this.t.vmOp : this.t.destroy;
    await this.http.call("DELETE", `/vms/${enc(vmId)}?force=${opts.force}`, undefined, timeout, null);
  }

  async buildTemplate(template: TemplateRef, source: TemplateSource): Promise<void> {
    if (source.kind === "upload") {
      const q = new URLSearchParams();
      if (source.memMib !== undefined) q.set("memMib", String(source.memMib));
      if (source.vcpuCount !== undefined) q.set("vcpuCount", String(source.vcpuCount));
      if (source.waitSecs !== undefined) q.set("waitSecs", String(source.waitSecs));
      const size = (await stat(source.path)).size;
      const body = Readable.toWeb(createReadStream(source.path)) as ReadableStream<Uint8Array>;
      try {
        await this.http.call("PUT", `/templates/${enc(template)}/upload?${q}`, body, this.t.upload, null, {
          "content-type": "application/octet-stream",
          "content-length": String(size),
        });
      } finally {
        // The agent owns the image from now on (TemplateSource): our copy goes.
        await rm(source.path, { force: true });
      }
      return;
    }
    const { kind: _kind, ...oci } = source;
    await this.http.call("PUT", `/templates/${enc(template)}`, oci, this.t.quick, null);
  }

  /** Streamed as the receiver reads it; the upload deadline bounds the whole transfer. */
  async exportTemplate(template: TemplateRef): Promise<ReadableStream<Uint8Array>> {
    const deadline = AbortSignal.timeout(this.t.upload);
    const res = await this.http.open("GET", `/templates/${enc(template)}/bundle`, {}, deadline, deadline);
    return res.body;
  }

  async copyTemplate(template: TemplateRef, bundle: ReadableStream<Uint8Array>): Promise<void> {
    await this.http.call("PUT", `/templates/${enc(template)}/copy`, bundle, this.t.upload, null, {
      "content-type": "application/octet-stream",
    });
  }

  templateStatus(template: TemplateRef): Promise<TemplateBuildStatus> {
    return this.http.call(
      "GET",
      `/templates/${enc(template)}`,
      undefined,
      this.t.quick,
      TemplateStatusSchema,
    );
  }

  async deleteTemplate(template: TemplateRef): Promise<void> {
    await this.http.call("DELETE", `/templates/${enc(template)}`, undefined, this.t.quick, null);
  }

  async expectWidth(template: TemplateRef, width: number): Promise<void> {
    await this.http.call("POST", `/templates/${enc(template)}/expect`, { width }, this.t.quick, null);
  }

  async releaseTemplate(template: TemplateRef): Promise<void> {
    await this.http.call("POST", `/templates/${enc(template)}/release`, undefined, this.t.quick, null);
  }

  /**
   * A raw byte tunnel to a guest port: `GET /vms/{id}/tunnel?port=N` upgraded to a WebSocket
   * (tunnel-client.ts). Errors before the upgrade are the agent's codes (not_found, conflict,
   * gone, port_unreachable). The agent always carries raw bytes: a `cdp` relay's framing is the
   * gateway's business on top of them, so `_protocol` does not reach the agent.
   */
  async openTunnel(vmId: VmId, port: number, _protocol: TunnelProtocol): Promise<Tunnel> {
    const url = this.http.wsUrl(`/vms/${enc(vmId)}/tunnel?port=${port}`);
    // Opening wakes an idle-paused VM and connects inside the guest: a VM operation's deadline.
    return connectTunnel(url, await this.http.token(), this.t.vmOp);
  }

  /**
   * A shell (or `opts.argv`) on a pseudo-terminal: `GET /vms/{id}/pty?cols=&rows=&argv=&env=&cwd=&user=`
   * (contracts/agent/pty.ts `ptyQueryOf`) upgraded to a WebSocket, the same byte tunnel as
   * `openTunnel` whose `resize` sends a text message. Options past their bounds are `bad_request`
   * here, before the agent is asked.
   */
  async openPty(vmId: VmId, opts: PtyOpen): Promise<PtyTunnel> {
    const checked = PtyOpenSchema.safeParse(opts);
    if (!checked.success) {
      const issues = checked.error.issues.map((i) => `${i.path.join(".") || "(root)"}: ${i.message}`);
      throw new SandboxdError("bad_request", `terminal options: ${issues.join("; ")}`, {
        cause: checked.error,
      });
    }
    const url = this.http.wsUrl(`/vms/${enc(vmId)}/pty?${ptyQueryOf(checked.data)}`);
    // Opening wakes an idle-paused VM and starts the shell: a VM operation's deadline.
    return connectTunnel(url, await this.http.token(), this.t.vmOp);
  }

  /**
   * The agent's file routes (`/vms/{id}/files`). Uploads and downloads stream both ways: the
   * request body is read only as fast as the agent takes it, the answer's body is handed over
   * unread. Their deadline is the upload one (a large file over a slow guest channel takes
   * minutes); `signal` (the client gone) ends them at once. List and remove may wake a paused VM
   * first: a VM operation's deadline.
   */
  async files(vmId: VmId, call: FileCall): Promise<FileAnswer> {
    const q = new URLSearchParams({ path: call.path });
    if (call.user !== undefined) q.set("user", call.user);
    const path = `/vms/${enc(vmId)}/files`;
    if (call.op === "list") {
      q.set("list", "true");
      return {
        op: "list",
        list: await this.http.call("GET", `${path}?${q}`, undefined, this.t.vmOp, FileList),
      };
    }
    if (call.op === "remove") {
      await this.http.call("DELETE", `${path}?${q}`, undefined, this.t.vmOp, null);
      return { op: "remove" };
    }
    const method = call.op === "upload" ? "PUT" : "GET";
    const deadline = AbortSignal.timeout(this.t.upload);
    const res = await this.http.open(
      method,
      path,
      call.op === "upload"
        ? {
            search: String(q),
            headers: { "content-type": "application/octet-stream" },
            body: call.body,
            duplex: "half",
          }
        : { search: String(q) },
      AbortSignal.any([call.signal, deadline]),
      deadline,
    );
    if (call.op === "download") return { op: "download", body: res.body };
    // A body that is not JSON fails the parse below, whose error names the answer.
    const r = FileWritten.safeParse(await res.json().catch(() => undefined));
    if (!r.success) {
      throw new SandboxdError("internal", `agent answered ${method} ${path} with an unexpected body`, {
        cause: r.error,
      });
    }
    return { op: "upload", written: r.data };
  }

  /** `POST /vms/{id}/files/ops`: a guest command each, which may wake a paused VM: a VM op's deadline. */
  fsOp(vmId: VmId, op: FsOp): Promise<FsOpAnswer> {
    return this.http.call("POST", `/vms/${enc(vmId)}/files/ops`, op, this.t.vmOp, FsOpAnswerSchema);
  }

  async health(): Promise<AgentHealth> {
    const h = await this.http.call("GET", "/health", undefined, this.t.quick, HealthSchema);
    return { ok: h.ok, version: h.version, capacity: h.capacity };
  }

  async listVms(): Promise<VmSummary[]> {
    return (await this.http.call("GET", "/vms", undefined, this.t.quick, VmListSchema)).vms;
  }

  /** A new egress allow-list: set in memory and written to the VM's record, quick. */
  setEgress(vmId: VmId, egressAllow: string[]): Promise<VmEgress> {
    return this.http.call("PUT", `/vms/${enc(vmId)}/egress`, { egressAllow }, this.t.quick, EgressSchema);
  }

  async listSnapshots(): Promise<SnapshotRef[]> {
    return (await this.http.call("GET", "/snapshots", undefined, this.t.quick, SnapshotListSchema)).snapshots;
  }

  /** Samples the agent keeps in memory (agent/sandbox/live-metrics.ts): quick. */
  metrics(vmId: VmId): Promise<VmMetrics> {
    return this.http.call("GET", `/vms/${enc(vmId)}/metrics`, undefined, this.t.quick, VmMetricsSchema);
  }
}

function enc(s: string): string {
  return encodeURIComponent(s);
}
