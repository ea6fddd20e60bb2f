/**
 * `AgentApi` (contracts/agent/api.ts) over the agent's HTTP API (docs/agent-api.md): the
 * gateway's handle on one host agent. Every request carries a fresh short-lived JWT for that agent,
 * signed with its own key (contracts/agent/token.ts); every answer
 * is checked with the same zod schemas the agent uses; an agent error comes back as the same
 * `SandboxdError` code it had on the agent. An agent that does not answer (refused, reset, or
 * silent past the call's deadline) is a `SandboxdError("agent_unavailable")`, never a hang.
 */
import { createReadStream } from "node:fs";
import { rm, stat } from "node:fs/promises";
import { Readable } from "node:stream";
import type { z } from "zod";
import {
  AGENT_API_PREFIX,
  type AgentApi,
  type AgentHealth,
  type CreatedVm,
  type CreateVmOpts,
  type ExecAction,
  type ExecResult,
  type ExecStreamOptions,
  type FileAnswer,
  type FileCall,
  type OneShotResult,
  type PtyTunnel,
  type ResumeResult,
  type SuspendResult,
  type TemplateBuildStatus,
  type TemplateRef,
  type TemplateSource,
  type Tunnel,
  type VmId,
  type VmSummary,
} from "../../contracts/agent/api.ts";
import { ExecFrameDecoder, ExecFrameKind } from "../../contracts/agent/exec-stream.ts";
import {
  type ProcessInfo,
  ProcessInfoSchema,
  ProcessListSchema,
  type ProcessLogs,
  ProcessLogsSchema,
  type ProcessStart,
  type ProcessStdin,
} from "../../contracts/agent/processes.ts";
import {
  CreatedVmSchema,
  ExecResultSchema,
  errorFromAgentAnswer,
  ForkResultSchema,
  HealthSchema,
  MAX_EXEC_TIMEOUT_MS,
  OneShotResultSchema,
  ResumeResultSchema,
  SuspendResultSchema,
  TemplateStatusSchema,
  VmListSchema,
} from "../../contracts/agent/schemas.ts";
import { secretKey, signAgentToken } from "../../contracts/agent/token.ts";
import { FileList, FileWritten } from "../../contracts/api/files.ts";
import type { TunnelProtocol } from "../../contracts/api/sandboxes-api.ts";
import { SandboxdError } from "../../contracts/errors.ts";
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
  /** Streaming a template image (multi-GB, spec 4.1) to the agent. */
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
}

export class AgentHttpClient implements AgentApi {
  private readonly key: Uint8Array;
  private readonly agentId: string;
  private readonly base: string;
  private readonly t: AgentTimeouts;

  constructor(opts: AgentHttpClientOptions) {
    this.key = secretKey(opts.key);
    this.agentId = opts.agentId;
    this.base = `${opts.baseUrl.replace(/\/+$/, "")}${AGENT_API_PREFIX}`;
    this.t = { ...DEFAULT_AGENT_TIMEOUTS, ...opts.timeouts };
  }

  createSandbox(template: TemplateRef, opts: CreateVmOpts): Promise<CreatedVm> {
    return this.call("POST", "/vms", { template, ...opts }, this.t.vmOp, CreatedVmSchema);
  }

  execOnce(template: TemplateRef, action: ExecAction): Promise<OneShotResult> {
    return this.call(
      "POST",
      "/exec-once",
      { template, action },
      this.t.vmOp + action.timeoutMs + this.t.execGrace,
      OneShotResultSchema,
    );
  }

  exec(vmId: VmId, action: ExecAction): Promise<ExecResult> {
    return this.call(
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
    return this.frames("POST", `/vms/${enc(vmId)}/exec?stream=1`, action, deadlineMs, opts, ExecResultSchema);
  }

  startProcess(vmId: VmId, req: ProcessStart): Promise<ProcessInfo> {
    // Wakes an idle-paused VM and may look the user up in the guest: a VM operation's deadline.
    return this.call("POST", `/vms/${enc(vmId)}/processes`, req, this.t.vmOp, ProcessInfoSchema);
  }

  async listProcesses(vmId: VmId): Promise<ProcessInfo[]> {
    const path = `/vms/${enc(vmId)}/processes`;
    return (await this.call("GET", path, undefined, this.t.quick, ProcessListSchema)).processes;
  }

  processLogs(vmId: VmId, pid: number): Promise<ProcessLogs> {
    const path = `/vms/${enc(vmId)}/processes/${pid}/logs`;
    // Up to 2 MiB of kept output from memory: quick.
    return this.call("GET", path, undefined, this.t.quick, ProcessLogsSchema);
  }

  /** No deadline: a process may run for ever; the follower's `signal` ends it. */
  followProcess(vmId: VmId, pid: number, opts: ExecStreamOptions): Promise<ProcessInfo> {
    const path = `/vms/${enc(vmId)}/processes/${pid}/logs?follow=1`;
    return this.frames("GET", path, undefined, undefined, opts, ProcessInfoSchema);
  }

  async processStdin(vmId: VmId, pid: number, input: ProcessStdin): Promise<void> {
    await this.call("POST", `/vms/${enc(vmId)}/processes/${pid}/stdin`, input, this.t.vmOp, null);
  }

  killProcess(vmId: VmId, pid: number): Promise<ProcessInfo> {
    // Wakes the VM, CANCELs, and waits for the guest's answer (its own grace is 10 s).
    return this.call(
      "DELETE",
      `/vms/${enc(vmId)}/processes/${pid}`,
      undefined,
      this.t.vmOp,
      ProcessInfoSchema,
    );
  }

  /**
   * A framed answer (contracts/agent/exec-stream.ts): the streamed exec, a followed process.
   * Each output frame is awaited through `onOutput` before the next read, so a slow consumer
   * leaves the agent's body unread and the agent stops reading the guest. One deadline for the
   * whole exchange when given (a streamed exec: the guest kills the command at its timeout, after
   * which only the buffers' worth of output is left to read; a consumer that has not read it
   * within the grace loses the stream). `signal` (the client gone) ends the request, which
   * cancels the command (or the following) at the agent.
   */
  private async frames<T extends z.ZodType>(
    method: string,
    path: string,
    body: unknown,
    deadlineMs: number | undefined,
    opts: ExecStreamOptions,
    schema: T,
  ): Promise<z.infer<T>> {
    const url = `${this.base}${path}`;
    const deadline = deadlineMs === undefined ? undefined : AbortSignal.timeout(deadlineMs);
    const headers: Record<string, string> = {
      authorization: `Bearer ${await signAgentToken(this.key, this.agentId)}`,
    };
    if (body !== undefined) headers["content-type"] = "application/json";
    let res: Response;
    try {
      res = await fetch(url, {
        method,
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
        signal: deadline ? AbortSignal.any([opts.signal, deadline]) : opts.signal,
      });
    } catch (err) {
      throw new SandboxdError("agent_unavailable", `agent ${this.base} is unreachable (${method} ${path})`, {
        cause: err,
        details: { url, timedOut: deadline?.aborted ?? false },
      });
    }
    if (!res.ok || !res.body) throw errorFromAgentAnswer(res.status, await res.text(), `${method} ${path}`);
    opts.onOpen?.();
    const reader = res.body.getReader();
    const decoder = new ExecFrameDecoder();
    const broken = (why: string, cause?: unknown) =>
      new SandboxdError("agent_unavailable", `agent ${this.base}: ${method} ${path} stream ${why}`, {
        cause,
      });
    try {
      for (;;) {
        let chunk: Awaited<ReturnType<typeof reader.read>>;
        try {
          chunk = await reader.read();
        } catch (err) {
          throw broken(deadline?.aborted ? `ran past its ${deadlineMs} ms deadline` : "ended early", err);
        }
        if (chunk.done) throw broken("ended without a result");
        let frames: ReturnType<ExecFrameDecoder["push"]>;
        try {
          frames = decoder.push(chunk.value);
        } catch (err) {
          throw broken("is malformed", err);
        }
        for (const f of frames) {
          if (f.kind === ExecFrameKind.STDOUT) await opts.onOutput("stdout", f.payload);
          else if (f.kind === ExecFrameKind.STDERR) await opts.onOutput("stderr", f.payload);
          else if (f.kind === ExecFrameKind.STARTED)
            continue; // the headers came with it (onOpen)
          else {
            const text = new TextDecoder().decode(f.payload);
            if (f.kind === ExecFrameKind.ERROR) throw errorFromAgentAnswer(500, text, `${method} ${path}`);
            const r = schema.safeParse(JSON.parse(text));
            if (!r.success) throw broken("ended with an unexpected result", r.error);
            return r.data;
          }
        }
      }
    } finally {
      reader.cancel().catch(() => undefined);
    }
  }

  async fork(vmId: VmId, count: number): Promise<CreatedVm[]> {
    const r = await this.call("POST", `/vms/${enc(vmId)}/fork`, { count }, this.t.vmOp, ForkResultSchema);
    return r.children;
  }

  suspend(vmId: VmId): Promise<SuspendResult> {
    return this.call("POST", `/vms/${enc(vmId)}/suspend`, undefined, this.t.vmOp, SuspendResultSchema);
  }

  resume(vmId: VmId): Promise<ResumeResult> {
    return this.call("POST", `/vms/${enc(vmId)}/resume`, undefined, this.t.vmOp, ResumeResultSchema);
  }

  async destroy(vmId: VmId, opts: { force: boolean }): Promise<void> {
    // A force destroy kills at once; a normal one may wait for the in-flight exec.
    const timeout = opts.force ? this.t.vmOp : this.t.destroy;
    await this.call("DELETE", `/vms/${enc(vmId)}?force=${opts.force}`, undefined, timeout, null);
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
        await this.call("PUT", `/templates/${enc(template)}/upload?${q}`, body, this.t.upload, null, {
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
    await this.call("PUT", `/templates/${enc(template)}`, oci, this.t.quick, null);
  }

  templateStatus(template: TemplateRef): Promise<TemplateBuildStatus> {
    return this.call("GET", `/templates/${enc(template)}`, undefined, this.t.quick, TemplateStatusSchema);
  }

  async deleteTemplate(template: TemplateRef): Promise<void> {
    await this.call("DELETE", `/templates/${enc(template)}`, undefined, this.t.quick, null);
  }

  async expectWidth(template: TemplateRef, width: number): Promise<void> {
    await this.call("POST", `/templates/${enc(template)}/expect`, { width }, this.t.quick, null);
  }

  async releaseTemplate(template: TemplateRef): Promise<void> {
    await this.call("POST", `/templates/${enc(template)}/release`, undefined, this.t.quick, null);
  }

  /**
   * A raw byte tunnel to a guest port: `GET /vms/{id}/tunnel?port=N` upgraded to a WebSocket
   * (tunnel-client.ts). Errors before the upgrade are the agent's codes (not_found, conflict,
   * gone, port_unreachable). The agent always carries raw bytes: a `cdp` relay's framing is the
   * gateway's business on top of them, so `_protocol` does not reach the agent.
   */
  async openTunnel(vmId: VmId, port: number, _protocol: TunnelProtocol): Promise<Tunnel> {
    const url = `${this.base.replace(/^http/, "ws")}/vms/${enc(vmId)}/tunnel?port=${port}`;
    // Opening wakes an idle-paused VM and connects inside the guest: a VM operation's deadline.
    return connectTunnel(url, await signAgentToken(this.key, this.agentId), this.t.vmOp);
  }

  /**
   * A shell on a pseudo-terminal: `GET /vms/{id}/pty?cols=&rows=` upgraded to a WebSocket, the
   * same byte tunnel as `openTunnel` whose `resize` sends a text message.
   */
  async openPty(vmId: VmId, size: { cols: number; rows: number }): Promise<PtyTunnel> {
    const url = `${this.base.replace(/^http/, "ws")}/vms/${enc(vmId)}/pty?cols=${size.cols}&rows=${size.rows}`;
    // Opening wakes an idle-paused VM and starts the shell: a VM operation's deadline.
    return connectTunnel(url, await signAgentToken(this.key, this.agentId), this.t.vmOp);
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
      return { op: "list", list: await this.call("GET", `${path}?${q}`, undefined, this.t.vmOp, FileList) };
    }
    if (call.op === "remove") {
      await this.call("DELETE", `${path}?${q}`, undefined, this.t.vmOp, null);
      return { op: "remove" };
    }
    const method = call.op === "upload" ? "PUT" : "GET";
    const url = `${this.base}${path}?${q}`;
    const deadline = AbortSignal.timeout(this.t.upload);
    let res: Response;
    try {
      res = await fetch(url, {
        method,
        headers: {
          authorization: `Bearer ${await signAgentToken(this.key, this.agentId)}`,
          ...(call.op === "upload" ? { "content-type": "application/octet-stream" } : {}),
        },
        ...(call.op === "upload" ? { body: call.body, duplex: "half" } : {}),
        signal: AbortSignal.any([call.signal, deadline]),
      } as RequestInit);
    } catch (err) {
      throw new SandboxdError("agent_unavailable", `agent ${this.base} is unreachable (${method} ${path})`, {
        cause: err,
        details: { url, timedOut: deadline.aborted },
      });
    }
    if (!res.ok || !res.body) throw errorFromAgentAnswer(res.status, await res.text(), `${method} ${path}`);
    if (call.op === "download") return { op: "download", body: res.body };
    const r = FileWritten.safeParse(await res.json().catch(() => undefined));
    if (!r.success) {
      throw new SandboxdError("internal", `agent answered ${method} ${path} with an unexpected body`, {
        cause: r.error,
      });
    }
    return { op: "upload", written: r.data };
  }

  async health(): Promise<AgentHealth> {
    const h = await this.call("GET", "/health", undefined, this.t.quick, HealthSchema);
    return { ok: h.ok, version: h.version, capacity: h.capacity };
  }

  async listVms(): Promise<VmSummary[]> {
    return (await this.call("GET", "/vms", undefined, this.t.quick, VmListSchema)).vms;
  }

  // -------------------------------------------------------------------------------------------

  private async call<T extends z.ZodType>(
    method: string,
    path: string,
    body: unknown,
    timeoutMs: number,
    schema: T,
    headers?: Record<string, string>,
  ): Promise<z.infer<T>>;
  private async call(
    method: string,
    path: string,
    body: unknown,
    timeoutMs: number,
    schema: null,
    headers?: Record<string, string>,
  ): Promise<void>;
  private async call(
    method: string,
    path: string,
    body: unknown,
    timeoutMs: number,
    schema: z.ZodType | null,
    headers: Record<string, string> = {},
  ): Promise<unknown> {
    const url = `${this.base}${path}`;
    const h: Record<string, string> = {
      authorization: `Bearer ${await signAgentToken(this.key, this.agentId)}`,
      ...headers,
    };
    let payload: RequestInit["body"];
    if (body instanceof ReadableStream) payload = body;
    else if (body !== undefined) {
      payload = JSON.stringify(body);
      h["content-type"] = "application/json";
    }
    // One deadline for the whole exchange, body included: a silent agent cannot hold us longer.
    const signal = AbortSignal.timeout(timeoutMs);
    let res: Response;
    let text: string;
    try {
      res = await fetch(url, { method, headers: h, body: payload, signal });
      text = await res.text();
    } catch (err) {
      const timedOut = signal.aborted;
      throw new SandboxdError(
        "agent_unavailable",
        timedOut
          ? `agent ${this.base} did not answer ${method} ${path} within ${timeoutMs} ms`
          : `agent ${this.base} is unreachable (${method} ${path})`,
        { cause: err, details: { url, timeoutMs, timedOut } },
      );
    }
    if (!res.ok) {
      throw errorFromAgentAnswer(res.status, text, `${method} ${path}`, res.headers.get("retry-after"));
    }
    if (schema === null) return undefined;
    let json: unknown;
    try {
      json = JSON.parse(text);
    } catch (err) {
      throw new SandboxdError("internal", `agent answered ${method} ${path} with non-JSON`, { cause: err });
    }
    const r = schema.safeParse(json);
    if (!r.success) {
      throw new SandboxdError("internal", `agent answered ${method} ${path} with an unexpected body`, {
        cause: r.error,
      });
    }
    return r.data;
  }
}

function enc(s: string): string {
  return encodeURIComponent(s);
}
