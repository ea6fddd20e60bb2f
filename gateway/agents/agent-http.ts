/**
 * The requests of the agent's HTTP API (docs/agent-api.md), for `AgentHttpClient` (client.ts):
 * each carries a fresh short-lived JWT for that agent, signed with its own key
 * (contracts/agent/token.ts); a JSON answer is checked with the same zod schemas the agent uses;
 * an agent error comes back as the same `SandboxdError` code it had on the agent. An agent that
 * does not answer (refused, reset, or silent past the call's deadline) is a
 * `SandboxdError("agent_unavailable")`, never a hang.
 */
import type { z } from "zod";
import { AGENT_API_PREFIX, type ExecStreamOptions } from "../../contracts/agent/api.ts";
import { ExecFrameDecoder, ExecFrameKind } from "../../contracts/agent/exec-stream.ts";
import { errorFromAgentAnswer } from "../../contracts/agent/schemas.ts";
import { secretKey, signAgentToken } from "../../contracts/agent/token.ts";
import { settled } from "../../contracts/best-effort.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import type { Metrics } from "../../contracts/metrics.ts";
import {
  agentOpName,
  currentScope,
  formatTraceparent,
  SpanKind,
  TRACEPARENT_HEADER,
  type Tracer,
} from "../../contracts/trace.ts";

/** Where agent calls are counted, timed and traced (docs/operations.md "Metrics", "Tracing"). */
export interface AgentCallTelemetry {
  metrics?: Metrics;
  tracer?: Tracer;
}

export class AgentHttp {
  /** The agent's HTTP API: its base URL and `AGENT_API_PREFIX`. */
  readonly base: string;
  private readonly key: Uint8Array;
  private readonly agentId: string;
  private readonly telemetry: AgentCallTelemetry;

  constructor(opts: {
    baseUrl: string;
    agentId: string;
    key: string | Uint8Array;
    telemetry?: AgentCallTelemetry;
  }) {
    this.key = secretKey(opts.key);
    this.agentId = opts.agentId;
    this.base = `${opts.baseUrl.replace(/\/+$/, "")}${AGENT_API_PREFIX}`;
    this.telemetry = opts.telemetry ?? {};
  }

  /**
   * Runs one call to the agent as a client span of the request being served (its `traceparent`
   * header for the agent), timed and, when it fails, counted by error code. The time is to the
   * answer's headers for a streamed answer, to its whole body otherwise.
   */
  private async traced<T>(
    method: string,
    path: string,
    run: (headers: Record<string, string>) => Promise<T>,
  ) {
    const op = agentOpName(method, path);
    const scope = currentScope();
    // The request's later log lines (and its access line) name the agent it reached.
    if (scope) scope.agent = this.agentId;
    const parent = scope?.span;
    const span = this.telemetry.tracer?.start(`agent ${op}`, SpanKind.client, parent);
    span?.setAttribute("sandboxd.agent", this.agentId);
    const ctx = span?.context ?? parent;
    const t0 = performance.now();
    let code: string | undefined;
    try {
      return await run(ctx ? { [TRACEPARENT_HEADER]: formatTraceparent(ctx) } : {});
    } catch (err) {
      code = err instanceof SandboxdError ? err.code : "internal";
      span?.end({ error: err });
      throw err;
    } finally {
      span?.end();
      const m = this.telemetry.metrics;
      m?.observe(
        "sandboxd_gateway_agent_call_duration_seconds",
        "Time of the gateway's calls to agents, to the answer (its headers, for a stream).",
        { agent: this.agentId, op },
        (performance.now() - t0) / 1000,
      );
      if (code !== undefined) {
        m?.inc("sandboxd_gateway_agent_call_errors_total", "Gateway calls to agents that failed, by code.", {
          agent: this.agentId,
          op,
          code,
        });
      }
    }
  }

  /** A fresh token for one request (or one WebSocket's upgrade). */
  token(): Promise<string> {
    return signAgentToken(this.key, this.agentId);
  }

  /** The WebSocket URL of `path` (a tunnel, a terminal). */
  wsUrl(path: string): string {
    return `${this.base.replace(/^http/, "ws")}${path}`;
  }

  /**
   * A request whose answer's body is handed over unread (a streamed exec, a file transfer):
   * unreachable is `agent_unavailable` (`timedOut` when `deadline` fired), an error status the
   * agent's error.
   */
  async open(
    method: string,
    path: string,
    init: {
      /** The query string, left out of the errors' wording. */
      search?: string;
      headers?: Record<string, string>;
      body?: RequestInit["body"];
      duplex?: "half";
    },
    signal: AbortSignal,
    deadline: AbortSignal | undefined,
  ): Promise<Response & { body: ReadableStream<Uint8Array> }> {
    const { search, ...rest } = init;
    const url = `${this.base}${path}${search === undefined ? "" : `?${search}`}`;
    return this.traced(method, path, async (trace) => {
      const headers = { authorization: `Bearer ${await this.token()}`, ...trace, ...rest.headers };
      let res: Response;
      try {
        res = await fetch(url, { ...rest, method, headers, signal } as RequestInit);
      } catch (err) {
        throw new SandboxdError(
          "agent_unavailable",
          `agent ${this.base} is unreachable (${method} ${path})`,
          {
            cause: err,
            details: { url, timedOut: deadline?.aborted ?? false },
          },
        );
      }
      if (!res.ok || !res.body) throw errorFromAgentAnswer(res.status, await res.text(), `${method} ${path}`);
      return res as Response & { body: ReadableStream<Uint8Array> };
    });
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
  async frames<T extends z.ZodType>(
    method: string,
    path: string,
    body: unknown,
    deadlineMs: number | undefined,
    opts: ExecStreamOptions,
    schema: T,
  ): Promise<z.infer<T>> {
    const deadline = deadlineMs === undefined ? undefined : AbortSignal.timeout(deadlineMs);
    const res = await this.open(
      method,
      path,
      body === undefined
        ? {}
        : { headers: { "content-type": "application/json" }, body: JSON.stringify(body) },
      deadline ? AbortSignal.any([opts.signal, deadline]) : opts.signal,
      deadline,
    );
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
      void settled(reader.cancel()); // the frames' own end or error is what the caller sees
    }
  }

  async call<T extends z.ZodType>(
    method: string,
    path: string,
    body: unknown,
    timeoutMs: number,
    schema: T,
    headers?: Record<string, string>,
  ): Promise<z.infer<T>>;
  async call(
    method: string,
    path: string,
    body: unknown,
    timeoutMs: number,
    schema: null,
    headers?: Record<string, string>,
  ): Promise<void>;
  async call(
    method: string,
    path: string,
    body: unknown,
    timeoutMs: number,
    schema: z.ZodType | null,
    headers: Record<string, string> = {},
  ): Promise<unknown> {
    return this.traced(method, path, async (trace) => {
      const url = `${this.base}${path}`;
      const h: Record<string, string> = {
        authorization: `Bearer ${await this.token()}`,
        ...trace,
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
    });
  }
}
