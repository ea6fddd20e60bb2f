/**
 * Operator metrics (contracts/metrics.ts, docs/operations.md "Metrics"): a real routing gateway
 * (PGlite) and a real agent HTTP server enrolled at it, each with a metrics token. A scrape
 * without the token, or with another, is 401; with it, the Prometheus text: the gateway's
 * requests by route pattern (never a path with ids) and status with their duration histogram,
 * requests in flight, the database up, and per agent its heartbeat age, liveness and slots; the
 * agent's calls and its slots. A gateway without a token has no /metrics.
 */
import { afterEach, expect, test } from "bun:test";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { SandboxManager } from "../../agent/sandbox/manager.ts";
import type { LogFields } from "../../contracts/log.ts";
import { Metrics } from "../../contracts/metrics.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { templates } from "../../db/schema/templates.ts";
import { createKey, ensureTenant } from "../../gateway/auth/keys.ts";
import { startGateway } from "../../gateway/server.ts";
import { inertDriver, startEnrolledAgent } from "../support/agents.ts";
import { tempStateDir } from "../support/real-vm.ts";
import { until } from "../support/until.ts";

const SECRET = "metrics-test-agent-secret-0123456789abcdef";
const TOKEN = "scrape-token-0123456789";
/** A PGlite gateway migrating and an enrollment on a loaded host. */
const TEST_TIMEOUT_MS = 60_000;
const cleanups: Array<() => Promise<void>> = [];
const logs: Array<{ line: string; fields: LogFields | undefined }> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

/** A real routing gateway (PGlite) and a real agent server enrolled at it, both scraped with TOKEN. */
async function gatewayAndAgent(id: string, otlpEndpoint?: string) {
  const dir = await mkdtemp(join(tmpdir(), "sbx-metrics-gw-"));
  const gw = await startGateway({
    dataDir: dir,
    port: 0,
    agentSecret: SECRET,
    metricsToken: TOKEN,
    ...(otlpEndpoint ? { otlpEndpoint } : {}),
    config: { region: "eu", version: "test" },
    log: (line, fields) => logs.push({ line, fields }),
  });
  cleanups.push(async () => {
    await gw.stop();
    await rm(dir, { recursive: true, force: true });
  });
  const stateDir = await tempStateDir();
  const manager = await SandboxManager.open({ driver: inertDriver(), stateDir, capacity: { slots: 3 } });
  const a = await startEnrolledAgent({
    gw,
    agentSecret: SECRET,
    manager,
    stateDir,
    id,
    region: "eu",
    intervalMs: 200,
    metricsToken: TOKEN,
    ...(otlpEndpoint ? { otlpEndpoint } : {}),
  });
  cleanups.push(async () => {
    a.hb.stop();
    await a.server.stop();
    await manager.detach();
    await rm(stateDir, { recursive: true, force: true });
  });
  return { gw, a };
}

const scrape = (url: string, token?: string) =>
  fetch(`${url}/metrics`, token ? { headers: { authorization: `Bearer ${token}` } } : {});

test(
  "gateway and agent answer a scrape with the token only, in the Prometheus text format",
  async () => {
    const { gw, a } = await gatewayAndAgent("metrics-agent");
    await a.hb.first;
    expect((await fetch(`${gw.url}/v1/health`)).status).toBeLessThan(600);
    await fetch(`${gw.url}/v1/sandboxes/sbx_abc/exec`, { method: "POST" }); // 401: no key
    await fetch(`${a.server.url}/v1/vms`); // 401: no gateway token

    for (const url of [gw.url, a.server.url]) {
      expect((await scrape(url)).status).toBe(401);
      expect((await scrape(url, "not-the-token")).status).toBe(401);
    }
    const res = await scrape(gw.url, TOKEN);
    expect(res.status).toBe(200);
    expect(res.headers.get("content-type")).toContain("text/plain");
    const text = await res.text();
    expect(text).toContain("# TYPE sandboxd_gateway_requests_total counter");
    expect(text).toMatch(
      /sandboxd_gateway_requests_total\{method="GET",route="\/v1\/health",status="\d+"\} 1/,
    );
    // The route pattern, never the path with its id.
    expect(text).not.toContain("sbx_abc");
    expect(text).toMatch(
      /sandboxd_gateway_request_duration_seconds_bucket\{method="GET",route="\/v1\/health",le="\+Inf"\} 1/,
    );
    expect(text).toContain("sandboxd_gateway_database_up 1");
    expect(text).toMatch(/sandboxd_gateway_agent_live\{agent="metrics-agent",region="eu"\} 1/);
    expect(text).toMatch(/sandboxd_gateway_agent_slots_total\{agent="metrics-agent",region="eu"\} 3/);
    expect(text).toMatch(
      /sandboxd_gateway_agent_heartbeat_age_seconds\{agent="metrics-agent",region="eu"\} [0-9.]+/,
    );
    console.log(
      `GATEWAY_SCRAPE\n${text
        .split("\n")
        .filter((l) => !l.includes("_bucket"))
        .join("\n")}`,
    );

    const agentText = await (await scrape(a.server.url, TOKEN)).text();
    expect(agentText).toContain("sandboxd_agent_slots_total 3");
    // A scrape is not a call: the one counted 401 is the call without a token.
    expect(agentText).toMatch(/sandboxd_agent_requests_total\{op="GET \/vms",status="401"\} 1/);
    console.log(
      `AGENT_SCRAPE\n${agentText
        .split("\n")
        .filter((l) => !l.includes("_bucket"))
        .join("\n")}`,
    );
  },
  TEST_TIMEOUT_MS,
);

test("label values are escaped; a metric keeps a bounded number of label sets", async () => {
  const m = new Metrics();
  m.inc("x_total", "x", { route: 'a"b\\c\nd' });
  for (let i = 0; i < 2_100; i++) m.inc("y_total", "y", { route: `/r${i}` });
  const text = await m.render();
  expect(text).toContain('x_total{route="a\\"b\\\\c\\nd"} 1');
  const ys = text.split("\n").filter((l) => l.startsWith("y_total{"));
  expect(ys.length).toBe(2_001);
  expect(text).toContain('y_total{route="other"} 100');
});

// biome-ignore lint/suspicious/noExplicitAny: OTLP/JSON bodies are read field by field
type Otlp = any;

test(
  "a request's trace crosses from the gateway to the agent; both export their spans over OTLP; agent calls and placements are counted",
  async () => {
    const bodies: Otlp[] = [];
    const collector = Bun.serve({
      hostname: "127.0.0.1",
      port: 0,
      fetch: async (req) => {
        if (new URL(req.url).pathname !== "/v1/traces") return new Response("no", { status: 404 });
        bodies.push(await req.json());
        return Response.json({});
      },
    });
    cleanups.push(async () => {
      await collector.stop(true);
    });
    const { gw, a } = await gatewayAndAgent("trace-agent", `http://127.0.0.1:${collector.port}`);
    await a.hb.first;
    const sandbox = "sbx_traced0000000000001";
    const key = await gw.withDb(async (db) => {
      const k = (await createKey(db, gw.config.keyPepper, { tenant: "traceco", tier: "pro" })).key;
      const tenantId = await ensureTenant(db, "traceco");
      await db
        .insert(templates)
        .values({ pk: "tpl_tr", id: "tr", api: "sandboxes", agentRef: "tr", name: "tr", status: "ready" })
        .onConflictDoNothing();
      await db.insert(sandboxes).values({
        id: sandbox,
        tenantId,
        api: "sandboxes",
        kind: "sandbox",
        templatePk: "tpl_tr",
        templateId: "tr",
        agentId: "trace-agent",
        vmId: "vm-traced",
        state: "running",
        createdAt: new Date(),
      });
      return k;
    });
    const traceId = "4bf92f3577b34da6a3ce929d0e0e4736";
    const clientSpan = "00f067aa0ba902b7";
    const res = await fetch(`${gw.url}/v1/sandboxes/${sandbox}/exec`, {
      method: "POST",
      headers: {
        authorization: `Bearer ${key}`,
        "content-type": "application/json",
        traceparent: `00-${traceId}-${clientSpan}-01`,
      },
      body: JSON.stringify({ command: "true" }),
    });
    // The inert agent holds no VM: its answer, whatever the gateway makes of it, ends the call.
    expect(res.status).toBeGreaterThanOrEqual(400);
    // Where a placement is asked for and none is possible, it is counted with its code.
    const create = await fetch(`${gw.url}/v1/sandboxes`, {
      method: "POST",
      headers: { authorization: `Bearer ${key}`, "content-type": "application/json" },
      body: JSON.stringify({ template: "tr" }),
    });
    expect(create.status).toBeGreaterThanOrEqual(400);

    // The access line names the client's trace.
    const access = logs.filter((l) => l.fields?.kind === "access" && l.fields.sandbox === sandbox);
    expect(access.at(-1)?.fields).toMatchObject({ trace_id: traceId, agent: "trace-agent", sandbox });

    const text = await (await scrape(gw.url, TOKEN)).text();
    expect(text).toMatch(
      /sandboxd_gateway_agent_call_duration_seconds_count\{agent="trace-agent",op="POST \/vms\/:id\/exec"\} 1/,
    );
    expect(text).toMatch(
      /sandboxd_gateway_agent_call_errors_total\{agent="trace-agent",op="POST \/vms\/:id\/exec",code="[a-z_]+"\} 1/,
    );
    expect(text).toMatch(/sandboxd_gateway_placements_total\{region="eu",outcome="[a-z_]+"\} 1/);
    expect(text).toContain("sandboxd_gateway_database_listen_up 1");
    expect(text).toContain("# TYPE sandboxd_gateway_trace_spans_dropped_total counter");
    const agentText = await (await scrape(a.server.url, TOKEN)).text();
    expect(agentText).toMatch(
      /sandboxd_agent_request_duration_seconds_count\{op="POST \/vms\/:id\/exec"\} 1/,
    );

    // Spans are sent within a flush interval (5 s); the stops below would flush them too.
    const spans = () =>
      bodies.flatMap((b: Otlp) =>
        b.resourceSpans.flatMap((r: Otlp) =>
          r.scopeSpans.flatMap((ss: Otlp) =>
            ss.spans.map((sp: Otlp) => ({ ...sp, service: r.resource.attributes[0].value.stringValue })),
          ),
        ),
      );
    const mine = () => spans().filter((sp: Otlp) => sp.traceId === traceId);
    await until(() => mine().length >= 3, 15_000);
    const server = mine().find((sp: Otlp) => sp.service === "sandboxd-gateway" && sp.kind === 2);
    const call = mine().find((sp: Otlp) => sp.service === "sandboxd-gateway" && sp.kind === 3);
    const onAgent = mine().find((sp: Otlp) => sp.service === "sandboxd-agent");
    expect(server).toMatchObject({ name: "POST /v1/sandboxes/:id/exec", parentSpanId: clientSpan });
    expect(call).toMatchObject({ name: "agent POST /vms/:id/exec", parentSpanId: server.spanId });
    expect(onAgent).toMatchObject({ name: "POST /vms/:id/exec", kind: 2, parentSpanId: call.spanId });
    expect(BigInt(call.endTimeUnixNano)).toBeGreaterThanOrEqual(BigInt(call.startTimeUnixNano));
    process.stdout.write(
      `${JSON.stringify({ otlp_spans: mine().map((sp: Otlp) => [sp.service, sp.name, sp.spanId, sp.parentSpanId ?? null]) })}\n`,
    );
  },
  TEST_TIMEOUT_MS,
);
