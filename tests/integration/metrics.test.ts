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
import { Metrics } from "../../contracts/metrics.ts";
import { startGateway } from "../../gateway/server.ts";
import { inertDriver, startEnrolledAgent } from "../support/agents.ts";
import { tempStateDir } from "../support/real-vm.ts";

const SECRET = "metrics-test-agent-secret-0123456789abcdef";
const TOKEN = "scrape-token-0123456789";
/** A PGlite gateway migrating and an enrollment on a loaded host. */
const TEST_TIMEOUT_MS = 60_000;
const cleanups: Array<() => Promise<void>> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

const scrape = (url: string, token?: string) =>
  fetch(`${url}/metrics`, token ? { headers: { authorization: `Bearer ${token}` } } : {});

test(
  "gateway and agent answer a scrape with the token only, in the Prometheus text format",
  async () => {
    const dir = await mkdtemp(join(tmpdir(), "sbx-metrics-gw-"));
    const gw = await startGateway({
      dataDir: dir,
      port: 0,
      agentSecret: SECRET,
      metricsToken: TOKEN,
      config: { region: "eu", version: "test" },
      log: () => {},
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
      id: "metrics-agent",
      region: "eu",
      intervalMs: 200,
      metricsToken: TOKEN,
    });
    cleanups.push(async () => {
      a.hb.stop();
      await a.server.stop();
      await manager.detach();
      await rm(stateDir, { recursive: true, force: true });
    });
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
    expect(agentText).toMatch(/sandboxd_agent_requests_total\{method="GET",status="401"\} 1/);
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
