/**
 * `PUT /v1/sandboxes/{id}/egress` through the gateway (docs/egress.md): the owner's sandbox only,
 * the create's bounds and syntax (400 with the error envelope, the agent never asked), 409 for a
 * sandbox with no VM yet, 403 for a sessions API key, and every answer checked against
 * openapi.yaml by the harness. Real PGlite; the host agent is the in-memory stand-in. With a real
 * agent and VM (the list enforced inside the guest): tests/vm/egress-update.test.ts.
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { eq } from "drizzle-orm";
import { sandboxes } from "../../db/schema/sandboxes.ts";
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
  const res = await h.req("POST", "/v1/sandboxes", {
    key,
    json: { template: "python", egress: { allow: [] } },
  });
  expect(res.status).toBe(201);
  return ((await res.json()) as Body).id;
}
const setCalls = () => h.agent.calls.filter((c) => c.startsWith("setEgress")).length;

test("the owner sets a list; the answer is the list in force", async () => {
  const id = await create(pro);
  const res = await h.req("PUT", `/v1/sandboxes/${id}/egress`, {
    key: pro,
    json: { allow: ["api.example.com", "*.pkg.dev", "10.0.0.7", "*"] },
  });
  expect(res.status).toBe(200);
  expect(await res.json()).toEqual({
    id,
    egress: { allow: ["api.example.com", "*.pkg.dev", "10.0.0.7", "*"] },
  });
});

test("another tenant's and an unknown id are 404; a sessions API key 403; the agent is not asked", async () => {
  const id = await create(pro);
  const before = setCalls();
  expect(
    (await h.req("PUT", `/v1/sandboxes/${id}/egress`, { key: otherPro, json: { allow: [] } })).status,
  ).toBe(404);
  const unknown = await h.req("PUT", "/v1/sandboxes/sbx_doesnotexist0000/egress", {
    key: pro,
    json: { allow: [] },
  });
  expect(unknown.status).toBe(404);
  expect(((await unknown.json()) as Body).code).toBe("not_found");
  expect((await h.req("PUT", `/v1/sandboxes/${id}/egress`, { key: live, json: { allow: [] } })).status).toBe(
    403,
  );
  expect(setCalls()).toBe(before);
});

test("hostile bodies are 400 bad_request in the one envelope, and the agent is not asked", async () => {
  const id = await create(pro);
  const before = setCalls();
  for (const json of [
    { allow: ["http://x.com/"] },
    { allow: ["a b"] },
    { allow: ["*.*.com"] },
    { allow: [""] },
    { allow: ["x".repeat(254)] },
    { allow: Array.from({ length: 257 }, (_, i) => `h${i}.com`) },
    { allow: "example.com" },
    { allow: [1] },
    {},
  ]) {
    const res = await h.req("PUT", `/v1/sandboxes/${id}/egress`, { key: pro, json });
    expect({ json, status: res.status }).toEqual({ json, status: 400 });
    const b = (await res.json()) as Body;
    expect(b.code).toBe("bad_request");
    expect(typeof b.message).toBe("string");
  }
  expect(setCalls()).toBe(before);
});

test("a sandbox with no VM yet is 409; a deleted one 404", async () => {
  const id = await create(pro);
  await h.handle.db.update(sandboxes).set({ state: "starting" }).where(eq(sandboxes.id, id));
  const res = await h.req("PUT", `/v1/sandboxes/${id}/egress`, { key: pro, json: { allow: [] } });
  expect(res.status).toBe(409);
  expect(((await res.json()) as Body).code).toBe("conflict");
  await h.handle.db.update(sandboxes).set({ state: "running" }).where(eq(sandboxes.id, id));
  expect((await h.req("DELETE", `/v1/sandboxes/${id}`, { key: pro })).status).toBe(200);
  expect((await h.req("PUT", `/v1/sandboxes/${id}/egress`, { key: pro, json: { allow: [] } })).status).toBe(
    404,
  );
});
