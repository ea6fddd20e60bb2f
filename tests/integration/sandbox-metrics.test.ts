/**
 * `GET /v1/sandboxes/{id}/metrics` through the gateway (docs/metrics.md): the owner's sandbox
 * only (another tenant's and an unknown id are 404 and the agent is never asked), a sessions API
 * key is refused, a suspended sandbox answers `suspended` without being resumed, and every answer
 * is checked against openapi.yaml by the harness. Real PGlite; the host agent is the in-memory
 * stand-in (its one made-up sample); the figures themselves come from a real VM in
 * tests/vm/live-metrics.test.ts.
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { parse } from "yaml";
import { OPENAPI_PATH } from "../../gateway/openapi.ts";
import { type Harness, makeHarness } from "../support/gateway-harness.ts";

let h: Harness;
let pro: string;
let otherPro: string;
let live: string;

beforeAll(async () => {
  h = await makeHarness();
  pro = await h.key("acme", "pro");
  otherPro = await h.key("globex", "pro");
  live = await h.key("acme", "live");
});
afterAll(() => h.close());

// biome-ignore lint/suspicious/noExplicitAny: response bodies are checked field by field
type Body = Record<string, any>;

async function create(key: string): Promise<string> {
  const res = await h.req("POST", "/v1/sandboxes", { key, json: { template: "python" } });
  expect(res.status).toBe(201);
  return ((await res.json()) as Body).id;
}

test("the owner reads its sandbox's samples; the answer is the agent's, in the public form", async () => {
  const id = await create(pro);
  const res = await h.req("GET", `/v1/sandboxes/${id}/metrics`, { key: pro });
  expect(res.status).toBe(200);
  const b = (await res.json()) as Body;
  expect(b.id).toBe(id);
  expect(b.state).toBe("running");
  expect(b.interval_s).toBe(2);
  expect(b.vcpus).toBe(2);
  expect(b.memory_limit_bytes).toBe(512 * 1024 * 1024);
  expect(b.samples).toHaveLength(1);
  expect(b.current).toEqual(b.samples[0]);
  expect(b.current).toEqual({
    at: new Date(1_700_000_000_000).toISOString(),
    cpu_percent: 12.5,
    memory_used_bytes: 1 << 24,
    memory_resident_bytes: 1 << 25,
    disk_used_bytes: 1 << 20,
  });
});

test("another tenant's sandbox and an unknown id are 404, and the agent is not asked", async () => {
  const id = await create(pro);
  const before = h.agent.calls.filter((c) => c.startsWith("metrics")).length;
  const other = await h.req("GET", `/v1/sandboxes/${id}/metrics`, { key: otherPro });
  expect(other.status).toBe(404);
  expect(((await other.json()) as Body).code).toBe("not_found");
  const unknown = await h.req("GET", "/v1/sandboxes/sbx_doesnotexist0000/metrics", { key: pro });
  expect(unknown.status).toBe(404);
  expect(h.agent.calls.filter((c) => c.startsWith("metrics")).length).toBe(before);
});

test("a sessions API key is refused (403)", async () => {
  const id = await create(pro);
  expect((await h.req("GET", `/v1/sandboxes/${id}/metrics`, { key: live })).status).toBe(403);
});

test("a suspended sandbox answers `suspended` and stays suspended", async () => {
  const id = await create(pro);
  expect((await h.req("POST", `/v1/sandboxes/${id}/suspend`, { key: pro })).status).toBe(200);
  const res = await h.req("GET", `/v1/sandboxes/${id}/metrics`, { key: pro });
  expect(res.status).toBe(200);
  expect(((await res.json()) as Body).state).toBe("suspended");
  const info = (await (await h.req("GET", `/v1/sandboxes/${id}`, { key: pro })).json()) as Body;
  expect(info.state).toBe("suspended");
});

test("a deleted sandbox's metrics are 404", async () => {
  const id = await create(pro);
  expect((await h.req("DELETE", `/v1/sandboxes/${id}`, { key: pro })).status).toBe(200);
  expect((await h.req("GET", `/v1/sandboxes/${id}/metrics`, { key: pro })).status).toBe(404);
});

test("openapi.yaml describes the route and its schema", async () => {
  const doc = parse(await Bun.file(OPENAPI_PATH).text()) as Body;
  const op = doc.paths["/v1/sandboxes/{id}/metrics"]?.get;
  expect(op).toBeDefined();
  expect(Object.keys(op.responses)).toEqual(expect.arrayContaining(["200", "403", "404"]));
  const sample = doc.components.schemas.MetricsSample;
  expect(Object.keys(sample.properties).sort()).toEqual([
    "at",
    "cpu_percent",
    "disk_used_bytes",
    "memory_resident_bytes",
    "memory_used_bytes",
  ]);
  expect(doc.components.schemas.SandboxMetrics.properties.state.enum).toEqual([
    "starting",
    "running",
    "suspended",
  ]);
});
