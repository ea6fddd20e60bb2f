/**
 * Each public request's id and its access line (docs/operations.md "Logs"). The id is the
 * client's `x-request-id` when it is a plain token (at most 128 of `A-Za-z0-9._-`), else a new
 * one; it is answered in `x-request-id` and named by the request's log lines. After the answer,
 * one access line (`kind: "access"`, JSON logs only) says method, path, status, duration, tenant,
 * sandbox and the agent it reached, never the query string (a connect token may be in it) or a header.
 *
 * The request is a span of the client's trace when it sent a valid `traceparent`, else of a new
 * one (contracts/trace.ts); what is logged and called while serving it runs in its scope, so its
 * log lines carry `request_id` and `trace_id` and its agent calls carry the trace on.
 */
import { randomBytes } from "node:crypto";
import type { MiddlewareHandler } from "hono";
import type { LogFn } from "../contracts/log.ts";
import type { Metrics } from "../contracts/metrics.ts";
import {
  parseTraceparent,
  type RequestScope,
  SpanKind,
  TRACEPARENT_HEADER,
  type Tracer,
  withScope,
} from "../contracts/trace.ts";
import type { HonoEnv } from "./deps.ts";

export const REQUEST_ID_HEADER = "x-request-id";
const CLIENT_ID = /^[A-Za-z0-9._-]{1,128}$/;

/** The sandbox a path names (`/v1/sandboxes/<id>...`, `/v1/sessions/<id>...`), for the access line. */
function sandboxOf(path: string): string | undefined {
  return /^\/v1\/(?:sandboxes|sessions)\/([A-Za-z0-9_-]{1,64})(?:\/|$)/.exec(path)?.[1];
}

export function requestContext(log: LogFn, metrics?: Metrics, tracer?: Tracer): MiddlewareHandler<HonoEnv> {
  return async (c, next) => {
    const given = c.req.header(REQUEST_ID_HEADER);
    const id = given !== undefined && CLIENT_ID.test(given) ? given : randomBytes(8).toString("hex");
    c.set("requestId", id);
    const t0 = performance.now();
    const parent = parseTraceparent(c.req.header(TRACEPARENT_HEADER));
    const span = tracer?.start(`${c.req.method} ${c.req.path}`, SpanKind.server, parent);
    const scope: RequestScope = { requestId: id, sandbox: sandboxOf(c.req.path) };
    const traced = span?.context ?? parent;
    if (traced) scope.span = traced;
    try {
      await withScope(scope, next);
    } catch (err) {
      span?.end({ error: err });
      throw err;
    }
    // An upgraded WebSocket's 101 is the runtime's: its headers are no longer ours to set.
    if (c.res.status !== 101) c.res.headers.set(REQUEST_ID_HEADER, id);
    const ms = Math.round((performance.now() - t0) * 10) / 10;
    // By route pattern (`/v1/sandboxes/:id/exec`), never the path: the series stay bounded.
    const route = c.req.routePath;
    // Named by its route once matched: the span's name stays bounded like the metric's labels.
    span?.updateName(`${c.req.method} ${route}`);
    span?.setAttribute("http.route", route);
    span?.setAttribute("sandboxd.request_id", id);
    span?.setAttribute("sandboxd.tenant", c.get("principal")?.tenantId);
    span?.end({ status: c.res.status });
    const labels = { method: c.req.method, route, status: String(c.res.status) };
    metrics?.inc("sandboxd_gateway_requests_total", "Public API requests answered.", labels);
    metrics?.observe(
      "sandboxd_gateway_request_duration_seconds",
      "Time to the public API's answer (its headers, for a stream).",
      { method: c.req.method, route },
      (performance.now() - t0) / 1000,
    );
    log(`${c.req.method} ${c.req.path} ${c.res.status} ${ms} ms`, {
      kind: "access",
      request_id: id,
      method: c.req.method,
      path: c.req.path,
      status: c.res.status,
      ms,
      tenant: c.get("principal")?.tenantId,
      sandbox: scope.sandbox,
      agent: scope.agent,
      trace_id: scope.span?.traceId,
    });
  };
}
