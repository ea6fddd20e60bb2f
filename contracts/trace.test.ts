/**
 * Trace context (contracts/trace.ts): hostile `traceparent` headers start a new trace instead of
 * joining one; a collector that fails or is slow costs spans, counted, never the service; a line
 * logged while a request is served names it.
 */
import { expect, test } from "bun:test";
import { withRequestFields } from "./log.ts";
import { agentOpName, formatTraceparent, parseTraceparent, SpanKind, Tracer, withScope } from "./trace.ts";

test("only a well-formed version-00 traceparent is taken", () => {
  const good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
  expect(parseTraceparent(good)).toEqual({
    traceId: "4bf92f3577b34da6a3ce929d0e0e4736",
    spanId: "00f067aa0ba902b7",
    sampled: true,
  });
  expect(formatTraceparent(parseTraceparent(good)!)).toBe(good);
  expect(parseTraceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00")?.sampled).toBe(false);
  for (const bad of [
    undefined,
    "",
    "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", // another version
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01", // all-zero trace
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", // all-zero span
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", // upper case
    "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", // short
    `00-${"a".repeat(10_000)}-00f067aa0ba902b7-01`,
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\nx",
  ]) {
    expect(parseTraceparent(bad)).toBeUndefined();
  }
});

test("a span is a child of its parent's trace; without one it starts a trace", () => {
  const t = new Tracer({ service: "t" });
  const root = t.start("a", SpanKind.server);
  expect(root.context.traceId).toMatch(/^[0-9a-f]{32}$/);
  const child = t.start("b", SpanKind.client, root.context);
  expect(child.context.traceId).toBe(root.context.traceId);
  expect(child.context.spanId).not.toBe(root.context.spanId);
});

test("agent operations are named without their ids", () => {
  expect(agentOpName("POST", "/vms/vm-abc/exec?stream=1")).toBe("POST /vms/:id/exec");
  expect(agentOpName("GET", "/vms/vm-1/processes/42/logs")).toBe("GET /vms/:id/processes/:id/logs");
  expect(agentOpName("PUT", "/templates/t1/copy")).toBe("PUT /templates/:id/copy");
  expect(agentOpName("GET", "/health")).toBe("GET /health");
});

test("a failing collector loses the batch, counted and logged; a full queue drops the oldest", async () => {
  const lines: string[] = [];
  let posts = 0;
  const t = new Tracer({
    service: "t",
    endpoint: "http://collector.invalid:4318",
    log: (l) => lines.push(l),
    fetch: (async () => {
      posts++;
      return new Response("down", { status: 503 });
    }) as unknown as typeof fetch,
  });
  for (let i = 0; i < 3; i++) t.start(`s${i}`, SpanKind.internal).end();
  await t.flush();
  expect([posts, t.dropped, t.exported]).toEqual([1, 3, 0]);
  expect(lines[0]).toContain("export of 3 spans to http://collector.invalid:4318/v1/traces failed");

  // No collector answering at all: spans beyond the queue's 2,048 are dropped, oldest first.
  let held = 0;
  const stuck = new Tracer({
    service: "t",
    endpoint: "http://collector.invalid:4318",
    fetch: (() => {
      held++;
      return new Promise<Response>(() => {});
    }) as unknown as typeof fetch,
  });
  for (let i = 0; i < 5_000; i++) stuck.start("s", SpanKind.internal).end();
  // Batches of 512 went to the one stuck POST; the rest waits, bounded.
  expect(held).toBe(1);
  expect(stuck.dropped).toBeGreaterThan(0);
  expect(5_000 - stuck.dropped).toBeLessThanOrEqual(2_048 + 512);
});

test("an unsampled trace is carried on but not exported", async () => {
  let posts = 0;
  const t = new Tracer({
    service: "t",
    endpoint: "http://collector.invalid:4318",
    fetch: (async () => {
      posts++;
      return Response.json({});
    }) as unknown as typeof fetch,
  });
  const parent = parseTraceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00")!;
  const s = t.start("x", SpanKind.server, parent);
  expect(formatTraceparent(s.context)).toEndWith("-00");
  s.end();
  await t.flush();
  expect(posts).toBe(0);
});

test("a line logged while a request is served names it; fields the writer gives win", () => {
  expect(withRequestFields({ a: 1 })).toEqual({ a: 1 });
  const span = { traceId: "4bf92f3577b34da6a3ce929d0e0e4736", spanId: "00f067aa0ba902b7", sampled: true };
  const fields = withScope({ requestId: "r1", span, tenant: "ten_a" }, () =>
    withRequestFields({ sandbox: "sbx_1", tenant: undefined }),
  );
  expect(fields).toMatchObject({
    request_id: "r1",
    trace_id: span.traceId,
    tenant: "ten_a",
    sandbox: "sbx_1",
  });
});
