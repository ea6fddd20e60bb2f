/**
 * Snapshots a tenant keeps, through the gateway app (gateway/core/snapshots.ts): take, list, info,
 * delete, and sandboxes started from one; the tenant's cap; the states a call may start from;
 * another tenant neither sees, uses nor deletes one; a delete while a sandbox made from the
 * snapshot runs leaves that sandbox's files to the agent until it ends; a snapshot whose host is
 * lost is gone. Real PGlite; the agent is the in-memory stand-in (it keeps a snapshot's files and
 * processes and drops them with the last VM made from it, as the agent's chain store does): every
 * rule checked here runs in the gateway. With real VMs: tests/vm/snapshots.test.ts.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { eq } from "drizzle-orm";
import { agents } from "../../db/schema/agents.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { type Harness, makeHarness } from "../support/gateway-harness.ts";

let h: Harness;
let pro: string;
let other: string;

type Json = Record<string, unknown>;
const json = async (res: Response) => (await res.json()) as Json;

async function newSandbox(key = pro, body: Json = { template: "python" }): Promise<Json> {
  const res = await h.req("POST", "/v1/sandboxes", { key, json: body });
  expect(res.status).toBe(201);
  return json(res);
}

async function cat(id: string, path: string): Promise<string> {
  const res = await h.req("POST", `/v1/sandboxes/${id}/exec`, { key: pro, json: { command: `cat ${path}` } });
  expect(res.status).toBe(200);
  return (await json(res)).stdout as string;
}

async function writeFile(id: string, path: string, content: string): Promise<void> {
  const res = await h.req("POST", `/v1/sandboxes/${id}/exec`, {
    key: pro,
    json: { files: [{ path, content }] },
  });
  expect(res.status).toBe(200);
}

async function snapshot(id: string, body: Json = {}, key = pro): Promise<Response> {
  return h.req("POST", `/v1/sandboxes/${id}/snapshots`, { key, json: body });
}

describe("snapshots through the gateway", () => {
  beforeAll(async () => {
    // A cap of 2 (the tier's default is larger) to reach it in a few calls.
    h = await makeHarness({ limits: { snapshotQuotaByTier: { ...QUOTA, pro: 2 } } });
    pro = await h.key("acme", "pro");
    other = await h.key("globex", "pro");
  });
  afterAll(() => h.close());

  test("take, read, start two sandboxes from it: files and processes as they were", async () => {
    const src = (await newSandbox()).id as string;
    await writeFile(src, "/work/a.txt", "before");
    const proc = await h.req("POST", `/v1/sandboxes/${src}/processes`, {
      key: pro,
      json: { command: "counter" },
    });
    expect(proc.status).toBe(201);

    const res = await snapshot(src, { name: "base", labels: { stage: "one" } });
    expect(res.status).toBe(201);
    const snap = await json(res);
    expect(snap).toMatchObject({
      state: "ready",
      source_sandbox: src,
      template: "python",
      name: "base",
      labels: { stage: "one" },
    });
    expect(snap.id).toMatch(/^snap_[a-z0-9]+$/);
    expect(snap.size_bytes as number).toBeGreaterThan(0);
    expect(typeof snap.ready_at).toBe("string");

    // The source runs on and changes after the snapshot; the snapshot does not.
    await writeFile(src, "/work/a.txt", "after");
    expect(await cat(src, "/work/a.txt")).toBe("after");

    const kids = [
      await newSandbox(pro, { snapshot: snap.id, label: "k1" }),
      await newSandbox(pro, { snapshot: snap.id }),
    ];
    for (const kid of kids) {
      expect(kid).toMatchObject({ template: "python", snapshot: snap.id, state: "running" });
      expect(await cat(kid.id as string, "/work/a.txt")).toBe("before");
      const procs = await h.req("GET", `/v1/sandboxes/${kid.id}/processes`, { key: pro });
      expect(((await json(procs)).processes as Json[]).map((p) => p.command)).toEqual(["counter"]);
      const [row] = await h.handle.db
        .select()
        .from(sandboxes)
        .where(eq(sandboxes.id, kid.id as string));
      expect(row!.snapshotId).toBe(snap.id as string);
    }
    // They diverge: one's write is not the other's.
    await writeFile(kids[0]!.id as string, "/work/a.txt", "k1");
    expect(await cat(kids[1]!.id as string, "/work/a.txt")).toBe("before");

    const got = await h.req("GET", `/v1/snapshots/${snap.id}`, { key: pro });
    expect(await json(got)).toEqual(snap);
    for (const kid of kids) await h.req("DELETE", `/v1/sandboxes/${kid.id}`, { key: pro });
    expect((await h.req("DELETE", `/v1/snapshots/${snap.id}`, { key: pro })).status).toBe(200);
    expect(h.agent.snapshots.has(snap.id as string)).toBe(false);
    expect((await h.req("GET", `/v1/snapshots/${snap.id}`, { key: pro })).status).toBe(404);
  });

  test("another tenant cannot see, use or delete it", async () => {
    const src = (await newSandbox()).id as string;
    const snap = await json(await snapshot(src));
    const id = snap.id as string;
    expect((await h.req("GET", `/v1/snapshots/${id}`, { key: other })).status).toBe(404);
    const list = await json(await h.req("GET", "/v1/snapshots", { key: other }));
    expect(list.snapshots).toEqual([]);
    const use = await h.req("POST", "/v1/sandboxes", { key: other, json: { snapshot: id } });
    expect(use.status).toBe(404);
    expect((await json(use)).code).toBe("not_found");
    expect((await h.req("DELETE", `/v1/snapshots/${id}`, { key: other })).status).toBe(404);
    // Nor snapshot another tenant's sandbox.
    expect((await snapshot(src, {}, other)).status).toBe(404);
    // Still the owner's, untouched.
    expect((await h.req("GET", `/v1/snapshots/${id}`, { key: pro })).status).toBe(200);
    expect(h.agent.snapshots.get(id)?.deleting).toBe(false);
    expect((await h.req("DELETE", `/v1/snapshots/${id}`, { key: pro })).status).toBe(200);
  });

  test("a sandbox from a snapshot has the absolute lifetime its create asked for", async () => {
    const src = (await newSandbox()).id as string;
    const snap = await json(await snapshot(src));
    const kid = (await newSandbox(pro, { snapshot: snap.id, timeout_seconds: 600, on_timeout: "suspend" }))
      .id as string;
    const info = await json(await h.req("GET", `/v1/sandboxes/${kid}`, { key: pro }));
    expect(info).toMatchObject({ timeout_seconds: 600, on_timeout: "suspend" });
    expect(Date.parse(info.expires_at as string) - h.now.ms).toBe(600_000);
    for (const id of [kid, src])
      expect((await h.req("DELETE", `/v1/sandboxes/${id}`, { key: pro })).status).toBe(200);
    expect((await h.req("DELETE", `/v1/snapshots/${snap.id}`, { key: pro })).status).toBe(200);
  });

  test("the cap: a third kept snapshot is 429; a delete makes room; a failed one does not count", async () => {
    const src = (await newSandbox()).id as string;
    const a = await json(await snapshot(src, { name: "a" }));
    h.now.ms += 1000;
    const b = await json(await snapshot(src, { name: "b" }));
    const third = await snapshot(src);
    expect(third.status).toBe(429);
    expect(await json(third)).toMatchObject({ code: "quota_exceeded" });

    const list = await json(await h.req("GET", "/v1/snapshots", { key: pro }));
    expect((list.snapshots as Json[]).map((s) => s.id)).toEqual([b.id, a.id]);
    const one = await json(await h.req("GET", "/v1/snapshots?limit=1", { key: pro }));
    expect((one.snapshots as Json[]).map((s) => s.id)).toEqual([b.id]);
    expect((await h.req("GET", "/v1/snapshots?limit=0", { key: pro })).status).toBe(400);

    expect((await h.req("DELETE", `/v1/snapshots/${a.id}`, { key: pro })).status).toBe(200);
    // The agent refuses this one (an exec in flight): it ends failed, kept visible, not counted.
    const busy = h.agent.vms.get(await vmOf(src));
    busy!.busy = true;
    const refused = await snapshot(src);
    busy!.busy = false;
    expect(refused.status).toBe(409);
    const failed = ((await json(await h.req("GET", "/v1/snapshots", { key: pro }))).snapshots as Json[]).find(
      (s) => s.state === "failed",
    );
    expect(failed?.error).toContain("in flight");
    const c = await snapshot(src);
    expect(c.status).toBe(201);
    for (const s of [b, failed!, await json(c)])
      expect((await h.req("DELETE", `/v1/snapshots/${s.id}`, { key: pro })).status).toBe(200);
  });

  test("a suspended sandbox cannot be snapshot; a bad body or a template and a snapshot are 400", async () => {
    const src = (await newSandbox()).id as string;
    expect((await h.req("POST", `/v1/sandboxes/${src}/suspend`, { key: pro })).status).toBe(200);
    const res = await snapshot(src);
    expect(res.status).toBe(409);
    expect((await h.req("GET", "/v1/snapshots", { key: pro }).then(json)).snapshots).toEqual([]);
    await h.req("POST", `/v1/sandboxes/${src}/resume`, { key: pro });
    const snap = await json(await snapshot(src));
    const both = await h.req("POST", "/v1/sandboxes", {
      key: pro,
      json: { template: "python", snapshot: snap.id },
    });
    expect(both.status).toBe(400);
    expect((await h.req("POST", "/v1/sandboxes", { key: pro, json: {} })).status).toBe(400);
    expect((await snapshot(src, { labels: { x: 1 } })).status).toBe(400);
    await h.req("DELETE", `/v1/snapshots/${snap.id}`, { key: pro });
  });

  test("a delete while a sandbox made from it runs: gone for the API, files kept until that sandbox ends", async () => {
    const src = (await newSandbox()).id as string;
    await writeFile(src, "/work/b.txt", "kept");
    const snap = await json(await snapshot(src));
    const id = snap.id as string;
    const kid = (await newSandbox(pro, { snapshot: id })).id as string;
    expect((await h.req("DELETE", `/v1/snapshots/${id}`, { key: pro })).status).toBe(200);
    expect((await h.req("GET", `/v1/snapshots/${id}`, { key: pro })).status).toBe(404);
    expect((await h.req("POST", "/v1/sandboxes", { key: pro, json: { snapshot: id } })).status).toBe(404);
    // Its sandbox runs on with its files; the agent frees the snapshot with it.
    expect(await cat(kid, "/work/b.txt")).toBe("kept");
    expect(h.agent.snapshots.get(id)?.deleting).toBe(true);
    await h.req("DELETE", `/v1/sandboxes/${kid}`, { key: pro });
    expect(h.agent.snapshots.has(id)).toBe(false);
    // A second delete is a 404, as for any deleted resource.
    expect((await h.req("DELETE", `/v1/snapshots/${id}`, { key: pro })).status).toBe(404);
  });

  test("a snapshot whose host was lost is gone: creating from it is 410, deleting it needs no agent", async () => {
    const src = (await newSandbox()).id as string;
    const snap = await json(await snapshot(src));
    const [row] = await h.handle.db.select().from(sandboxes).where(eq(sandboxes.id, src));
    await h.handle.db
      .update(agents)
      .set({ lostAt: new Date(h.now.ms) })
      .where(eq(agents.id, row!.agentId));
    try {
      const res = await h.req("POST", "/v1/sandboxes", { key: pro, json: { snapshot: snap.id } });
      expect(res.status).toBe(410);
      expect((await json(res)).message).toContain("lost or removed");
      const calls = h.agent.calls.length;
      expect((await h.req("DELETE", `/v1/snapshots/${snap.id}`, { key: pro })).status).toBe(200);
      expect(h.agent.calls.slice(calls)).toEqual([]);
    } finally {
      await h.handle.db.update(agents).set({ lostAt: null }).where(eq(agents.id, row!.agentId));
    }
  });
});

const QUOTA = { live: 0, scale: 0, demo: 2, pro: 2, enterprise: 2 };

async function vmOf(id: string): Promise<string> {
  const [row] = await h.handle.db.select().from(sandboxes).where(eq(sandboxes.id, id));
  return row!.vmId!;
}
