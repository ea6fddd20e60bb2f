/**
 * Idle lifetimes on the database (gateway/core/idle.ts, sandboxes.ts reapIdleSessions): the
 * reaper's claim of a sandboxes API sandbox idle past its `idle_timeout_seconds` (several gateways
 * racing suspend it once), what keeps one from being claimed (a call in flight, no lifetime, not
 * idle long enough), the `delete` action, the suspended-quota fallback, the transparent resume
 * on the next exec (concurrent calls resume once) beside the user's suspend, which keeps refusing,
 * and a session's own TTL. Real PGlite, and real PostgreSQL where its binaries are installed, with
 * a second gateway on its own connection pool; the agent is the in-memory stand-in, which only
 * answers the calls the claims let through. With real VMs through the service:
 * tests/e2e/idle-lifetime.test.ts.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { eq } from "drizzle-orm";
import type { Db } from "../../db/client.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { usageIntervals } from "../../db/schema/usage-intervals.ts";
import { verifyKey } from "../../gateway/auth/keys.ts";
import { suspendIdleSandboxes, wakeIfIdle } from "../../gateway/core/idle.ts";
import { beginUse, reapIdleSessions, touchRelayed } from "../../gateway/core/sandboxes.ts";
import type { Deps } from "../../gateway/deps.ts";
import { RelayRegistry } from "../../gateway/relay/registry.ts";
import type { Harness } from "../support/gateway-harness.ts";
import { gatewayDeps, onBothDatabases } from "../support/postgres-suite.ts";

let h: Harness;
let pro: string;
let live: string;
let others: Db[] = [];

/** One gateway's view over `db` (by default h's). */
const gateway = (db: Db = h.handle.db): Deps => gatewayDeps(h, db);

async function newSandbox(json: Record<string, unknown> = {}): Promise<string> {
  const res = await h.req("POST", "/v1/sandboxes", { key: pro, json: { template: "python", ...json } });
  expect(res.status).toBe(201);
  return ((await res.json()) as { id: string }).id;
}

async function rowOf(id: string) {
  const [row] = await h.handle.db.select().from(sandboxes).where(eq(sandboxes.id, id));
  return row!;
}

async function info(id: string): Promise<Record<string, unknown>> {
  const res = await h.req("GET", `/v1/sandboxes/${id}`, { key: pro });
  expect(res.status).toBe(200);
  return (await res.json()) as Record<string, unknown>;
}

/** The sandbox's usage intervals, oldest first, as `state` or `state+open`. */
async function intervals(id: string): Promise<string[]> {
  const ivs = await h.handle.db
    .select()
    .from(usageIntervals)
    .where(eq(usageIntervals.sandboxId, id))
    .orderBy(usageIntervals.startedAt, usageIntervals.id);
  return ivs.map((iv) => (iv.endedAt === null ? `${iv.state}+open` : iv.state));
}

/** Every reaper claim of one pass, on each gateway's connection at once. */
async function racePasses(): Promise<string[]> {
  const dbs = [h.handle.db, ...others, h.handle.db];
  const passes = await Promise.all(
    dbs.flatMap((db) => [suspendIdleSandboxes(gateway(db)), reapIdleSessions(gateway(db))]),
  );
  return passes.flat();
}

function suite(name: string, open: () => Promise<{ harness: Harness; others: Db[] }>): void {
  describe(name, () => {
    beforeAll(async () => {
      ({ harness: h, others } = await open());
      pro = await h.key("acme", "pro");
      live = await h.key("acme-a", "live");
    });
    afterAll(() => h.close());

    test("reapers of several gateways suspend an idle sandbox once; info and usage show it", async () => {
      const id = await newSandbox({ idle_timeout_seconds: 3, idle_action: "suspend" });
      expect(await info(id)).toMatchObject({ idle_timeout_seconds: 3, idle_action: "suspend" });
      h.now.ms += 2000;
      expect(await racePasses()).not.toContain(id);
      h.now.ms += 2000;
      expect((await racePasses()).filter((x) => x === id)).toHaveLength(1);
      const row = await rowOf(id);
      expect({ state: row.state, by: row.suspendedBy, hold: row.hold }).toEqual({
        state: "suspended",
        by: "idle",
        hold: null,
      });
      expect(await info(id)).toMatchObject({ state: "suspended", suspended_by: "idle" });
      expect(await intervals(id)).toEqual(["running", "suspended+open"]);
    });

    test("without a lifetime, with a call in flight, or with a user's hold, nothing is claimed", async () => {
      const plain = await newSandbox();
      const busy = await newSandbox({ idle_timeout_seconds: 3 });
      const held = await newSandbox({ idle_timeout_seconds: 3 });
      // An exec (or an open connect relay) on another gateway, counted in the row.
      await h.handle.db
        .update(sandboxes)
        .set({ execsInFlight: 1, lastExecAt: new Date(h.now.ms) })
        .where(eq(sandboxes.id, busy));
      // A user's suspend in flight on another gateway holds the record.
      await h.handle.db
        .update(sandboxes)
        .set({ hold: "suspend", holdUntil: new Date(h.now.ms + 60_000) })
        .where(eq(sandboxes.id, held));
      h.now.ms += 30_000;
      const claimed = await racePasses();
      for (const id of [plain, busy, held]) expect(claimed).not.toContain(id);
      expect((await info(busy)).idle_secs).toBe(0);
      expect((await rowOf(plain)).state).toBe("running");
      // That user's suspend failed: its hold ends (it would count toward the suspended quota).
      await h.handle.db.update(sandboxes).set({ hold: null, holdUntil: null }).where(eq(sandboxes.id, held));
    });

    test("a long call (a file transfer, a followed log) outlasting any exec is kept fresh, not reaped", async () => {
      const id = await newSandbox({ idle_timeout_seconds: 3 });
      const deps = { ...gateway(), relays: new RelayRegistry(() => h.now.ms) };
      const principal = (await verifyKey(h.handle.db, h.config.keyPepper, pro))!;
      // The path the file and process routes take (files.ts, core/processes.ts).
      const use = await beginUse(deps, principal, id);
      // Past the cutoff after which a count in flight is taken for a dead gateway's: each reaper
      // pass first touches what this gateway holds open (reaper.ts).
      const stale = (h.config.limits.maxExecTimeoutS + 600) * 1000;
      for (let i = 0; i < 3; i++) {
        h.now.ms += stale / 2;
        await touchRelayed(deps);
        expect(await racePasses()).not.toContain(id);
      }
      expect((await rowOf(id)).execsInFlight).toBe(1);
      await use.end();
      h.now.ms += 4000;
      expect(await racePasses()).toContain(id);
    });

    test("an exec on a sandbox the reaper suspended resumes it first; concurrent calls resume once", async () => {
      const id = await newSandbox({ idle_timeout_seconds: 3 });
      h.now.ms += 4000;
      expect(await suspendIdleSandboxes(gateway())).toContain(id);
      const execs = await Promise.all(
        [1, 2].map(() =>
          h.req("POST", `/v1/sandboxes/${id}/exec`, { key: pro, json: { command: "echo hi" } }),
        ),
      );
      // One exec runs, the other finds it in flight (busy) or after it (200): never a refusal
      // for the state, and never a second resume.
      for (const r of execs) expect([200, 409]).toContain(r.status);
      expect(execs.some((r) => r.status === 200)).toBe(true);
      for (const r of execs) {
        if (r.status === 409) expect(((await r.json()) as { code: string }).code).toBe("busy");
      }
      const p = {
        tenantId: (await rowOf(id)).tenantId,
        keyId: "",
        tier: "pro" as const,
        api: "sandboxes" as const,
      };
      await Promise.all([1, 2, 3].map(() => wakeIfIdle(gateway(), p, id)));
      expect(await intervals(id)).toEqual(["running", "suspended", "running+open"]);
      const row = await rowOf(id);
      expect({ state: row.state, by: row.suspendedBy }).toEqual({ state: "running", by: null });
      // The resume counts as activity: a whole timeout before the next idle suspend.
      h.now.ms += 2000;
      expect(await suspendIdleSandboxes(gateway())).not.toContain(id);
    });

    test("a sandbox the user suspended keeps refusing exec (409) and is not resumed", async () => {
      const id = await newSandbox({ idle_timeout_seconds: 3 });
      expect((await h.req("POST", `/v1/sandboxes/${id}/suspend`, { key: pro })).status).toBe(200);
      expect(await info(id)).toMatchObject({ state: "suspended", suspended_by: "user" });
      const r = await h.req("POST", `/v1/sandboxes/${id}/exec`, { key: pro, json: { command: "true" } });
      expect(r.status).toBe(409);
      expect(((await r.json()) as { code: string }).code).toBe("conflict");
      expect((await rowOf(id)).state).toBe("suspended");
    });

    test("idle_action delete: the reaper deletes it, later calls get 404, its metering ends", async () => {
      const id = await newSandbox({ idle_timeout_seconds: 3, idle_action: "delete" });
      const vmId = (await rowOf(id)).vmId!;
      h.now.ms += 4000;
      expect((await racePasses()).filter((x) => x === id)).toHaveLength(1);
      expect(h.agent.calls.filter((c) => c.startsWith(`destroy ${vmId} `))).toHaveLength(1);
      const res = await h.req("GET", `/v1/sandboxes/${id}`, { key: pro });
      expect(res.status).toBe(404);
      expect(((await res.json()) as { message: string }).message).toContain("deleted after being idle");
      expect(await intervals(id)).toEqual(["running"]);
    });

    test("a full suspended quota leaves the idle sandbox running, said once in the log", async () => {
      const quota = h.config.limits.suspendedQuotaByTier;
      const saved = quota.pro;
      try {
        // Room for the sandboxes already suspended by earlier tests only.
        const suspended = await h.handle.db.select().from(sandboxes).where(eq(sandboxes.state, "suspended"));
        quota.pro = suspended.length;
        const id = await newSandbox({ idle_timeout_seconds: 3 });
        h.now.ms += 4000;
        const lines: string[] = [];
        const refused = new Set<string>();
        expect(await suspendIdleSandboxes(gateway(), (l) => lines.push(l), refused)).not.toContain(id);
        expect(await suspendIdleSandboxes(gateway(), (l) => lines.push(l), refused)).not.toContain(id);
        expect(lines.filter((l) => l.includes(id) && l.includes("stays running"))).toHaveLength(1);
        const row = await rowOf(id);
        expect({ state: row.state, hold: row.hold, by: row.suspendedBy }).toEqual({
          state: "running",
          hold: null,
          by: null,
        });
        // Room again: the next pass suspends it.
        quota.pro = suspended.length + 1;
        expect(await suspendIdleSandboxes(gateway(), (l) => lines.push(l), refused)).toContain(id);
      } finally {
        quota.pro = saved;
      }
    });

    test("a session's own idle_timeout_seconds overrides the operator's TTL; suspend is refused", async () => {
      const res = await h.req("POST", "/v1/sessions", {
        key: live,
        json: { template_id: "python", idle_timeout_seconds: 5 },
      });
      expect(res.status).toBe(201);
      const sid = ((await res.json()) as { session_id: string }).session_id;
      expect(h.config.limits.sessionIdleTtlS).toBeGreaterThan(6);
      h.now.ms += 6000;
      expect(await reapIdleSessions(gateway())).toContain(sid);
      expect((await h.req("GET", `/v1/sessions/${sid}`, { key: live })).status).toBe(410);
      const bad = await h.req("POST", "/v1/sessions", {
        key: live,
        json: { template_id: "python", idle_timeout_seconds: 5, idle_action: "suspend" },
      });
      expect(bad.status).toBe(400);
      const tooLong = await h.req("POST", "/v1/sandboxes", {
        key: pro,
        json: { template: "python", idle_timeout_seconds: 7 * 24 * 3600 + 1 },
      });
      expect(tooLong.status).toBe(400);
    });
  });
}

onBothDatabases(suite);
