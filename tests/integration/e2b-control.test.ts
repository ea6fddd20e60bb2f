/**
 * E2B's control plane (gateway/e2b/control.ts, docs/e2b.md "Control plane") driven by E2B's own
 * SDK (`e2b` 2.45.0, unmodified) over HTTP: the gateway app served on a loopback port with real
 * PGlite and the in-memory stand-in agent, so every rule checked here is the gateway's (with real
 * VMs: tests/e2e/e2b-control.test.ts). Then raw requests with hostile input: wrong types, huge
 * bodies, ids that cannot be ours, other tenants' ids, keys of the other API.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { AuthenticationError, Sandbox, SandboxError, SandboxNotFoundError } from "e2b";
import type { z } from "zod";
import * as E from "../../contracts/e2b/control.ts";
import { E2B_ENVD_VERSION, e2bKeyOf } from "../../contracts/e2b/ids.ts";
import { upsertPublicTemplate } from "../../gateway/core/templates.ts";
import { verifyEnvdToken } from "../../gateway/e2b/envd-token.ts";
import { type Harness, makeHarness } from "../support/gateway-harness.ts";

let h: Harness;
let server: ReturnType<typeof Bun.serve>;
let apiUrl = "";
let pro = "";
let other = "";
let live = "";

/** The SDK's options for a key: our gateway as E2B's API, E2B-form key (the SDK checks its form). */
const opts = (key = pro) => ({ apiUrl, apiKey: e2bKeyOf(key), domain: "sandboxd.test" });

async function raw(
  method: string,
  path: string,
  init: { key?: string; body?: string; headers?: Record<string, string> } = {},
) {
  const headers: Record<string, string> = { "content-type": "application/json", ...init.headers };
  if (init.key !== undefined) headers["x-api-key"] = init.key;
  const res = await fetch(`${apiUrl}${path}`, {
    method,
    headers,
    ...(init.body !== undefined ? { body: init.body } : {}),
  });
  const text = await res.text();
  return { status: res.status, headers: res.headers, body: text ? (JSON.parse(text) as unknown) : undefined };
}

function expectE2bError(r: { status: number; body: unknown }, status: number): string {
  expect(r.status).toBe(status);
  const e = E.E2bError.parse(r.body);
  expect(e.code).toBe(status);
  return e.message;
}

const parse = <S extends z.ZodType>(s: S, v: unknown): z.output<S> => s.parse(v);

beforeAll(async () => {
  // A rate limit of 1000/s: the SDK calls below must not meet it (its own test is separate).
  h = await makeHarness({ realClock: true, validate: false, limits: { ratePerSecond: 1000 } });
  await upsertPublicTemplate(
    { db: h.handle.db, clock: Date.now },
    { id: "base", name: "Base", description: "" },
  );
  h.agent.addReadyTemplate("base");
  pro = await h.key("acme", "pro");
  other = await h.key("globex", "pro");
  live = await h.key("acme-sessions", "live");
  server = Bun.serve({ port: 0, hostname: "127.0.0.1", fetch: (req) => h.app.fetch(req) });
  apiUrl = `http://127.0.0.1:${server.port}/e2b`;
  // As users point the SDK elsewhere; the options below name it too where the SDK's types allow.
  process.env.E2B_API_URL = apiUrl;
});
afterAll(async () => {
  server.stop(true);
  await h.close();
});

describe("E2B's SDK against the control plane", () => {
  test("create with metadata and timeout, getInfo, the envd token, kill", async () => {
    const sbx = await Sandbox.create({
      ...opts(),
      metadata: { app: "one", who: "a b/c=d" },
      timeoutMs: 60_000,
    });
    expect(sbx.sandboxId).toMatch(/^[a-z0-9]+$/);
    expect(sbx.sandboxDomain).toBe("sandboxd.test"); // no e2bDomain: the SDK keeps its own
    const info = await Sandbox.getInfo(sbx.sandboxId, opts());
    expect(info).toMatchObject({
      sandboxId: sbx.sandboxId,
      templateId: "base",
      metadata: { app: "one", who: "a b/c=d" },
      state: "running",
      envdVersion: E2B_ENVD_VERSION,
      lifecycle: { onTimeout: "kill", autoResume: false },
    });
    const left = info.endAt.getTime() - Date.now();
    expect(left).toBeGreaterThan(50_000);
    expect(left).toBeLessThanOrEqual(60_000);
    // The raw detail: E2B's shape, and a token for this sandbox of this key's tenant.
    const r = await raw("GET", `/sandboxes/${sbx.sandboxId}`, { key: e2bKeyOf(pro) });
    const d = parse(E.SandboxDetail, r.body);
    const p = await verifyEnvdToken(h.config.connectSecret, d.envdAccessToken, `sbx_${sbx.sandboxId}`);
    expect(p?.api).toBe("sandboxes");
    // The native key works too (the SDK's own key check off).
    const nativeInfo = await Sandbox.getInfo(sbx.sandboxId, { apiKey: pro, validateApiKey: false });
    expect(nativeInfo.sandboxId).toBe(sbx.sandboxId);
    expect(await sbx.kill()).toBe(true);
    expect(await Sandbox.kill(sbx.sandboxId, opts())).toBe(false);
    await expect(Sandbox.getInfo(sbx.sandboxId, opts())).rejects.toBeInstanceOf(SandboxNotFoundError);
  });

  test("list: metadata filter, state, paging with x-next-token", async () => {
    const tag = `t${Date.now()}`;
    const made = [];
    for (let i = 0; i < 3; i++)
      made.push(await Sandbox.create({ ...opts(), metadata: { tag, n: String(i) } }));
    await Sandbox.create({ ...opts(other), metadata: { tag } }); // another tenant's: never listed
    const pager = Sandbox.list({ ...opts(), query: { metadata: { tag } }, limit: 2 });
    const first = await pager.nextItems();
    expect(first).toHaveLength(2);
    expect(pager.hasNext).toBe(true);
    const second = await pager.nextItems();
    expect(pager.hasNext).toBe(false);
    expect([...first, ...second].map((s) => s.sandboxId)).toEqual(made.map((s) => s.sandboxId));
    const one = await Sandbox.list({ ...opts(), query: { metadata: { tag, n: "1" } } }).nextItems();
    expect(one.map((s) => s.sandboxId)).toEqual([made[1]!.sandboxId]);
    await made[2]!.pause();
    const paused = await Sandbox.list({
      ...opts(),
      query: { metadata: { tag }, state: ["paused"] },
    }).nextItems();
    expect(paused.map((s) => [s.sandboxId, s.state])).toEqual([[made[2]!.sandboxId, "paused"]]);
    const running = await Sandbox.list({
      ...opts(),
      query: { metadata: { tag }, state: ["running"] },
    }).nextItems();
    expect(running).toHaveLength(2);
    // The deprecated list: running ones only.
    const legacy = await raw("GET", `/sandboxes?metadata=${encodeURIComponent(`tag=${tag}`)}`, {
      key: e2bKeyOf(pro),
    });
    expect((legacy.body as unknown[]).map((s) => parse(E.ListedSandbox, s).state)).toEqual([
      "running",
      "running",
    ]);
    for (const s of made) await s.kill();
  });

  test("setTimeout, pause (twice), connect resumes (201) with a new lifetime, connect on a running one (200)", async () => {
    const sbx = await Sandbox.create({ ...opts(), timeoutMs: 30_000, lifecycle: { onTimeout: "pause" } });
    expect((await sbx.getInfo()).lifecycle).toEqual({ onTimeout: "pause", autoResume: true });
    await sbx.setTimeout(600_000);
    expect((await sbx.getInfo()).endAt.getTime() - Date.now()).toBeGreaterThan(590_000);
    expect(await sbx.pause()).toBe(true);
    expect(await sbx.pause()).toBe(false); // already paused: E2B's 409
    expect((await sbx.getInfo()).state).toBe("paused");
    const resumed = await raw("POST", `/sandboxes/${sbx.sandboxId}/connect`, {
      key: e2bKeyOf(pro),
      body: JSON.stringify({ timeout: 120 }),
    });
    expect(resumed.status).toBe(201);
    expect(parse(E.E2bSandbox, resumed.body).sandboxID).toBe(sbx.sandboxId);
    const info = await sbx.getInfo();
    expect(info.state).toBe("running");
    expect(info.endAt.getTime() - Date.now()).toBeLessThanOrEqual(120_000);
    // Running: 200, and a shorter timeout does not shorten its lifetime.
    const again = await Sandbox.connect(sbx.sandboxId, { ...opts(), timeoutMs: 10_000 });
    expect(again.sandboxId).toBe(sbx.sandboxId);
    expect((await sbx.getInfo()).endAt.getTime() - Date.now()).toBeGreaterThan(100_000);
    await sbx.pause();
    const back = await Sandbox.connect(sbx.sandboxId, { ...opts(), timeoutMs: 300_000 });
    expect((await back.getInfo()).state).toBe("running");
    await back.kill();
  });

  test("fork, snapshots (take, list, create from one, delete), metrics", async () => {
    const sbx = await Sandbox.create(opts());
    const forks = await Sandbox.fork(sbx.sandboxId, { ...opts(), count: 2, timeoutMs: 90_000 });
    expect(forks).toHaveLength(2);
    for (const f of forks) {
      expect(f).toBeInstanceOf(Sandbox);
      const fi = await (f as Sandbox).getInfo();
      expect(fi.endAt.getTime() - Date.now()).toBeLessThanOrEqual(90_000);
      await (f as Sandbox).kill();
    }
    const snap = await sbx.createSnapshot({ name: "mine" });
    expect(snap).toEqual({ snapshotId: expect.stringMatching(/^snap_/), names: ["mine"] });
    const listed = await Sandbox.listSnapshots({ ...opts(), sandboxId: sbx.sandboxId }).nextItems();
    expect(listed).toEqual([snap]);
    expect(await Sandbox.listSnapshots({ ...opts(), name: "mine" }).nextItems()).toEqual([snap]);
    expect(await Sandbox.listSnapshots({ ...opts(), name: "not-mine" }).nextItems()).toEqual([]);
    expect(await Sandbox.listSnapshots({ ...opts(other) }).nextItems()).toEqual([]);
    const fromSnap = await Sandbox.create(snap.snapshotId, opts());
    expect((await fromSnap.getInfo()).templateId).toBe("base");
    await fromSnap.kill();
    const metrics = await sbx.getMetrics();
    expect(metrics.length).toBeGreaterThan(0);
    expect(metrics[0]).toMatchObject({ cpuCount: expect.any(Number), memTotal: expect.any(Number) });
    const many = await raw("GET", `/sandboxes/metrics?sandbox_ids=${sbx.sandboxId},zzz`, {
      key: e2bKeyOf(pro),
    });
    const m = many.body as { sandboxes: Record<string, unknown> };
    expect(Object.keys(m.sandboxes)).toEqual([sbx.sandboxId]);
    parse(E.SandboxMetric, m.sandboxes[sbx.sandboxId]);
    expect(await Sandbox.deleteSnapshot(snap.snapshotId, opts())).toBe(true);
    expect(await Sandbox.deleteSnapshot(snap.snapshotId, opts())).toBe(false);
    await sbx.kill();
  });

  test("a command that ends before its stdin is closed (stdin: false, the SDK's default) still runs", async () => {
    // The stand-in agent's processes end as they start, and it refuses stdin to an ended one
    // (409, as the real agent does): the gateway's close right after the start meets exactly
    // the race a quick command (`pwd`) wins on a real guest now and then.
    const sbx = await Sandbox.create({ ...opts(), sandboxUrl: `${apiUrl}/envd` });
    const r = await sbx.commands.run("pwd");
    expect(r.exitCode).toBe(0);
    // An explicit closeStdin of an ended process is still refused, as envd does.
    const bg = await sbx.commands.run("true", { background: true, stdin: true });
    await expect(bg.closeStdin()).rejects.toThrow();
    await sbx.kill();
  });

  test("unknown, malformed and other tenants' ids: SandboxNotFoundError", async () => {
    const mine = await Sandbox.create(opts());
    for (const id of ["zzzzzzzzzzzzzzzzzzzz", "NOT-AN-ID", "sbx_abc", "a".repeat(200), mine.sandboxId]) {
      const key = id === mine.sandboxId ? other : pro;
      await expect(Sandbox.getInfo(id, opts(key))).rejects.toBeInstanceOf(SandboxNotFoundError);
      await expect(Sandbox.connect(id, opts(key))).rejects.toBeInstanceOf(SandboxNotFoundError);
      await expect(Sandbox.setTimeout(id, 1000, opts(key))).rejects.toBeInstanceOf(SandboxNotFoundError);
      await expect(Sandbox.pause(id, opts(key))).rejects.toBeInstanceOf(SandboxNotFoundError);
      expect(await Sandbox.kill(id, opts(key))).toBe(false);
    }
    expect((await mine.getInfo()).state).toBe("running"); // the other tenant changed nothing
    await mine.kill();
  });

  test("keys: an unknown key is AuthenticationError, a sessions API key a 403 saying why", async () => {
    const bogus = e2bKeyOf("svc_pro_000000000000_0000000000000000000000000000000000000000");
    await expect(Sandbox.create({ apiUrl, apiKey: bogus })).rejects.toBeInstanceOf(AuthenticationError);
    await expect(Sandbox.list({ apiKey: bogus }).nextItems()).rejects.toBeInstanceOf(AuthenticationError);
    const err = await Sandbox.create(opts(live)).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(SandboxError);
    expect(String(err)).toContain("403");
    expect(String(err)).toContain("sandboxes API key");
    expectE2bError(await raw("GET", "/v2/sandboxes"), 401);
    expectE2bError(await raw("GET", "/v2/sandboxes", { key: "e2b_abc" }), 401); // odd hex: no key
    const bearer = await raw("GET", "/v2/sandboxes", {
      headers: { authorization: `Bearer ${e2bKeyOf(pro)}` },
    });
    expect(bearer.status).toBe(200);
  });
});

describe("hostile input, raw", () => {
  const k = () => e2bKeyOf(pro);

  test("wrong types and unknown values are 400 in E2B's form; nothing is made", async () => {
    const bodies = [
      "not json",
      "[]",
      JSON.stringify({ templateID: 5 }),
      JSON.stringify({ templateID: "base", timeout: "60" }),
      JSON.stringify({ templateID: "base", timeout: -1 }),
      JSON.stringify({ templateID: "base", timeout: 1e12 }),
      JSON.stringify({ templateID: "base", metadata: { k: 1 } }),
      JSON.stringify({ templateID: "base", metadata: { ["x".repeat(64)]: "v" } }),
      JSON.stringify({ templateID: "base", envVars: { A: 1 } }),
      JSON.stringify({ templateID: "base", envVars: { "A=B": "1" } }),
      JSON.stringify({ templateID: "base", envVars: { A: "x".repeat(70_000) } }),
      JSON.stringify({ templateID: "base", autoPauseMemory: false }),
      JSON.stringify({ templateID: "base", network: { denyOut: ["10.0.0.0/8"] } }),
      JSON.stringify({ templateID: "base", network: { rules: { "a.example": [{}] } } }),
      JSON.stringify({ templateID: "base", volumeMounts: [{ name: "v", path: "/v" }] }),
      JSON.stringify({
        templateID: "base",
        allow_internet_access: false,
        network: { allowOut: ["10.0.0.0/8"] },
      }),
    ];
    for (const body of bodies) expectE2bError(await raw("POST", "/sandboxes", { key: k(), body }), 400);
    expect(await Sandbox.list(opts()).nextItems()).toEqual([]);
    const msg = expectE2bError(
      await raw("POST", "/sandboxes", { key: k(), body: JSON.stringify({ envVars: { "A=B": "1" } }) }),
      400,
    );
    expect(msg).toContain("envVars");
  });

  test("a body over the JSON bound is 413; an unknown template 404", async () => {
    const huge = JSON.stringify({
      templateID: "base",
      metadata: { a: "x".repeat(h.config.limits.maxJsonBodyBytes) },
    });
    expectE2bError(await raw("POST", "/sandboxes", { key: k(), body: huge }), 413);
    expectE2bError(
      await raw("POST", "/sandboxes", { key: k(), body: JSON.stringify({ templateID: "nope" }) }),
      404,
    );
  });

  test("bad queries: state, metadata, cursor, order", async () => {
    for (const q of [
      "state=dead",
      "limit=0",
      "limit=x",
      "nextToken=forged.token",
      "order=desc",
      "startedAfter=2020-01-01T00:00:00Z",
      "metadata=%25zz%3Dv",
    ]) {
      expectE2bError(await raw("GET", `/v2/sandboxes?${q}`, { key: k() }), 400);
    }
    const ids = Array.from({ length: 101 }, (_, i) => `a${i}`).join(",");
    expectE2bError(await raw("GET", `/sandboxes/metrics?sandbox_ids=${ids}`, { key: k() }), 400);
  });

  test("paths sandboxd does not serve: 501 saying so, after the key check", async () => {
    for (const [method, path] of [
      ["GET", "/templates"],
      ["POST", "/v3/templates"],
      ["GET", "/volumes"],
      ["GET", "/secrets"],
      ["GET", "/teams"],
      ["GET", "/v2/sandboxes/abc/logs"],
      ["POST", "/sandboxes/abc/refreshes"],
      ["DELETE", "/templates/base"],
    ] as const) {
      expect(expectE2bError(await raw(method, path, { key: k() }), 501)).toContain("not served by sandboxd");
      expectE2bError(await raw(method, path), 401);
    }
  });
});
