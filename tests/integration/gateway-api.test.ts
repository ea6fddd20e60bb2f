/**
 * Gateway logic through app.request(): auth, tiers, tenancy, validation, limits, error mapping.
 * Real PGlite db in a temp dir; the host agent is the in-memory STAND-IN
 * (tests/support/memory-agent.ts), which runs no VMs. Real-VM end-to-end tests come with the real agent.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { eq, inArray } from "drizzle-orm";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { templates } from "../../db/schema/templates.ts";
import { usageIntervals } from "../../db/schema/usage-intervals.ts";
import { FixedPlacement } from "../../gateway/agents/placement.ts";
import { endStaleExecs, reapIdleSessions } from "../../gateway/core/sandboxes.ts";
import type { Deps } from "../../gateway/deps.ts";
import { OPENAPI_PATH } from "../../gateway/openapi.ts";
import { type Harness, makeHarness } from "../support/gateway-harness.ts";

let h: Harness;
let live: string;
let scale: string;
let demo: string;
let pro: string;
let ent: string;
let otherPro: string;
let otherLive: string;

beforeAll(async () => {
  h = await makeHarness();
  live = await h.key("acme", "live");
  scale = await h.key("acme", "scale");
  demo = await h.key("acme", "demo");
  pro = await h.key("acme", "pro");
  ent = await h.key("acme", "enterprise");
  otherPro = await h.key("globex", "pro");
  otherLive = await h.key("globex", "live");
});
afterAll(() => h.close());

// biome-ignore lint/suspicious/noExplicitAny: response bodies are checked field by field in the tests
type Body = Record<string, any>;
async function json(res: Response): Promise<Body> {
  return (await res.json()) as Body;
}

describe("health and auth", () => {
  test("GET /v1/health needs no key and satisfies both forms", async () => {
    const res = await h.req("GET", "/v1/health");
    expect(res.status).toBe(200);
    expect(await json(res)).toEqual({
      status: "ok",
      version: "test-1",
      templates: { python: { ready: true } },
    });
  });

  test("GET /v1/openapi.yaml serves the committed API description without a key", async () => {
    const res = await h.req("GET", "/v1/openapi.yaml");
    expect(res.status).toBe(200);
    expect(res.headers.get("content-type")).toStartWith("application/yaml");
    expect(await res.text()).toBe(await Bun.file(OPENAPI_PATH).text());
  });

  test("401 for a missing, malformed, unknown, tampered or revoked key", async () => {
    for (const key of [
      undefined,
      "nope",
      "svc_pro_aaaaaaaaaaaa_bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
      // Tampered: the last secret character changed (to one it is not, or the key would be valid).
      `${pro.slice(0, -1)}${pro.endsWith("x") ? "y" : "x"}`,
      pro.replace("svc_pro_", "svc_enterprise_"),
    ]) {
      const res = await h.req("GET", "/v1/sandboxes", key === undefined ? {} : { key });
      expect(res.status).toBe(401);
      expect((await json(res)).code).toBe("unauthorized");
    }
  });
});

describe("tiers", () => {
  test("403 when the key's api or tier lacks the action", async () => {
    expect((await h.req("GET", "/v1/sandboxes", { key: live })).status).toBe(403);
    expect(
      (await h.req("POST", "/v1/exec", { key: pro, json: { code: "1", template_id: "python" } })).status,
    ).toBe(403);
    const upload = await h.req("POST", "/v1/templates?id=mine", {
      key: live,
      body: "img",
      headers: { "content-type": "application/octet-stream" },
    });
    expect(upload.status).toBe(403);
    expect((await json(upload)).code).toBe("forbidden");
  });

  test("403 demo_tier_limit for connect-url and baking with a demo key", async () => {
    const sb = await json(await h.req("POST", "/v1/sandboxes", { key: demo, json: { template: "python" } }));
    const res = await h.req("POST", `/v1/sandboxes/${sb.id}/connect-url`, {
      key: demo,
      json: { port: 8080, ttl_seconds: 60 },
    });
    expect(res.status).toBe(403);
    expect((await json(res)).code).toBe("demo_tier_limit");
    const bake = await h.req("POST", "/v1/templates", {
      key: demo,
      json: { name: "x", image: "docker.io/library/python:3" },
    });
    expect((await json(bake)).code).toBe("demo_tier_limit");
  });
});

describe("validation and limits", () => {
  test("400 bad_request for bad bodies", async () => {
    const cases: [string, string, unknown][] = [
      ["POST", "/v1/sessions", {}],
      ["POST", "/v1/exec", { code: "x", template_id: "bad id!" }],
      ["POST", "/v1/exec", { code: "x", template_id: "python", timeout_seconds: 0 }],
      ["POST", "/v1/exec", { code: "x", template_id: "python", timeout_seconds: 100000 }],
    ];
    for (const [m, p, body] of cases) {
      const res = await h.req(m, p, { key: live, json: body });
      expect(res.status).toBe(400);
      expect((await json(res)).code).toBe("bad_request");
    }
    const notJson = await h.req("POST", "/v1/sandboxes", {
      key: pro,
      body: "{",
      headers: { "content-type": "application/json" },
    });
    expect(notJson.status).toBe(400);
  });

  test("413 for a JSON body over the limit", async () => {
    const big = "x".repeat(h.config.limits.maxJsonBodyBytes + 1);
    const res = await h.req("POST", "/v1/exec", { key: live, json: { code: big, template_id: "python" } });
    expect(res.status).toBe(413);
    expect((await json(res)).code).toBe("payload_too_large");
  });

  test("429 rate_limited with Retry-After past 100 requests in a second", async () => {
    const key = await h.key("burst", "live");
    const statuses: number[] = [];
    for (let i = 0; i < 101; i++) statuses.push((await h.req("GET", "/v1/sessions", { key })).status);
    expect(statuses.slice(0, 100).every((s) => s === 200)).toBe(true);
    const last = await h.req("GET", "/v1/sessions", { key });
    expect(last.status).toBe(429);
    expect(last.headers.get("retry-after")).toBe("1");
    expect((await json(last)).code).toBe("rate_limited");
    h.now.ms += 1000; // a second later the bucket is full again
    expect((await h.req("GET", "/v1/sessions", { key })).status).toBe(200);
  });

  test("batch over the cap is 400; within it one result per execution", async () => {
    const many = Array.from({ length: h.config.limits.maxBatchExecutions + 1 }, () => ({
      code: "1",
      template_id: "python",
    }));
    expect((await h.req("POST", "/v1/exec/batch", { key: live, json: { executions: many } })).status).toBe(
      400,
    );
    const res = await h.req("POST", "/v1/exec/batch", {
      key: live,
      json: {
        executions: [
          { code: "a", template_id: "python" },
          { code: "b", template_id: "python" },
        ],
      },
    });
    expect((await json(res)).results.map((r: { stdout: string }) => r.stdout)).toEqual(["a", "b"]);
  });
});

describe("sessions API: sessions", () => {
  test("create, exec, fork, status, list, delete; foreign tenant 404; reclaimed 410", async () => {
    const one = await json(
      await h.req("POST", "/v1/exec", { key: live, json: { code: "print(1)", template_id: "python" } }),
    );
    expect(one.stdout).toBe("print(1)");
    expect(one.id).toMatch(/^[0-9a-f-]{36}$/);

    const created = await h.req("POST", "/v1/sessions", { key: live, json: { template_id: "python" } });
    expect(created.status).toBe(201);
    const s = await json(created);
    expect(s.session_id).toMatch(/^sess_/);
    const ex = await json(
      await h.req("POST", `/v1/sessions/${s.session_id}/exec`, {
        key: live,
        json: { commands: [["echo", "hi"]] },
      }),
    );
    expect(ex).toMatchObject({ id: s.session_id, stdout: "echo hi", fork_time_ms: 0 });
    const both = await h.req("POST", `/v1/sessions/${s.session_id}/exec`, {
      key: live,
      json: { code: "x", commands: [["y"]] },
    });
    expect(both.status).toBe(400);

    const fork = await h.req("POST", `/v1/sessions/${s.session_id}/fork`, { key: live });
    expect(fork.status).toBe(201);
    expect((await json(fork)).session_id).toMatch(/^sess_/);

    const st = await json(await h.req("GET", `/v1/sessions/${s.session_id}`, { key: live }));
    expect(st).toMatchObject({ session_id: s.session_id, template_id: "python", exec_count: 1 });
    const list = await json(await h.req("GET", "/v1/sessions", { key: live }));
    expect(list.sessions.map((x: { session_id: string }) => x.session_id)).toContain(s.session_id);

    expect((await h.req("GET", `/v1/sessions/${s.session_id}`, { key: otherLive })).status).toBe(404);
    expect(
      (await h.req("POST", `/v1/sessions/${s.session_id}/exec`, { key: otherLive, json: { code: "x" } }))
        .status,
    ).toBe(404);

    // Idle past the TTL: the reaper reclaims it and later calls get 410.
    h.now.ms += (h.config.limits.sessionIdleTtlS + 1) * 1000;
    const reaped = await reapIdleSessions({
      db: h.handle.db,
      agent: h.agent,
      placement: new FixedPlacement(h.handle.db, h.agent, h.config.agent),
      config: h.config,
      clock: () => h.now.ms,
    });
    expect(reaped).toContain(s.session_id);
    const gone = await h.req("GET", `/v1/sessions/${s.session_id}`, { key: live });
    expect(gone.status).toBe(410);
    expect((await json(gone)).code).toBe("gone");

    const s2 = await json(
      await h.req("POST", "/v1/sessions", { key: live, json: { template_id: "python" } }),
    );
    expect((await h.req("DELETE", `/v1/sessions/${s2.session_id}?force=true`, { key: live })).status).toBe(
      204,
    );
    expect(h.agent.calls.at(-1)).toMatch(/force=true$/);
    expect((await h.req("GET", `/v1/sessions/${s2.session_id}`, { key: live })).status).toBe(404);
  });

  test("unknown template 404; session cap 429 quota_exceeded", async () => {
    expect((await h.req("POST", "/v1/sessions", { key: live, json: { template_id: "nope" } })).status).toBe(
      404,
    );
    const capped = await makeHarness({ limits: { sessionCapPerTenant: 1 } });
    try {
      const k = await capped.key("t", "live");
      expect(
        (await capped.req("POST", "/v1/sessions", { key: k, json: { template_id: "python" } })).status,
      ).toBe(201);
      const res = await capped.req("POST", "/v1/sessions", { key: k, json: { template_id: "python" } });
      expect(res.status).toBe(429);
      expect((await json(res)).code).toBe("quota_exceeded");
    } finally {
      await capped.close();
    }
  });
});

describe("one-shot execs share the tenant's cap and are metered", () => {
  test("an exec in flight holds a place; batch items over the cap fail one by one; each call is one running interval", async () => {
    const capped = await makeHarness({ limits: { sessionCapPerTenant: 2 } });
    try {
      const k = await capped.key("t", "live");
      let release!: () => void;
      capped.agent.execOnceGate = new Promise<void>((r) => {
        release = r;
      });
      const inFlight = capped.req("POST", "/v1/exec", { key: k, json: { code: "1", template_id: "python" } });
      // Bounded at 10 s: the call reaches the agent at once, on a loaded host a moment later.
      for (let i = 0; i < 2000 && !capped.agent.calls.some((c) => c.startsWith("execOnce")); i++)
        await Bun.sleep(5);
      expect(capped.agent.calls.some((c) => c.startsWith("execOnce"))).toBe(true);
      // One place taken by the exec: a session fits, then nothing more does.
      expect(
        (await capped.req("POST", "/v1/sessions", { key: k, json: { template_id: "python" } })).status,
      ).toBe(201);
      const over = await capped.req("POST", "/v1/exec", {
        key: k,
        json: { code: "2", template_id: "python" },
      });
      expect(over.status).toBe(429);
      expect(await json(over)).toMatchObject({ code: "quota_exceeded" });
      const execs = capped.agent.calls.filter((c) => c.startsWith("execOnce")).length;
      const batch = await capped.req("POST", "/v1/exec/batch", {
        key: k,
        json: { executions: [{ code: "3", template_id: "python" }] },
      });
      // One result per item: this one is the 429 a single exec would get, as its own envelope.
      expect(batch.status).toBe(200);
      expect((await json(batch)).results).toEqual([
        { status: 429, error: { code: "quota_exceeded", message: expect.any(String) } },
      ]);
      // Refused before any VM was asked for.
      expect(capped.agent.calls.filter((c) => c.startsWith("execOnce")).length).toBe(execs);
      // The exec runs for an hour of the gateway's clock, then ends.
      capped.now.ms += 3600_000;
      release();
      expect((await inFlight).status).toBe(200);
      capped.agent.execOnceGate = undefined;
      // Its place is free again: the first item of a batch fits next to the session and runs;
      // the second finds the cap full, the third names no template; neither discards the first.
      const ok = await capped.req("POST", "/v1/exec/batch", {
        key: k,
        json: {
          executions: [
            { code: "4", template_id: "python" },
            { code: "5", template_id: "python" },
            { code: "6", template_id: "nope" },
          ],
        },
      });
      expect(ok.status).toBe(200);
      const items = (await json(ok)).results;
      expect(items[0]).toMatchObject({ stdout: "4", exit_code: 0 });
      expect(items[1]).toMatchObject({ status: 429, error: { code: "quota_exceeded" } });
      expect(items[2]).toMatchObject({ status: 404, error: { code: "not_found" } });
      const rows = await capped.handle.db.select().from(sandboxes).where(eq(sandboxes.kind, "exec"));
      expect(rows.map((r) => r.state)).toEqual(["destroyed", "destroyed"]);
      const intervals = await capped.handle.db
        .select()
        .from(usageIntervals)
        .where(
          inArray(
            usageIntervals.sandboxId,
            rows.map((r) => r.id),
          ),
        );
      expect(intervals).toHaveLength(2);
      for (const iv of intervals) {
        expect(iv).toMatchObject({ state: "running", vcpus: 2, memMib: 512 });
        expect(iv.endedAt).not.toBeNull();
      }
      const hours = intervals.map((iv) => (iv.endedAt!.getTime() - iv.startedAt.getTime()) / 3600_000).sort();
      expect(hours).toEqual([0, 1]);
    } finally {
      await capped.close();
    }
  });
});

test("a one-shot exec whose call was lost stops holding its place once no exec could still run", async () => {
  const capped = await makeHarness({ limits: { sessionCapPerTenant: 1 } });
  try {
    const k = await capped.key("t", "live");
    capped.agent.execOnceGate = new Promise<void>(() => {}); // the call never ends
    void capped.req("POST", "/v1/exec", { key: k, json: { code: "1", template_id: "python" } });
    // Bounded at 10 s: the call reaches the agent at once, on a loaded host a moment later.
    for (let i = 0; i < 2000 && !capped.agent.calls.some((c) => c.startsWith("execOnce")); i++)
      await Bun.sleep(5);
    expect(capped.agent.calls.some((c) => c.startsWith("execOnce"))).toBe(true);
    capped.agent.execOnceGate = undefined;
    expect(
      (await capped.req("POST", "/v1/sessions", { key: k, json: { template_id: "python" } })).status,
    ).toBe(429);
    const deps = {
      db: capped.handle.db,
      clock: () => capped.now.ms,
      config: capped.config,
    } as unknown as Deps;
    expect(await endStaleExecs(deps)).toEqual([]); // still within any exec's time
    capped.now.ms += (capped.config.limits.maxExecTimeoutS + 601) * 1000;
    expect(await endStaleExecs(deps)).toHaveLength(1);
    expect(
      (await capped.req("POST", "/v1/sessions", { key: k, json: { template_id: "python" } })).status,
    ).toBe(201);
  } finally {
    await capped.close();
  }
});

describe("templates", () => {
  test("list: map form for sessions API, array form for sandboxes API (same as /v1/images)", async () => {
    const a = await json(await h.req("GET", "/v1/templates", { key: live }));
    expect(a.templates.python).toEqual({ ready: true });
    const b = await json(await h.req("GET", "/v1/templates", { key: pro }));
    expect(b.templates).toContainEqual({
      id: "python",
      name: "Python 3",
      description: "CPython 3.12",
      visibility: "public",
    });
    expect(await json(await h.req("GET", "/v1/images", { key: pro }))).toEqual(b);
  });

  test("the sessions API upload streams to a file, builds, 409 on duplicate and while building", async () => {
    const chunks = 64;
    const chunk = new Uint8Array(64 * 1024).fill(7);
    chunk.set(new TextEncoder().encode("IMAGEHEAD"), 0);
    let i = 0;
    const stream = new ReadableStream<Uint8Array>({
      pull(ctrl) {
        if (i++ < chunks) ctrl.enqueue(chunk);
        else ctrl.close();
      },
    });
    const res = await h.app.request("/v1/templates?id=myimg&mem_mib=512&vcpu_count=2", {
      method: "POST",
      headers: { authorization: `Bearer ${scale}`, "content-type": "application/octet-stream" },
      body: stream,
      duplex: "half",
    } as RequestInit);
    expect(res.status).toBe(202);
    expect(await json(res)).toEqual({ id: "myimg", status: "building" });
    const agentTpl = [...h.agent.templates.entries()].find(([ref]) => ref.endsWith(".myimg"))!;
    expect(agentTpl[1].uploadBytes).toBe(chunks * chunk.byteLength);
    expect(agentTpl[1].uploadHead?.startsWith("IMAGEHEAD")).toBe(true);
    expect(agentTpl[1].source).toMatchObject({ kind: "upload", memMib: 512, vcpuCount: 2 });

    const dup = await h.req("POST", "/v1/templates?id=myimg", {
      key: scale,
      body: "x",
      headers: { "content-type": "application/octet-stream" },
    });
    expect(dup.status).toBe(409);
    const notReady = await h.req("POST", "/v1/sessions", { key: live, json: { template_id: "myimg" } });
    expect(notReady.status).toBe(409);
    expect((await json(notReady)).code).toBe("template_not_ready");
    expect(await json(await h.req("GET", "/v1/templates/myimg", { key: live }))).toEqual({
      id: "myimg",
      status: "building",
    });

    h.agent.finishBuild(agentTpl[0], true);
    const ready = await json(await h.req("GET", "/v1/templates/myimg", { key: live }));
    expect(ready).toEqual({ id: "myimg", status: "ready", created_at_secs: 1_700_000_000 });
    expect((await h.req("GET", "/v1/templates/myimg", { key: otherLive })).status).toBe(404);
    expect((await h.req("DELETE", "/v1/templates/myimg", { key: live })).status).toBe(403);
    // docs/templates.md "Rules of templates": a session still on it keeps running; nothing new spawns; the id is free again.
    const s = await json(await h.req("POST", "/v1/sessions", { key: live, json: { template_id: "myimg" } }));
    expect((await h.req("DELETE", "/v1/templates/myimg", { key: scale })).status).toBe(204);
    expect((await h.req("GET", "/v1/templates/myimg", { key: live })).status).toBe(404);
    const late = await h.req("POST", "/v1/sessions", { key: live, json: { template_id: "myimg" } });
    expect(late.status).toBe(404);
    expect((await json(late)).code).toBe("not_found");
    const still = await h.req("POST", `/v1/sessions/${s.session_id}/exec`, {
      key: live,
      json: { commands: [["echo", "still"]] },
    });
    expect(still.status).toBe(200);
    expect(h.agent.templates.get(agentTpl[0])?.deleting).toBe(true);
    const again = await h.req("POST", "/v1/templates?id=myimg", {
      key: scale,
      body: "IMAGEHEAD again",
      headers: { "content-type": "application/octet-stream" },
    });
    expect(again.status).toBe(202);
    const refs = [...h.agent.templates.keys()].filter((r) => r.endsWith(".myimg"));
    expect(refs).toHaveLength(2); // the old one, deleting, and the new registration beside it
    expect((await h.req("DELETE", `/v1/sessions/${s.session_id}`, { key: live })).status).toBe(204);
    expect(h.agent.templates.has(agentTpl[0])).toBe(false); // reclaimed with its last VM
    expect((await h.req("DELETE", "/v1/templates/myimg", { key: scale })).status).toBe(204);
  });

  test("upload over the limit is 413 and leaves no template", async () => {
    const small = await makeHarness({ limits: { maxTemplateUploadBytes: 10 } });
    try {
      const k = await small.key("t", "scale");
      const res = await small.req("POST", "/v1/templates?id=big", {
        key: k,
        body: "0123456789AB",
        headers: { "content-type": "application/octet-stream" },
      });
      expect(res.status).toBe(413);
      expect((await json(await small.req("GET", "/v1/templates", { key: k }))).templates.big).toBeUndefined();
    } finally {
      await small.close();
    }
  });

  test("an upload the disk cannot hold with its reserve is 507 before a byte is written", async () => {
    // A reserve larger than any disk: the free-space check refuses whatever the body's size.
    const tight = await makeHarness({ limits: { diskReserveBytes: 2 ** 60 } });
    try {
      const k = await tight.key("t", "scale");
      const builds = tight.agent.templates.size;
      const res = await tight.req("POST", "/v1/templates?id=img", {
        key: k,
        body: "0123456789AB",
        headers: { "content-type": "application/octet-stream" },
      });
      expect(res.status).toBe(507);
      const body = await json(res);
      expect(body.code).toBe("insufficient_storage");
      expect(body.message).toContain("retry once space is freed");
      expect((await json(await tight.req("GET", "/v1/templates", { key: k }))).templates.img).toBeUndefined();
      expect(tight.agent.templates.size).toBe(builds);
    } finally {
      await tight.close();
    }
  });

  test("template quota: registering or baking past the tier's count is 429; a retry of a bake is not", async () => {
    const few = await makeHarness({
      limits: { templateQuotaByTier: { live: 0, scale: 1, demo: 0, pro: 1, enterprise: 1 } },
    });
    try {
      const k = await few.key("t", "scale");
      const up = (id: string) =>
        few.req("POST", `/v1/templates?id=${id}`, {
          key: k,
          body: "0123456789AB",
          headers: { "content-type": "application/octet-stream" },
        });
      expect((await up("one")).status).toBe(202);
      const over = await up("two");
      expect(over.status).toBe(429);
      expect((await json(over)).code).toBe("quota_exceeded");
      const p = await few.key("p", "pro");
      const bake = { name: "b1", image: "127.0.0.1:5000/team/app:1" };
      expect((await few.req("POST", "/v1/templates", { key: p, json: bake })).status).toBe(202);
      // The same bake again is the existing template, not a new one.
      expect((await few.req("POST", "/v1/templates", { key: p, json: bake })).status).toBe(202);
      const b2 = await few.req("POST", "/v1/templates", { key: p, json: { ...bake, name: "b2" } });
      expect(b2.status).toBe(429);
      expect((await json(b2)).code).toBe("quota_exceeded");
    } finally {
      await few.close();
    }
  });

  test("suspended sandboxes count toward their own quota", async () => {
    const few = await makeHarness({
      limits: { suspendedQuotaByTier: { live: 0, scale: 0, demo: 1, pro: 1, enterprise: 1 } },
    });
    try {
      const p = await few.key("p", "pro");
      const a = await json(await few.req("POST", "/v1/sandboxes", { key: p, json: { template: "python" } }));
      const b = await json(await few.req("POST", "/v1/sandboxes", { key: p, json: { template: "python" } }));
      expect((await few.req("POST", `/v1/sandboxes/${a.id}/suspend`, { key: p })).status).toBe(200);
      const over = await few.req("POST", `/v1/sandboxes/${b.id}/suspend`, { key: p });
      expect(over.status).toBe(429);
      expect((await json(over)).code).toBe("quota_exceeded");
      // Refused before the agent was asked: it runs on.
      expect((await json(await few.req("GET", `/v1/sandboxes/${b.id}`, { key: p }))).state).toBe("running");
      expect((await few.req("DELETE", `/v1/sandboxes/${a.id}`, { key: p })).status).toBe(200);
      expect((await few.req("POST", `/v1/sandboxes/${b.id}/suspend`, { key: p })).status).toBe(200);
    } finally {
      await few.close();
    }
  });

  test("a bake's registry credentials go to the agent with the tenant id, and are kept nowhere", async () => {
    const auth = { username: "robot", password: "tok-9f8e7d6c5b4a" };
    const body = { name: "priv", image: "127.0.0.1:5000/team/app:1", registry_auth: auth };
    const res = await h.req("POST", "/v1/templates", { key: pro, json: body });
    expect(res.status).toBe(202);
    expect(await res.text()).not.toContain(auth.password);
    const ref = [...h.agent.templates.keys()].find((r) => r.endsWith(".priv"))!;
    const source = h.agent.templates.get(ref)?.source;
    expect(source).toMatchObject({ kind: "oci", image: body.image, registryAuth: auth });
    // The tenant id the agent is told is the one its template ref names.
    expect(source?.kind === "oci" ? `${source.tenantId}.priv` : "").toBe(ref);
    // The db row (its spec is what a retry is compared with) holds no credentials: a retry
    // with other credentials is the same bake.
    const rows = await h.handle.db.select().from(templates).where(eq(templates.id, "priv"));
    expect(JSON.stringify(rows)).not.toContain(auth.password);
    const retry = { ...body, registry_auth: { username: "robot", password: "other" } };
    expect((await h.req("POST", "/v1/templates", { key: pro, json: retry })).status).toBe(202);
    expect(await (await h.req("GET", "/v1/templates/priv", { key: pro })).text()).not.toContain(
      auth.password,
    );
    // A user name with ':' cannot be basic auth.
    const bad = { ...body, name: "priv2", registry_auth: { username: "a:b", password: "x" } };
    expect((await h.req("POST", "/v1/templates", { key: pro, json: bad })).status).toBe(400);
    expect((await h.req("DELETE", "/v1/templates/priv", { key: pro })).status).toBe(200);
  });

  test("the sandboxes API bake is idempotent; delete shared is 403; in use is 409", async () => {
    const body = { name: "llm", image: "ghcr.io/x/llm:1", ready: { cmd: "start", ports: [8080] } };
    const first = await h.req("POST", "/v1/templates", { key: pro, json: body });
    expect(first.status).toBe(202);
    expect(await json(first)).toMatchObject({ id: "llm", phase: "Pending", visibility: "private" });
    expect((await h.req("POST", "/v1/templates", { key: pro, json: body })).status).toBe(202);
    expect(
      (await h.req("POST", "/v1/templates", { key: pro, json: { ...body, image: "other" } })).status,
    ).toBe(409);
    expect(h.agent.calls.filter((c) => c.startsWith("build ") && c.includes(".llm")).length).toBe(1);
    h.agent.finishBuild([...h.agent.templates.keys()].find((r) => r.endsWith(".llm"))!, true);
    expect((await json(await h.req("GET", "/v1/templates/llm", { key: pro }))).phase).toBe("Live");

    expect((await json(await h.req("DELETE", "/v1/templates/python", { key: pro }))).code).toBe("forbidden");
    const sb = await json(await h.req("POST", "/v1/sandboxes", { key: pro, json: { template: "llm" } }));
    const inUse = await h.req("DELETE", "/v1/templates/llm", { key: pro });
    expect(inUse.status).toBe(409);
    expect((await json(inUse)).code).toBe("template_in_use");
    expect((await h.req("POST", "/v1/templates/llm/expect", { key: pro, json: { width: 8 } })).status).toBe(
      200,
    );
    expect((await h.req("POST", "/v1/templates/llm/release", { key: pro })).status).toBe(200);
    expect(
      (await h.req("POST", "/v1/templates/python/expect", { key: pro, json: { width: 8 } })).status,
    ).toBe(403);

    // connect-url: exposed port ok (ttl clamped), other port 409, foreign tenant 404
    const cu = await h.req("POST", `/v1/sandboxes/${sb.id}/connect-url`, {
      key: pro,
      json: { port: 8080, ttl_seconds: 999999 },
    });
    expect(cu.status).toBe(200);
    const cuBody = await json(cu);
    expect(cuBody.url).toStartWith(
      `wss://api.example.test/v1/sandboxes/${sb.id}/connect?port=8080&protocol=tcp&t=`,
    );
    expect(Date.parse(cuBody.expires_at) - h.now.ms).toBe(3600 * 1000);
    const bad = await h.req("POST", `/v1/sandboxes/${sb.id}/connect-url`, {
      key: pro,
      json: { port: 9999, ttl_seconds: 60 },
    });
    expect((await json(bad)).code).toBe("port_not_exposed");
    expect(
      (
        await h.req("POST", `/v1/sandboxes/${sb.id}/connect-url`, {
          key: otherPro,
          json: { port: 8080, ttl_seconds: 60 },
        })
      ).status,
    ).toBe(404);
    // the token authorises the connect checks without a key; a wrong port or deleted sandbox does not
    // (a deleted sandbox revokes its tokens: 401, an invalid credential)
    const path = new URL(cuBody.url).pathname + new URL(cuBody.url).search;
    expect((await json(await h.req("GET", path))).code).toBe("bad_request"); // passes auth; not an upgrade
    expect((await h.req("GET", path.replace("port=8080", "port=8081"))).status).toBe(401);
    await h.req("DELETE", `/v1/sandboxes/${sb.id}`, { key: pro });
    expect((await h.req("GET", path)).status).toBe(401);
    expect((await h.req("DELETE", "/v1/templates/llm", { key: pro })).status).toBe(200);
  });
});

describe("sandboxes API: sandboxes", () => {
  test("create, info, exec with seed, fork caps, suspend/resume, delete, tenancy", async () => {
    const res = await h.req("POST", "/v1/sandboxes", {
      key: pro,
      json: { template: "python", label: "a", labels: { team: "x" } },
    });
    expect(res.status).toBe(201);
    const sb = await json(res);
    expect(sb).toMatchObject({ template: "python", state: "running", endpoints: {} });
    expect(sb.id).toMatch(/^sbx_/);
    const alias = await h.req("POST", "/v1/sessions", { key: pro, json: { template: "python" } });
    expect(alias.status).toBe(201);
    expect((await json(alias)).id).toMatch(/^sbx_/);

    const ex = await json(
      await h.req("POST", `/v1/sandboxes/${sb.id}/exec`, {
        key: pro,
        json: { command: "echo 1", seed: "abc123" },
      }),
    );
    expect(ex).toMatchObject({
      id: sb.id,
      stdout: "echo 1",
      fork_time_ms: 0,
      seed: "abc123",
      seed_ack: "verified",
    });

    const info = await json(await h.req("GET", `/v1/sandboxes/${sb.id}`, { key: pro }));
    expect(info).toMatchObject({
      id: sb.id,
      state: "running",
      exec_count: 1,
      labels: { team: "x", label: "a" },
    });
    expect((await h.req("GET", `/v1/sandboxes/${sb.id}`, { key: otherPro })).status).toBe(404);
    expect((await json(await h.req("GET", `/v1/sandboxes/${sb.id}`, { key: otherPro }))).code).toBe(
      "not_found",
    );
    expect((await h.req("DELETE", `/v1/sandboxes/${sb.id}`, { key: otherPro })).status).toBe(404);

    expect(
      (await h.req("POST", `/v1/sandboxes/${sb.id}/fork`, { key: pro, json: { count: 33 } })).status,
    ).toBe(400);
    const fork = await json(
      await h.req("POST", `/v1/sandboxes/${sb.id}/fork`, { key: pro, json: { count: 2, labels: ["c1"] } }),
    );
    expect(fork.parent).toBe(sb.id);
    expect(fork.children.length).toBe(2);
    const child = await json(await h.req("GET", `/v1/sandboxes/${fork.children[0].id}`, { key: pro }));
    expect(child.labels).toEqual({ team: "x", label: "c1" });

    // busy: the agent refuses a second exec while one is in flight
    let release!: () => void;
    const gate = new Promise<void>((r) => {
      release = r;
    });
    // The agent awaits its gate once the exec is in flight (marked busy): a thenable says when.
    let reached = false;
    h.agent.execGate = {
      // biome-ignore lint/suspicious/noThenProperty: awaited by the stand-in agent, on purpose
      then: (ok: () => void, fail: (e: unknown) => void) => {
        reached = true;
        gate.then(ok, fail);
      },
    } as unknown as Promise<void>;
    const inflight = h.req("POST", `/v1/sandboxes/${sb.id}/exec`, { key: pro, json: { command: "sleep" } });
    for (let i = 0; i < 2000 && !reached; i++) await Bun.sleep(5); // 10 s at most
    expect(reached).toBe(true);
    const busy = await h.req("POST", `/v1/sandboxes/${sb.id}/exec`, { key: pro, json: { command: "x" } });
    expect(busy.status).toBe(409);
    expect((await json(busy)).code).toBe("busy");
    h.agent.execGate = null;
    release();
    expect((await inflight).status).toBe(200);

    const sus = await json(await h.req("POST", `/v1/sandboxes/${sb.id}/suspend`, { key: pro }));
    expect(sus).toEqual({ id: sb.id, state: "suspended", mem_bytes: 512 * 1024 * 1024 });
    expect((await h.req("POST", `/v1/sandboxes/${sb.id}/suspend`, { key: pro })).status).toBe(409);
    expect(
      (await h.req("POST", `/v1/sandboxes/${sb.id}/exec`, { key: pro, json: { command: "x" } })).status,
    ).toBe(409);
    expect((await json(await h.req("POST", `/v1/sandboxes/${sb.id}/resume`, { key: pro }))).state).toBe(
      "running",
    );

    const list = await json(await h.req("GET", "/v1/sandboxes", { key: pro }));
    expect(list.sandboxes).toContainEqual({ id: sb.id, template: "python", state: "running" });
    expect(await json(await h.req("DELETE", `/v1/sandboxes/${sb.id}`, { key: pro }))).toEqual({
      deleted: true,
      id: sb.id,
    });
    expect((await h.req("DELETE", `/v1/sandboxes/${sb.id}`, { key: pro })).status).toBe(404);
  });

  test("enterprise fork cap 64; demo quota 429; agent at_capacity 503", async () => {
    const sb = await json(await h.req("POST", "/v1/sandboxes", { key: ent, json: { template: "python" } }));
    expect(
      (await h.req("POST", `/v1/sandboxes/${sb.id}/fork`, { key: ent, json: { count: 65 } })).status,
    ).toBe(400);
    expect(
      (await h.req("POST", `/v1/sandboxes/${sb.id}/fork`, { key: ent, json: { count: 40 } })).status,
    ).toBe(200);

    const k = await h.key("demo-co", "demo");
    for (let i = 0; i < h.config.limits.sandboxQuotaByTier.demo; i++) {
      expect((await h.req("POST", "/v1/sandboxes", { key: k, json: { template: "python" } })).status).toBe(
        201,
      );
    }
    const over = await h.req("POST", "/v1/sandboxes", { key: k, json: { template: "python" } });
    expect(over.status).toBe(429);
    expect((await json(over)).code).toBe("quota_exceeded");

    const saved = h.agent.slotsFree;
    h.agent.slotsFree = 0;
    const full = await h.req("POST", "/v1/sandboxes", { key: pro, json: { template: "python" } });
    h.agent.slotsFree = saved;
    expect(full.status).toBe(503);
    expect((await json(full)).code).toBe("at_capacity");
  });

  test("usage: malformed window 400; metrics are Prometheus text", async () => {
    expect((await h.req("GET", "/v1/usage?from=yesterday", { key: pro })).status).toBe(400);
    expect(
      (await h.req("GET", "/v1/usage?from=2025-03-02T00:00:00Z&to=2025-03-01T00:00:00Z", { key: pro }))
        .status,
    ).toBe(400);
    const u = await json(
      await h.req("GET", "/v1/usage?from=2025-01-01T00:00:00Z&to=2025-12-01T00:00:00Z", { key: pro }),
    );
    expect(u.totals.cpu_core_hours).toBeGreaterThan(0);
    const m = await h.req("GET", "/v1/metrics", { key: pro });
    expect(m.headers.get("content-type")).toStartWith("text/plain");
    const text = await m.text();
    expect(text).toContain('sandboxd_build_info{version="test-1"} 1');
    expect(text).toMatch(/sandboxd_sandboxes\{kind="sandbox",state="running"\} \d+/);
  });

  test("an agent error that is not a public code becomes a 500 without detail", async () => {
    const orig = h.agent.execOnce.bind(h.agent);
    h.agent.execOnce = async () => {
      throw new Error("secret internal path /var/lib/x");
    };
    const res = await h.req("POST", "/v1/exec", { key: live, json: { code: "x", template_id: "python" } });
    h.agent.execOnce = orig;
    expect(res.status).toBe(500);
    expect(await json(res)).toEqual({ code: "internal", message: "internal error" });
  });
});
