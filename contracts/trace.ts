/**
 * Trace context and spans (docs/operations.md "Tracing"). Each public request is a trace: the
 * client's W3C `traceparent` when it sends a valid one, else a new trace. The gateway's span of
 * the request is the parent of one span per agent call, and each agent call carries
 * `traceparent` naming that span, so the agent's span of the call joins the same trace. Spans are
 * exported over OTLP/HTTP (JSON, `POST <endpoint>/v1/traces`) only when an endpoint is set;
 * without one, trace ids still name log lines so that one request's lines can be found on the
 * gateway and on its agent.
 *
 * The scope of a request (its id, trace, tenant, sandbox) is held in an AsyncLocalStorage: code
 * that logs or calls an agent on the request's behalf finds it without being handed it, so the
 * core's signatures stay free of HTTP.
 */
import { AsyncLocalStorage } from "node:async_hooks";
import { randomBytes } from "node:crypto";
import { describeError } from "./errors.ts";

/** One span's place in a trace: ids as lowercase hex, `sampled` the W3C flag's bit 0. */
export interface SpanContext {
  traceId: string;
  spanId: string;
  sampled: boolean;
}

/** What log lines and agent calls made while serving one request know of it. */
export interface RequestScope {
  requestId?: string;
  span?: SpanContext;
  tenant?: string;
  sandbox?: string;
  agent?: string;
}

const scopes = new AsyncLocalStorage<RequestScope>();

/** The scope of the request being served here, if any. */
export function currentScope(): RequestScope | undefined {
  return scopes.getStore();
}

/** Runs `fn` in `scope`: what it logs and calls names that request. */
export function withScope<T>(scope: RequestScope, fn: () => T): T {
  return scopes.run(scope, fn);
}

export const TRACEPARENT_HEADER = "traceparent";
const TRACEPARENT = /^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$/;
const ALL_ZERO = /^0+$/;

/**
 * A `traceparent` header's context, or undefined for anything else (another version, ids of all
 * zeros, upper case: the W3C text says to ignore such a header and start a new trace).
 */
export function parseTraceparent(header: string | null | undefined): SpanContext | undefined {
  const m = header === null || header === undefined ? null : TRACEPARENT.exec(header.trim());
  if (!m || ALL_ZERO.test(m[1]!) || ALL_ZERO.test(m[2]!)) return undefined;
  return { traceId: m[1]!, spanId: m[2]!, sampled: (Number.parseInt(m[3]!, 16) & 1) === 1 };
}

export function formatTraceparent(s: SpanContext): string {
  return `00-${s.traceId}-${s.spanId}-${s.sampled ? "01" : "00"}`;
}

const newSpanId = () => randomBytes(8).toString("hex");
const newTraceId = () => randomBytes(16).toString("hex");

type AttrValue = string | number | boolean;

/** OTLP span kinds (the protobuf enum's numbers, as OTLP/JSON writes them). */
export const SpanKind = { internal: 1, server: 2, client: 3 } as const;

/** A span being timed; `end` records it (once) for export. */
export interface Span {
  readonly context: SpanContext;
  setAttribute(key: string, value: AttrValue | undefined): void;
  /** Renames it (a server span learns its route pattern only once routed). */
  updateName(name: string): void;
  end(opts?: { error?: unknown; status?: number }): void;
}

interface FinishedSpan {
  context: SpanContext;
  parentSpanId?: string;
  name: string;
  kind: number;
  startNs: bigint;
  endNs: bigint;
  attributes: Record<string, AttrValue>;
  error?: string;
}

/**
 * Bounds of the export. A collector that is down or slow must cost the service nothing but the
 * spans: at most QUEUE_MAX wait (a few MiB), the oldest dropped and counted past it; a batch goes
 * when BATCH_MAX are waiting or FLUSH_MS after the first, and one POST may take EXPORT_TIMEOUT_MS.
 */
const QUEUE_MAX = 2_048;
const BATCH_MAX = 512;
const FLUSH_MS = 5_000;
const EXPORT_TIMEOUT_MS = 10_000;

/** Wall clock in ns: performance.timeOrigin + now() keeps sub-ms order within the process. */
function nowNs(): bigint {
  return BigInt(Math.round((performance.timeOrigin + performance.now()) * 1000)) * 1000n;
}

export class Tracer {
  private queue: FinishedSpan[] = [];
  private timer: ReturnType<typeof setTimeout> | undefined;
  private sending: Promise<void> | undefined;
  /** Spans dropped (queue full, or a POST that failed): a metric, and a log line per failure. */
  dropped = 0;
  exported = 0;

  constructor(
    private readonly opts: {
      /** `service.name` of the spans' resource: `sandboxd-gateway`, `sandboxd-agent`. */
      service: string;
      /** The OTLP/HTTP base URL; undefined: spans are made (ids for logs) but not exported. */
      endpoint?: string;
      log?: (line: string) => void;
      fetch?: typeof fetch;
    },
  ) {}

  get exporting(): boolean {
    return this.opts.endpoint !== undefined;
  }

  /**
   * Starts a span: a child of `parent` when given (another process's span from `traceparent`, or
   * this request's), else the root of a new trace.
   */
  start(name: string, kind: number, parent?: SpanContext): Span {
    const context: SpanContext = {
      traceId: parent?.traceId ?? newTraceId(),
      spanId: newSpanId(),
      sampled: parent?.sampled ?? true,
    };
    const startNs = nowNs();
    const attributes: Record<string, AttrValue> = {};
    let ended = false;
    let spanName = name;
    return {
      context,
      updateName: (n) => {
        spanName = n;
      },
      setAttribute: (k, v) => {
        if (v !== undefined) attributes[k] = v;
      },
      end: (o = {}) => {
        if (ended) return;
        ended = true;
        if (o.status !== undefined) attributes["http.response.status_code"] = o.status;
        if (!this.exporting || !context.sampled) return;
        this.push({
          context,
          ...(parent ? { parentSpanId: parent.spanId } : {}),
          name: spanName,
          kind,
          startNs,
          endNs: nowNs(),
          attributes,
          ...(o.error !== undefined
            ? { error: describeError(o.error) }
            : o.status !== undefined && o.status >= 500
              ? { error: `status ${o.status}` }
              : {}),
        });
      },
    };
  }

  private push(s: FinishedSpan): void {
    if (this.queue.length >= QUEUE_MAX) {
      this.queue.shift();
      this.dropped++;
    }
    this.queue.push(s);
    if (this.queue.length >= BATCH_MAX) void this.flush();
    else if (this.timer === undefined) {
      this.timer = setTimeout(() => void this.flush(), FLUSH_MS);
      this.timer.unref?.(); // a pending export never keeps the process alive
    }
  }

  /** Sends what waits (one POST at a time); resolves when it is sent or given up. */
  async flush(): Promise<void> {
    clearTimeout(this.timer);
    this.timer = undefined;
    while (this.sending) await this.sending;
    if (this.queue.length === 0 || this.opts.endpoint === undefined) return;
    const batch = this.queue.splice(0, BATCH_MAX);
    this.sending = this.send(batch).finally(() => {
      this.sending = undefined;
    });
    await this.sending;
    if (this.queue.length > 0) await this.flush();
  }

  /**
   * At a process's stop: what waits goes out, for at most one export's timeout in all (a
   * collector that is down must not hold a stop that an orchestrator is timing).
   */
  async close(): Promise<void> {
    let timer: ReturnType<typeof setTimeout> | undefined;
    await Promise.race([
      this.flush(),
      new Promise<void>((r) => {
        timer = setTimeout(r, EXPORT_TIMEOUT_MS);
      }),
    ]);
    clearTimeout(timer);
  }

  private async send(batch: FinishedSpan[]): Promise<void> {
    const url = `${this.opts.endpoint!.replace(/\/+$/, "")}/v1/traces`;
    let why: string;
    try {
      const res = await (this.opts.fetch ?? fetch)(url, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify(otlpBody(this.opts.service, batch)),
        signal: AbortSignal.timeout(EXPORT_TIMEOUT_MS),
      });
      await res.body?.cancel();
      if (res.ok) {
        this.exported += batch.length;
        return;
      }
      why = `the collector answered ${res.status}`;
    } catch (err) {
      why = describeError(err);
    }
    this.dropped += batch.length;
    this.opts.log?.(`tracing: export of ${batch.length} spans to ${url} failed: ${why}`);
  }
}

/** The OTLP/JSON `ExportTraceServiceRequest` of `spans` (ids hex, times as decimal strings). */
function otlpBody(service: string, spans: FinishedSpan[]): unknown {
  const attr = (key: string, v: AttrValue) => ({
    key,
    value:
      typeof v === "string"
        ? { stringValue: v }
        : typeof v === "boolean"
          ? { boolValue: v }
          : Number.isInteger(v)
            ? { intValue: String(v) }
            : { doubleValue: v },
  });
  return {
    resourceSpans: [
      {
        resource: { attributes: [attr("service.name", service)] },
        scopeSpans: [
          {
            scope: { name: "sandboxd" },
            spans: spans.map((s) => ({
              traceId: s.context.traceId,
              spanId: s.context.spanId,
              ...(s.parentSpanId ? { parentSpanId: s.parentSpanId } : {}),
              name: s.name,
              kind: s.kind,
              startTimeUnixNano: String(s.startNs),
              endTimeUnixNano: String(s.endNs),
              attributes: Object.entries(s.attributes).map(([k, v]) => attr(k, v)),
              // STATUS_CODE_ERROR = 2; unset (0) otherwise.
              status: s.error !== undefined ? { code: 2, message: s.error.slice(0, 512) } : { code: 0 },
            })),
          },
        ],
      },
    ],
  };
}

/**
 * A stable, bounded name for an agent API path: ids of VMs, templates and processes become `:id`
 * (`/vms/:id/exec`), the query is left out. Metric labels and span names use it.
 */
export function agentOpName(method: string, path: string): string {
  const parts = path.split("?")[0]!.split("/");
  const named = parts.map((seg, i) =>
    i > 0 && ["vms", "templates", "processes", "sessions"].includes(parts[i - 1]!) && seg !== ""
      ? ":id"
      : seg,
  );
  return `${method} ${named.join("/")}`;
}
