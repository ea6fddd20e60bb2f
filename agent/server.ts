/**
 * Serves the agent's HTTP API (agent/api/app.ts) for the gateway. The agent runs under Bun (it
 * drives QEMU through node:child_process and node:net, both of which Bun provides).
 */

import { AGENT_API_PREFIX } from "../contracts/agent/api.ts";
import type { AgentCredentials } from "../contracts/agent/token.ts";
import { DEFAULT_DRAIN_DELAY_MS, DEFAULT_DRAIN_TIMEOUT_MS, Drain } from "../contracts/drain.ts";
import { Metrics, metricsAnswer } from "../contracts/metrics.ts";
import {
  agentOpName,
  parseTraceparent,
  SpanKind,
  TRACEPARENT_HEADER,
  Tracer,
  withScope,
} from "../contracts/trace.ts";
import { createAgentApp } from "./api/app.ts";
import { tunnelWebSocket } from "./api/tunnel-ws.ts";
import type { SandboxManager } from "./sandbox/manager.ts";

export interface AgentServerOptions {
  manager: SandboxManager;
  /** This agent's id and key from enrollment (api/enroll.ts). */
  credentials: AgentCredentials;
  uploadDir: string;
  /** Free disk an upload leaves (`SANDBOXD_DISK_RESERVE_BYTES`); default DEFAULT_DISK_RESERVE_BYTES. */
  diskReserveBytes?: number;
  /** 127.0.0.1 when gateway and agent share a host; a private address when they do not. */
  hostname: string;
  /** 0 picks a free port. */
  port: number;
  version: string;
  log?: (msg: string) => void;
  /** Default `AGENT_IDLE_TIMEOUT_S`. */
  idleTimeoutS?: number;
  /** `SANDBOXD_METRICS_TOKEN`: `GET /metrics` answers a bearer of it; unset, there is none. */
  metricsToken?: string;
  /** `SANDBOXD_OTLP_ENDPOINT`: spans are exported there (OTLP/HTTP JSON); unset, they are not. */
  otlpEndpoint?: string;
}

export interface AgentServer {
  url: string;
  stop(): Promise<void>;
  /**
   * The graceful stop (contracts/drain.ts, SIGTERM): `/readyz` 503, the gateway's calls in flight
   * (an exec, a build's upload) waited for, then `stop()`. The VMs keep running: a restarted agent
   * re-adopts them. Answers how many calls were still running when it gave up.
   */
  drainAndStop(o?: { delayMs?: number; timeoutMs?: number }): Promise<number>;
  /** True from the start of `drainAndStop`: its heartbeats then offer no room (no new VMs). */
  readonly draining: boolean;
}

/**
 * Seconds a connection may take to send a request's headers, or stay idle between requests.
 * Once a request's headers are in, its own timeout is lifted (`server.timeout(request, 0)`): an
 * exec request is silent for as long as the command runs (up to the gateway's 600 s exec cap),
 * over Bun's 255 s cap, and the gateway's AgentHttpClient bounds every call with its own deadline.
 */
export const AGENT_IDLE_TIMEOUT_S = 30;

export function startAgentServer(opts: AgentServerOptions): AgentServer {
  const app = createAgentApp({
    manager: opts.manager,
    credentials: opts.credentials,
    uploadDir: opts.uploadDir,
    ...(opts.diskReserveBytes !== undefined ? { diskReserveBytes: opts.diskReserveBytes } : {}),
    version: opts.version,
    log: opts.log,
  });
  const drain = new Drain();
  const metrics = agentMetrics(opts.manager, drain);
  const tracer = new Tracer({
    service: "sandboxd-agent",
    ...(opts.otlpEndpoint !== undefined ? { endpoint: opts.otlpEndpoint } : {}),
    log: opts.log,
  });
  metrics.counterFrom(
    "sandboxd_agent_trace_spans_dropped_total",
    "Spans not exported (queue full, collector failing).",
    () => [{ labels: {}, value: tracer.dropped }],
  );
  /**
   * Serves one gateway call as a span of the gateway's trace (its `traceparent`), in that scope
   * (its log lines name the trace), counted and timed by operation: the path's pattern, ids left
   * out (`POST /vms/:id/exec`), so the series stay bounded.
   */
  const timed = (request: Request, answer: () => Response | Promise<Response>): Promise<Response> => {
    const t0 = performance.now();
    const path = new URL(request.url).pathname;
    const op = agentOpName(
      request.method,
      path.startsWith(AGENT_API_PREFIX) ? path.slice(AGENT_API_PREFIX.length) : path,
    );
    const parent = parseTraceparent(request.headers.get(TRACEPARENT_HEADER));
    const span = tracer.start(op, SpanKind.server, parent);
    const vm = /^\/vms\/([^/]+)/.exec(path.slice(AGENT_API_PREFIX.length))?.[1];
    return withScope({ span: span.context, ...(vm ? { sandbox: decodeURIComponent(vm) } : {}) }, async () => {
      try {
        const res = await answer();
        const labels = { op, status: String(res.status) };
        metrics.inc("sandboxd_agent_requests_total", "Agent API calls answered.", labels);
        metrics.observe(
          "sandboxd_agent_request_duration_seconds",
          "Time to the agent API's answer (its headers, for a stream): a VM operation's own time.",
          { op },
          (performance.now() - t0) / 1000,
        );
        span.end({ status: res.status });
        return res;
      } catch (err) {
        span.end({ error: err });
        throw err;
      }
    });
  };
  const server = Bun.serve({
    hostname: opts.hostname,
    port: opts.port,
    idleTimeout: opts.idleTimeoutS ?? AGENT_IDLE_TIMEOUT_S,
    // Template images are streamed to disk by the route; no whole-body buffering limit applies.
    maxRequestBodySize: Number.MAX_SAFE_INTEGER,
    fetch: (request, srv) => {
      srv.timeout(request, 0);
      // Probes first (no token: for the orchestrator), every call in flight counted for a drain.
      return (
        drain.probe(request) ??
        metricsAnswer(request, metrics, opts.metricsToken) ??
        drain.track(timed(request, () => app.fetch(request, srv)))
      );
    },
    // The only WebSocket route: GET /v1/vms/{id}/tunnel (upgraded in app.ts).
    websocket: tunnelWebSocket,
  });
  const stop = async () => {
    await server.stop(true);
    await tracer.close(); // the last calls' spans, bounded by one export's timeout
  };
  return {
    url: `http://${opts.hostname}:${server.port}`,
    stop,
    get draining() {
      return drain.isDraining;
    },
    drainAndStop: async (o = {}) => {
      const left = await drain.drain({
        delayMs: o.delayMs ?? DEFAULT_DRAIN_DELAY_MS,
        timeoutMs: o.timeoutMs ?? DEFAULT_DRAIN_TIMEOUT_MS,
      });
      await stop();
      return left;
    },
  };
}

/** The agent's gauges (docs/operations.md "Metrics"), read at each scrape. */
function agentMetrics(manager: SandboxManager, drain: Drain): Metrics {
  const m = new Metrics();
  m.gauge("sandboxd_agent_vms", "The agent's sandbox VMs by state.", () => {
    const by = new Map<string, number>();
    for (const s of manager.list()) by.set(s.state, (by.get(s.state) ?? 0) + 1);
    return [...by].map(([state, value]) => ({ labels: { state }, value }));
  });
  m.gauge("sandboxd_agent_slots_free", "VMs of the default size this host can still start.", () => [
    { labels: {}, value: manager.capacityNow().slotsFree },
  ]);
  m.gauge("sandboxd_agent_slots_total", "VM slots of this host.", () => [
    { labels: {}, value: manager.capacityNow().slotsTotal },
  ]);
  m.gauge("sandboxd_agent_requests_in_flight", "Agent API calls being answered now.", () => [
    { labels: {}, value: drain.active },
  ]);
  return m;
}
