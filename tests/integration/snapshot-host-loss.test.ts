/**
 * Kept snapshots of a lost host and of one that comes back (docs/snapshots.md "A lost host"), and
 * of a live host that loses one's files ("Files gone from a live host"),
 * through the gateway app with the real router, reconciler and host-loss sweeper over in-memory
 * agents (tests/support/fleet-harness.ts, as tests/integration/host-loss.test.ts), on PGlite and
 * a real PostgreSQL. Bounds are shortened (heartbeat 250 ms, stale 2 s, lost 3 s, sweep 250 ms)
 * so the real clock can run them.
 */
import { afterEach, describe, expect, test } from "bun:test";
import { eq, inArray } from "drizzle-orm";
import { agents } from "../../db/schema/agents.ts";
import { snapshots } from "../../db/schema/snapshots.ts";
import { setCordon } from "../../gateway/agents/fleet.ts";
import { reconcileAgent } from "../../gateway/core/reconcile.ts";
import { usageReport } from "../../gateway/core/usage.ts";
import { type FleetHarness, makeFleet } from "../support/fleet-harness.ts";
import { databaseCases } from "../support/postgres-suite.ts";
import { until } from "../support/until.ts";

/** host-loss.test.ts's bounds: the defaults scaled down 20 times, with room for a loaded host. */
const BEAT_MS = 250;
const STALE_MS = 2000;
const LOST_MS = 3000;
const SWEEP_MS = 250;
/** Whole-test bound: opening a fresh PGlite (its migrations) took 18 s on a loaded test host. */
const TEST_MS = 90_000;
/** Detection is due at LOST_MS plus a sweep; the rest is room for a loaded test host. */
const DETECT_WITHIN_MS = LOST_MS + 7000;

// biome-ignore lint/suspicious/noExplicitAny: response bodies are checked field by field
type Body = Record<string, any>;

const cleanups: (() => Promise<void>)[] = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

/** A fleet of `ids` for one test (its own region and tenant), with its snapshot cap, and helpers. */
async function fleetOf(url: string | undefined, ids: string[], snapshotCap: number) {
  const h: FleetHarness = await makeFleet({
    ...(url !== undefined ? { url } : {}),
    ids,
    region: `eu-${ids[0]}`,
    limits: {
      sandboxQuotaByTier: { live: 0, scale: 0, demo: 0, pro: 2, enterprise: 0 },
      snapshotQuotaByTier: { live: 0, scale: 0, demo: 0, pro: snapshotCap, enterprise: 0 },
    },
    staleAfterMs: STALE_MS,
    lostAfterMs: LOST_MS,
    sweepMs: SWEEP_MS,
    beatMs: BEAT_MS,
  });
  cleanups.push(() => h.close());
  const db = h.handle.db;
  const key = await h.key(ids[0]!);
  const json = async (res: Response, status: number): Promise<Body> => {
    const b = (await res.json()) as Body;
    if (res.status !== status) throw new Error(`${res.status}: ${JSON.stringify(b)}`);
    return b;
  };
  const stateOf = async (id: string) => (await db.select().from(snapshots).where(eq(snapshots.id, id)))[0]!;
  return { h, db, key, json, stateOf };
}

const { cases } = databaseCases();

for (const c of cases) {
  describe(`snapshots of a lost host (${c.name})`, () => {
    test(
      "lost: state lost, not counted, 410 to start from, deleted without the agent; back: ready again if its files are there, dropped if deleted meanwhile",
      async () => {
        const [A, B] = ["snaplost-a", "snaplost-b"]; // one PostgreSQL serves every test of the file
        // Three kept at most: the fourth, after the loss, fits only if lost ones do not count.
        const { h, db, key, json, stateOf } = await fleetOf(c.url ? await c.url() : undefined, [A, B], 3);

        // A sandbox on a (b cordoned), and three snapshots of it, kept on a.
        await setCordon(db, B, true, new Date());
        const src = (
          await json(await h.req("POST", "/v1/sandboxes", { key, json: { template: "python" } }), 201)
        ).id as string;
        await setCordon(db, B, false, new Date());
        const take = async (sbx: string) =>
          (await json(await h.req("POST", `/v1/sandboxes/${sbx}/snapshots`, { key, json: {} }), 201))
            .id as string;
        const [back, deleted, vanished] = [await take(src), await take(src), await take(src)];
        expect((await stateOf(back)).agentId).toBe(A);
        expect((await h.req("POST", `/v1/sandboxes/${src}/snapshots`, { key, json: {} })).status).toBe(429);

        // a falls silent, after a beat that followed the snapshots (one ready after a's last
        // beat is metered for nothing: its interval ends where it starts).
        const newest = (await stateOf(vanished)).readyAt!.getTime();
        await until(async () => {
          const [r] = await db.select().from(agents).where(eq(agents.id, A));
          return r!.lastHeartbeatAt!.getTime() > newest;
        }, 5000);
        // Its snapshots read lost, metered until its last heartbeat.
        await h.beating(A, false);
        await until(async () => (await stateOf(back)).state === "lost", DETECT_WITHIN_MS);
        await until(async () => (await stateOf(vanished)).state === "lost", 2000);
        const [aRow] = await db.select().from(agents).where(eq(agents.id, A));
        const lastBeat = aRow!.lastHeartbeatAt!.getTime();
        for (const id of [back, deleted, vanished]) {
          const row = await stateOf(id);
          expect(row.state).toBe("lost");
          expect(row.deletedAt!.getTime()).toBe(Math.max(lastBeat, row.readyAt!.getTime()));
        }
        const info = await json(await h.req("GET", `/v1/snapshots/${back}`, { key }), 200);
        expect(info.state).toBe("lost");
        expect(info.error).toStartWith(`host_lost: its host, agent ${A}, was lost`);
        const listed = await json(await h.req("GET", "/v1/snapshots?state=lost", { key }), 200);
        expect(listed.snapshots.map((s: Body) => s.id).sort()).toEqual([back, deleted, vanished].sort());
        // Creating from one is 410; the cap no longer counts them: a new one (of a sandbox on b).
        const from = await h.req("POST", "/v1/sandboxes", { key, json: { snapshot: back } });
        expect(from.status).toBe(410);
        const srcB = (
          await json(await h.req("POST", "/v1/sandboxes", { key, json: { template: "python" } }), 201)
        ).id as string;
        const onB = await take(srcB);
        expect((await stateOf(onB)).agentId).toBe(B);
        // A delete needs no agent, and keeps the end of its metering.
        const callsBefore = h.agents.get(A)!.calls.length;
        const lostUntil = (await stateOf(deleted)).deletedAt!.getTime();
        expect((await h.req("DELETE", `/v1/snapshots/${deleted}`, { key })).status).toBe(200);
        expect(h.agents.get(A)!.calls.length).toBe(callsBefore);
        expect((await stateOf(deleted)).deletedAt!.getTime()).toBe(lostUntil);

        // While away, a lost the files of one of them.
        h.agents.get(A)!.snapshots.delete(vanished);
        // a comes back: the one whose files it lists is ready again, the deleted one is dropped
        // on it, the vanished one stays lost.
        await h.beating(A, true);
        await until(async () => (await stateOf(back)).state === "ready", 10_000);
        await until(() => !h.agents.get(A)!.snapshots.has(deleted), 10_000);
        expect(h.agents.get(A)!.calls).toContain(`delete-snapshot ${deleted}`);
        const revived = await stateOf(back);
        expect([revived.deletedAt, revived.error]).toEqual([null, null]);
        expect((await stateOf(vanished)).state).toBe("lost");
        expect((await stateOf(deleted)).state).toBe("deleted");
        expect(
          h.logs.some((l) => l.includes(`snapshot ${back} ready again: its files are on agent ${A}`)),
        ).toBe(true);
        // Ready, it counts again (two kept now: back and onB) and a sandbox starts from it, on a.
        const kid = await json(await h.req("POST", "/v1/sandboxes", { key, json: { snapshot: back } }), 201);
        expect(kid.snapshot).toBe(back);
        // Metered: the revived one up to now (its files were kept throughout), the lost ones to
        // a's last heartbeat.
        const tenantId = revived.tenantId;
        const lines = await usageReport(db, {
          tenantId,
          from: new Date(0),
          to: new Date(Date.now() + 3_600_000),
          now: new Date(lastBeat + 3_600_000),
          by: "sandbox",
        });
        const gbMonths = (id: string) => lines.find((l) => l.sandbox_id === id)!.snapshot_gb_months;
        const rows = await db
          .select()
          .from(snapshots)
          .where(inArray(snapshots.id, [back, vanished]));
        const gib = (id: string) => rows.find((r) => r.id === id)!.sizeBytes! / 1024 ** 3;
        const readyAt = (id: string) => rows.find((r) => r.id === id)!.readyAt!.getTime();
        expect(gbMonths(vanished)).toBeCloseTo(
          (gib(vanished) * (Math.max(lastBeat, readyAt(vanished)) - readyAt(vanished))) / 3_600_000 / 730,
          12,
        );
        expect(gbMonths(back)).toBeCloseTo(
          (gib(back) * (lastBeat + 3_600_000 - readyAt(back))) / 3_600_000 / 730,
          12,
        );
      },
      TEST_MS,
    );

    test(
      "files gone from a live host: the pass marks the ready snapshot lost (410, not counted, metered to the pass), the others stay; files back, ready again",
      async () => {
        const A = "snapfiles-a";
        const { h, db, key, json, stateOf } = await fleetOf(c.url ? await c.url() : undefined, [A], 2);
        const pass = () =>
          reconcileAgent({ db, clock: Date.now, placement: h.router }, A, "test", h.logs.push.bind(h.logs));
        const src = (
          await json(await h.req("POST", "/v1/sandboxes", { key, json: { template: "python" } }), 201)
        ).id as string;
        const take = async () =>
          (await json(await h.req("POST", `/v1/sandboxes/${src}/snapshots`, { key, json: {} }), 201))
            .id as string;
        const [gone, kept] = [await take(), await take()];
        expect((await h.req("POST", `/v1/sandboxes/${src}/snapshots`, { key, json: {} })).status).toBe(429);
        // A pass over a host that has them all changes nothing.
        await pass();
        expect([(await stateOf(gone)).state, (await stateOf(kept)).state]).toEqual(["ready", "ready"]);

        // The host runs on and loses one snapshot's files (its records removed).
        const agent = h.agents.get(A)!;
        const files = agent.snapshots.get(gone)!;
        // The harness's own reconciler may run a pass too (a heartbeat after a gap on a loaded
        // host): either pass marks it, once, so the bounds and the log are any pass's.
        const before = Date.now();
        agent.snapshots.delete(gone);
        await pass();
        const after = Date.now();
        const row = await stateOf(gone);
        expect(row.state).toBe("lost");
        expect(row.error).toStartWith(`files_lost: its host, agent ${A}, no longer keeps its files`);
        // Metered until the pass that found it missing.
        expect(row.deletedAt!.getTime()).toBeGreaterThanOrEqual(before);
        expect(row.deletedAt!.getTime()).toBeLessThanOrEqual(after);
        expect((await stateOf(kept)).state).toBe("ready");
        const lostLine = `agent ${A}: snapshot ${gone} lost: agent ${A} no longer lists it`;
        expect(h.logs.some((l) => l.endsWith(lostLine))).toBe(true);
        // 410 to start from, saying why; not counted (a new one fits under the cap of two).
        const from = await h.req("POST", "/v1/sandboxes", { key, json: { snapshot: gone } });
        expect(from.status).toBe(410);
        expect(((await from.json()) as Body).message).toContain("files_lost");
        const third = await take();
        expect((await stateOf(third)).state).toBe("ready");

        // Its files come back (the disk remounted): the next pass makes it ready again.
        agent.snapshots.set(gone, files);
        await pass();
        const back = await stateOf(gone);
        expect([back.state, back.deletedAt, back.error]).toEqual(["ready", null, null]);
        const kid = await json(await h.req("POST", "/v1/sandboxes", { key, json: { snapshot: gone } }), 201);
        expect(kid.snapshot).toBe(gone);
      },
      TEST_MS,
    );
  });
}
