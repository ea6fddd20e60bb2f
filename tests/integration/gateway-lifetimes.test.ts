/**
 * Absolute lifetimes (`timeout_seconds`, `on_timeout`, `POST /v1/sandboxes/{id}/timeout`) and the
 * deadline timer (gateway/core/reaper.ts) that acts on them and on idle lifetimes within about a
 * second, not up to one reaper interval late: the interval here is an hour, so only the timer
 * can act in time. The real clock, the real reaper, real PGlite and, where its binaries are
 * installed, real PostgreSQL, there with a second gateway (its own pool, its own reaper and
 * timer) racing the first; the agent is the in-memory stand-in, which records the calls the
 * claims let through. Each lateness is printed as JSON; the assertions give 5 s of slack, since
 * speed lives in bench/. With real VMs: tests/e2e/lifetimes.test.ts.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { eq } from "drizzle-orm";
import { MAX_SANDBOX_TIMEOUT_S } from "../../contracts/api/limits.ts";
import { type Db, openDb } from "../../db/client.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { FixedPlacement } from "../../gateway/agents/placement.ts";
import { Deadlines } from "../../gateway/core/deadlines.ts";
import { startReaper } from "../../gateway/core/reaper.ts";
import type { Deps } from "../../gateway/deps.ts";
import { Sandboxd } from "../../sdk/typescript/src/index.ts";
import { type Harness, makeHarness } from "../support/gateway-harness.ts";
import { databaseCases } from "../support/postgres-suite.ts";
import { until } from "../support/until.ts";

/** Slack on "within about a second": a loaded CI host, and PGlite's single connection. */
const SLACK_MS = 5000;
/** The reaper's interval here: far past every test, so every action on time is the timer's. */
const INTERVAL_S = 3600;

const { cases, havePostgres, postgresUrl } = databaseCases();

for (const db of cases) {
  describe(db.name, () => {
    let h: Harness;
    let key: string;
    let live: string;
    const stops: (() => Promise<void>)[] = [];
    const logs: string[] = [];

    beforeAll(async () => {
      const deadlines = new Deadlines();
      h = await makeHarness({
        ...(db.url ? { url: await db.url() } : {}),
        realClock: true,
        deadlines,
        limits: { reaperIntervalS: INTERVAL_S },
      });
      key = await h.key(`life-${db.name}`, "pro");
      live = await h.key(`life-s-${db.name}`, "live");
      const deps: Deps = {
        db: h.handle.db,
        agent: h.agent,
        placement: new FixedPlacement(h.handle.db, h.agent, h.config.agent),
        config: h.config,
        clock: Date.now,
        deadlines,
      };
      stops.push(startReaper(deps, (line) => logs.push(line)).stop);
    });
    afterAll(async () => {
      for (const stop of stops) await stop();
      await h.close();
    });

    async function create(json: Record<string, unknown>): Promise<string> {
      const res = await h.req("POST", "/v1/sandboxes", { key, json: { template: "python", ...json } });
      expect(res.status).toBe(201);
      return ((await res.json()) as { id: string }).id;
    }
    const rowOf = async (id: string) =>
      (await h.handle.db.select().from(sandboxes).where(eq(sandboxes.id, id)))[0]!;
    const info = async (id: string) => {
      const res = await h.req("GET", `/v1/sandboxes/${id}`, { key });
      return { status: res.status, body: (await res.json()) as Record<string, unknown> };
    };
    /** ms from `deadline` until `done` holds (polled every 20 ms, up to the slack and a bit). */
    async function lateness(deadline: number, done: () => Promise<boolean>): Promise<number> {
      await until(done, Math.max(0, deadline - Date.now()) + SLACK_MS + 2000, 20);
      return Date.now() - deadline;
    }
    const report = (what: string, ms: number) =>
      console.log(JSON.stringify({ lifetime_lateness: what, database: db.name, ms }));

    test("timeout_seconds deletes at the deadline (on_timeout delete is the default); later calls 404", async () => {
      const id = await create({ timeout_seconds: 2 });
      const { body } = await info(id);
      expect(body).toMatchObject({ timeout_seconds: 2, on_timeout: "delete", state: "running" });
      const expires = Date.parse(body.expires_at as string);
      expect(expires - Date.now()).toBeLessThanOrEqual(2000);
      const { vmId } = await rowOf(id);
      const late = await lateness(expires, async () => (await rowOf(id)).state === "destroyed");
      report("timeout_delete", late);
      expect(late).toBeLessThan(SLACK_MS);
      const row = await rowOf(id);
      expect({ reason: row.endReason, expires: row.expiresAt }).toEqual({ reason: "expired", expires: null });
      expect(h.agent.calls.filter((c) => c.startsWith(`destroy ${vmId} `))).toHaveLength(1);
      const gone = await info(id);
      expect(gone.status).toBe(404);
      expect(gone.body.message).toContain("deleted at its timeout");
    });

    test("on_timeout suspend: suspended at the deadline, the next exec resumes it and restarts the lifetime", async () => {
      const id = await create({ timeout_seconds: 2, on_timeout: "suspend" });
      const expires = Date.parse((await info(id)).body.expires_at as string);
      const late = await lateness(expires, async () => (await rowOf(id)).state === "suspended");
      report("timeout_suspend", late);
      expect(late).toBeLessThan(SLACK_MS);
      const held = await info(id);
      expect(held.body).toMatchObject({ state: "suspended", suspended_by: "timeout", timeout_seconds: 2 });
      // Nothing to fear from the deadline while suspended: the next resume counts it again.
      expect(held.body.expires_at).toBeUndefined();
      const exec = await h.req("POST", `/v1/sandboxes/${id}/exec`, { key, json: { command: "echo hi" } });
      expect(exec.status).toBe(200);
      const after = await info(id);
      expect(after.body).toMatchObject({ state: "running" });
      expect(after.body.suspended_by).toBeUndefined();
      const restarted = Date.parse(after.body.expires_at as string);
      expect(restarted).toBeGreaterThan(expires);
      // And it applies again after the resume.
      const again = await lateness(restarted, async () => (await rowOf(id)).state === "suspended");
      expect(again).toBeLessThan(SLACK_MS);
      await h.req("DELETE", `/v1/sandboxes/${id}`, { key });
    }, 20_000);

    test("an idle lifetime of 2 s is acted on by the timer, not the hourly interval", async () => {
      const id = await create({ idle_timeout_seconds: 2, idle_action: "suspend" });
      const exec = await h.req("POST", `/v1/sandboxes/${id}/exec`, { key, json: { command: "true" } });
      expect(exec.status).toBe(200);
      // The idle lifetime counts from the exec's end (written behind, at most 100 ms later).
      await until(async () => (await rowOf(id)).execsInFlight === 0, 5000, 20);
      const deadline = (await rowOf(id)).lastExecAt!.getTime() + 2000;
      const late = await lateness(deadline, async () => (await rowOf(id)).state === "suspended");
      report("idle_suspend", late);
      expect(late).toBeLessThan(SLACK_MS);
      expect((await info(id)).body).toMatchObject({ suspended_by: "idle" });
      await h.req("DELETE", `/v1/sandboxes/${id}`, { key });
    });

    test("a sessions API session's own idle TTL reclaims it on time (410)", async () => {
      const res = await h.req("POST", "/v1/sessions", {
        key: live,
        json: { template_id: "python", idle_timeout_seconds: 1 },
      });
      expect(res.status).toBe(201);
      const id = ((await res.json()) as { session_id: string }).session_id;
      const created = (await rowOf(id)).createdAt.getTime();
      const late = await lateness(created + 1000, async () => (await rowOf(id)).state === "destroyed");
      report("session_ttl", late);
      expect(late).toBeLessThan(SLACK_MS);
      expect((await h.req("GET", `/v1/sessions/${id}`, { key: live })).status).toBe(410);
    });

    test("POST .../timeout sets a new lifetime counted from the call; bounds; a suspended sandbox is deleted at it", async () => {
      const id = await create({ timeout_seconds: 3600, on_timeout: "suspend" });
      for (const bad of [0, MAX_SANDBOX_TIMEOUT_S + 1, 1.5]) {
        const r = await h.req("POST", `/v1/sandboxes/${id}/timeout`, { key, json: { timeout_seconds: bad } });
        expect(r.status).toBe(400);
      }
      // The user's suspend: with a deadline that deletes, the suspended sandbox goes at it.
      expect((await h.req("POST", `/v1/sandboxes/${id}/suspend`, { key })).status).toBe(200);
      const before = Date.now();
      const set = await h.req("POST", `/v1/sandboxes/${id}/timeout`, {
        key,
        json: { timeout_seconds: 2, on_timeout: "delete" },
      });
      expect(set.status).toBe(200);
      const body = (await set.json()) as { timeout_seconds: number; on_timeout: string; expires_at: string };
      expect(body).toMatchObject({ id, timeout_seconds: 2, on_timeout: "delete" });
      const expires = Date.parse(body.expires_at);
      expect(expires).toBeGreaterThanOrEqual(before + 2000);
      expect((await info(id)).body).toMatchObject({ state: "suspended", expires_at: body.expires_at });
      const late = await lateness(expires, async () => (await rowOf(id)).state === "destroyed");
      report("set_timeout_delete_suspended", late);
      expect(late).toBeLessThan(SLACK_MS);
      // An ended sandbox has no timeout to set.
      const after = await h.req("POST", `/v1/sandboxes/${id}/timeout`, { key, json: { timeout_seconds: 5 } });
      expect(after.status).toBe(404);
    });

    test("the TypeScript SDK: timeoutSeconds at create, setTimeout", async () => {
      const client = new Sandboxd({
        baseUrl: "http://gateway.test",
        apiKey: key,
        fetch: (input, init) => Promise.resolve(h.app.request(new Request(String(input), init))),
      });
      const sbx = await client.sandboxes.create({
        template: "python",
        timeoutSeconds: 3600,
        onTimeout: "suspend",
      });
      expect(await sbx.info()).toMatchObject({ timeout_seconds: 3600, on_timeout: "suspend" });
      const before = Date.now();
      const set = await sbx.setTimeout(1);
      expect(set).toMatchObject({ id: sbx.id, timeout_seconds: 1, on_timeout: "suspend" });
      expect(Date.parse(set.expires_at!)).toBeGreaterThanOrEqual(before + 1000);
      await until(async () => (await rowOf(sbx.id)).state === "suspended", SLACK_MS + 2000, 20);
      await sbx.delete();
    });

    test("a deadline a gone gateway wrote (no note reached this one) is found by the re-read", async () => {
      const id = await create({});
      // As another gateway would write it, without telling this process.
      const expires = Date.now() + 1500;
      await h.handle.db
        .update(sandboxes)
        .set({ timeoutS: 1, onTimeout: "delete", expiresAt: new Date(expires) })
        .where(eq(sandboxes.id, id));
      const late = await lateness(expires, async () => (await rowOf(id)).state === "destroyed");
      report("reread", late);
      // Bounded by the re-read period (DEADLINE_REREAD_MS, 5 s), plus the slack.
      expect(late).toBeLessThan(5000 + SLACK_MS);
    }, 20_000);

    if (db.name === "PostgreSQL") {
      test("two gateways with their own timers act on a deadline once", async () => {
        const otherHandle = await openDb({ url: await postgresUrl(), migrate: false });
        const other: Db = otherHandle.db;
        const otherDeadlines = new Deadlines();
        const stopOther = startReaper(
          {
            db: other,
            agent: h.agent,
            placement: new FixedPlacement(other, h.agent, h.config.agent),
            config: h.config,
            clock: Date.now,
            deadlines: otherDeadlines,
          },
          () => {},
        ).stop;
        stops.unshift(async () => {
          await stopOther();
          await otherHandle.close();
        });
        const ids = await Promise.all([1, 2, 3].map(() => create({ timeout_seconds: 1 })));
        const deadlines = await Promise.all(ids.map(async (id) => (await rowOf(id)).expiresAt!.getTime()));
        // Both timers know the deadlines (as if each gateway had written them).
        for (const ms of deadlines) otherDeadlines.note(ms);
        for (const [i, id] of ids.entries()) {
          await lateness(deadlines[i]!, async () => (await rowOf(id)).state === "destroyed");
          const { vmId } = await rowOf(id);
          expect(h.agent.calls.filter((c) => c.startsWith(`destroy ${vmId} `))).toHaveLength(1);
        }
      }, 20_000);
    }
  });
}

if (!havePostgres) test.skip("two gateways: needs PostgreSQL", () => {});
