/**
 * Losing a host, cordon and drain (docs/fleet.md), through the gateway app with the real router,
 * reconciler and host-loss sweeper over in-memory agents (tests/support/fleet-harness.ts), on
 * PGlite and a real PostgreSQL. Bounds are shortened (heartbeat 250 ms, stale 2 s, lost 3 s,
 * sweep 250 ms) so the real clock can run them; the timeline is printed as a JSON line.
 */
import { afterEach, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { and, eq, inArray, isNotNull } from "drizzle-orm";
import { drainAgent, type FleetCalls } from "../../cli/fleet.ts";
import { OPERATOR_OPS } from "../../cli/operator-ops.ts";
import { type Db, openDb } from "../../db/client.ts";
import { agents } from "../../db/schema/agents.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { templates } from "../../db/schema/templates.ts";
import { usageIntervals } from "../../db/schema/usage-intervals.ts";
import { recordHeartbeat } from "../../gateway/agents/registry.ts";
import { ensureTenant } from "../../gateway/auth/keys.ts";
import { HOST_LOST, startHostLossSweeper, sweepLostAgents } from "../../gateway/core/host-loss.ts";
import { usageReport } from "../../gateway/core/usage.ts";
import { type FleetHarness, makeFleet } from "../support/fleet-harness.ts";
import { databaseCases } from "../support/postgres-suite.ts";
import { until } from "../support/until.ts";

/**
 * The defaults scaled down 20 times (heartbeat 5 s, stale 15 s -> 2 s with slack, lost 60 s):
 * short enough for a test, long enough that a busy 2-core test host (PGlite runs in this
 * process; a create held the event loop for 1.7 s in one run) never makes a live agent look stale.
 */
const BEAT_MS = 250;
const STALE_MS = 2000;
const LOST_MS = 3000;
const SWEEP_MS = 250;
/** Whole-test bound: opening a fresh PGlite (its migrations) took 18 s on a loaded test host. */
const TEST_MS = 90_000;
/** Detection is due at LOST_MS plus a sweep; the rest is room for a loaded test host. */
const DETECT_WITHIN_MS = LOST_MS + 5000;

// biome-ignore lint/suspicious/noExplicitAny: response bodies are checked field by field
type Body = Record<string, any>;

const cleanups: (() => Promise<void>)[] = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

const { cases } = databaseCases();

/** The operator commands as `sandboxd fleet` runs them, on this database. */
function calls(db: Db): FleetCalls {
  const ctx = { db, secrets: { keyPepper: "", connectSecret: "", agentSecret: "" } };
  return {
    list: () => OPERATOR_OPS["fleet.list"].run(ctx, {}),
    cordon: async (id, on) => {
      await OPERATOR_OPS["fleet.cordon"].run(ctx, { id, on });
    },
  };
}

for (const c of cases) {
  describe(`host loss (${c.name})`, () => {
    async function fleet(ids: string[]): Promise<FleetHarness> {
      const h = await makeFleet({
        ...(c.url ? { url: await c.url() } : {}),
        ids,
        region: `eu-${ids[0]}`, // one PostgreSQL serves every test of the file: no agent of another test is placed on
        limits: { sandboxQuotaByTier: { live: 0, scale: 0, demo: 0, pro: 2, enterprise: 0 } },
        staleAfterMs: STALE_MS,
        lostAfterMs: LOST_MS,
        sweepMs: SWEEP_MS,
        beatMs: BEAT_MS,
      });
      cleanups.push(() => h.close());
      return h;
    }

    test(
      "a silent agent's sandboxes end host_lost at its last heartbeat, quota comes back, delete answers at once; back, its VMs are destroyed and nothing is billed twice",
      async () => {
        const [A, B] = ["lost-a", "lost-b"]; // one PostgreSQL serves every test of the file
        const h = await fleet([A, B]);
        const db = h.handle.db;
        const key = await h.key("lossco");
        const ops = calls(db);
        // b cordoned: both places of the tenant's quota (2) go to a.
        await ops.cordon(B, true);
        const ids: string[] = [];
        for (let i = 0; i < 2; i++) {
          const res = await h.req("POST", "/v1/sandboxes", { key, json: { template: "python" } });
          expect([res.status, res.status === 201 ? "" : await res.text()]).toEqual([201, ""]);
          ids.push(((await res.json()) as Body).id);
        }
        const placed = await db.select().from(sandboxes).where(inArray(sandboxes.id, ids));
        expect(placed.map((r) => r.agentId)).toEqual([A, A]);
        expect(h.agents.get(B)!.vms.size).toBe(0);
        const full = await h.req("POST", "/v1/sandboxes", { key, json: { template: "python" } });
        expect(full.status).toBe(429);
        await ops.cordon(B, false);

        // A falls silent, after a beat that followed the creates (a create after the last beat
        // closes at its own start instead, host-loss.ts).
        const newest = Math.max(...placed.map((r) => r.createdAt.getTime()));
        await until(async () => {
          const [r] = await db.select().from(agents).where(eq(agents.id, A));
          return r!.lastHeartbeatAt!.getTime() > newest;
        }, 5000);
        await h.beating(A, false);
        const tSilent = performance.now();
        const tNoticed = await until(async () => {
          const rows = await db.select().from(sandboxes).where(inArray(sandboxes.id, ids));
          return rows.every((r) => r.state === "destroyed");
        }, DETECT_WITHIN_MS + 2000);
        const detectionMs = performance.now() - tSilent;
        // Read after the loss: a beat that was in flight when the beats stopped has landed.
        const [aRow] = await db.select().from(agents).where(eq(agents.id, A));
        const lastBeat = aRow!.lastHeartbeatAt!;
        const ended = await db.select().from(sandboxes).where(inArray(sandboxes.id, ids));
        for (const r of ended) {
          expect(r.endReason).toBe(HOST_LOST);
          expect(r.endDetail).toStartWith(`${HOST_LOST}: agent ${A}`);
          expect(r.destroyedAt!.getTime()).toBe(lastBeat.getTime());
        }
        expect(detectionMs).toBeGreaterThanOrEqual(LOST_MS - BEAT_MS);
        // Exactly one interval each, closed at a's last heartbeat: never billed past it.
        const intervals = await db
          .select()
          .from(usageIntervals)
          .where(inArray(usageIntervals.sandboxId, ids));
        expect(intervals.length).toBe(2);
        for (const iv of intervals) expect(iv.endedAt!.getTime()).toBe(lastBeat.getTime());
        const tenantId = ended[0]!.tenantId;
        const report = async () =>
          (
            await usageReport(db, {
              tenantId,
              from: new Date(0),
              to: new Date(Date.now() + 3_600_000),
              now: new Date(),
              by: "sandbox",
            })
          )
            .filter((l) => ids.includes(l.sandbox_id!))
            .map((l) => [l.sandbox_id, l.running_seconds, l.end_reason]);
        const billed = await report();
        for (const [id, secs, why] of billed) {
          const iv = intervals.find((i) => i.sandboxId === id)!;
          expect(secs).toBeCloseTo((lastBeat.getTime() - iv.startedAt.getTime()) / 1000, 3);
          expect(why).toBe(HOST_LOST);
        }

        // The quota is free: a create that needs it succeeds (on b, the live one).
        const tQuota0 = performance.now();
        let created: Body | undefined;
        await until(async () => {
          const res = await h.req("POST", "/v1/sandboxes", { key, json: { template: "python" } });
          if (res.status === 201) created = (await res.json()) as Body;
          return res.status === 201;
        }, 5000);
        const quotaFreeMs = detectionMs + (performance.now() - tQuota0);
        const [onB] = await db.select().from(sandboxes).where(eq(sandboxes.id, created!.id));
        expect(onB!.agentId).toBe(B);

        // DELETE of a lost sandbox: answered from the row, the dead agent is not called.
        const callsBefore = h.agents.get(A)!.calls.length;
        const t0 = performance.now();
        const del = await h.req("DELETE", `/v1/sandboxes/${ids[0]}`, { key });
        const deleteMs = performance.now() - t0;
        expect(del.status).toBe(404);
        expect(((await del.json()) as Body).message).toContain("its host was lost");
        expect(h.agents.get(A)!.calls.length).toBe(callsBefore);
        expect(h.agents.get(A)!.vms.size).toBe(2);

        // a comes back: its two VMs (rows ended) are destroyed on it, never resumed or billed.
        await h.beating(A, true);
        const backMs = await until(() => h.agents.get(A)!.vms.size === 0, 5000);
        const destroys = h.agents.get(A)!.calls.filter((l) => l.startsWith("destroy "));
        expect(destroys.length).toBe(2);
        const [back] = await db.select().from(agents).where(eq(agents.id, A));
        expect(back!.lostAt).toBeNull();
        const after = await db.select().from(usageIntervals).where(inArray(usageIntervals.sandboxId, ids));
        expect(after.map((i) => [i.id, i.endedAt!.getTime()]).sort()).toEqual(
          intervals.map((i) => [i.id, i.endedAt!.getTime()]).sort(),
        );
        await Bun.sleep(3 * BEAT_MS);
        expect(await report()).toEqual(billed);
        expect(h.logs.filter((l) => l.includes(`host loss: agent ${A} lost`)).length).toBe(1);
        process.stdout.write(
          `${JSON.stringify({
            host_loss: c.name,
            lost_after_ms: LOST_MS,
            sweep_ms: SWEEP_MS,
            detection_ms: Math.round(detectionMs),
            poll_after_silence_ms: Math.round(tNoticed),
            quota_free_ms: Math.round(quotaFreeMs),
            delete_ms: Math.round(deleteMs * 10) / 10,
            back_destroyed_ms: Math.round(backMs),
            billed_running_seconds: billed.map((b) => b[1]),
          })}\n`,
        );
      },
      TEST_MS,
    );

    test(
      "cordon keeps new sandboxes off an agent; drain cordons it and returns once its sandboxes ended",
      async () => {
        const [A, B] = ["drain-a", "drain-b"];
        const h = await fleet([A, B]);
        const db = h.handle.db;
        const key = await h.key("drainco");
        const ops = calls(db);
        await ops.cordon(A, true);
        const mk = async () => {
          const res = await h.req("POST", "/v1/sandboxes", { key, json: { template: "python" } });
          expect([res.status, res.status === 201 ? "" : await res.clone().text()]).toEqual([201, ""]);
          return ((await res.json()) as Body).id as string;
        };
        const first = await mk();
        const second = await mk();
        const rows = await db
          .select()
          .from(sandboxes)
          .where(inArray(sandboxes.id, [first, second]));
        expect(rows.map((r) => r.agentId)).toEqual([B, B]);
        // All of them cordoned: nowhere to place.
        await ops.cordon(B, true);
        await h.req("DELETE", `/v1/sandboxes/${second}`, { key });
        const none = await h.req("POST", "/v1/sandboxes", { key, json: { template: "python" } });
        expect(none.status).toBe(503);
        await ops.cordon(A, false);
        await ops.cordon(B, false);

        // Drain b while its one sandbox lives; its owner deletes it a moment later.
        const counts: number[] = [];
        const t0 = performance.now();
        const drained = drainAgent(ops, B, { timeoutMs: 10_000, pollMs: 50, onCount: (n) => counts.push(n) });
        await Bun.sleep(300);
        const during = await h.req("POST", "/v1/sandboxes", { key, json: { template: "python" } });
        expect([during.status, during.status === 201 ? "" : await during.clone().text()]).toEqual([201, ""]);
        const [placedDuring] = await db
          .select()
          .from(sandboxes)
          .where(eq(sandboxes.id, ((await during.json()) as Body).id));
        expect(placedDuring!.agentId).toBe(A);
        expect((await h.req("DELETE", `/v1/sandboxes/${first}`, { key })).status).toBe(200);
        expect(await drained).toBe(0);
        expect(counts).toEqual([1, 0]);
        expect(h.agents.get(B)!.vms.size).toBe(0);
        const listed = (await ops.list()).find((a) => a.id === B)!;
        expect([listed.cordoned, listed.liveSandboxes, listed.state]).toEqual([true, 0, "live"]);
        // A drain that times out says what is left.
        expect(await drainAgent(ops, A, { timeoutMs: 200, pollMs: 50 })).toBe(1);
        process.stdout.write(
          `${JSON.stringify({ drain: c.name, drain_ms: Math.round(performance.now() - t0), counts })}\n`,
        );
      },
      TEST_MS,
    );

    test(
      "several gateways on one database: one declares the agent lost, each row ends once; a gateway just started judges nobody",
      async () => {
        const url = c.url ? await c.url() : undefined;
        // PGlite: one process per directory, so the "gateways" share its handle; PostgreSQL: two.
        const dir = mkdtempSync(join(tmpdir(), "sandboxd-multigw-"));
        const first = await openDb(url ? { url } : { dataDir: dir });
        const second = url ? await openDb({ url }) : undefined;
        cleanups.push(async () => {
          await second?.close();
          await first.close();
          rmSync(dir, { recursive: true, force: true });
        });
        const db1 = first.db;
        const db2 = second?.db ?? db1;
        const last = new Date(Date.now() - 60_000);
        await db1.insert(agents).values({
          id: "c",
          region: "eu",
          url: "http://c.invalid",
          keyId: "k1",
          lastHeartbeatAt: last,
        });
        const tenantId = await ensureTenant(db1, "multico");
        await db1
          .insert(templates)
          .values({ pk: "tpl_mg", id: "mg", api: "sandboxes", agentRef: "mg", name: "mg", status: "ready" })
          .onConflictDoNothing();
        const ids = Array.from({ length: 6 }, (_, i) => `sbx_multigw00000000000${i}`);
        for (const id of ids) {
          await db1.insert(sandboxes).values({
            id,
            tenantId,
            api: "sandboxes",
            kind: "sandbox",
            templatePk: "tpl_mg",
            templateId: "mg",
            agentId: "c",
            vmId: `vm-${id}`,
            state: "running",
            createdAt: new Date(last.getTime() - 30_000),
          });
          await db1.insert(usageIntervals).values({
            sandboxId: id,
            tenantId,
            state: "running",
            vcpus: 1,
            memMib: 256,
            diskBytes: 0,
            startedAt: new Date(last.getTime() - 30_000),
          });
        }
        // Just started: silence it could not have heard is nobody's fault.
        const fresh = startHostLossSweeper(
          { db: db2, clock: Date.now },
          { lostAfterMs: 10_000, log: () => {} },
        );
        expect((await fresh.sweep()).lost).toEqual([]);
        fresh.stop();
        const log = () => {};
        const [r1, r2] = await Promise.all([
          sweepLostAgents({ db: db1, clock: Date.now }, { lostAfterMs: 10_000, judge: true, log }),
          sweepLostAgents({ db: db2, clock: Date.now }, { lostAfterMs: 10_000, judge: true, log }),
        ]);
        expect([...r1.lost, ...r2.lost]).toEqual(["c"]);
        expect([...r1.ended, ...r2.ended].sort()).toEqual([...ids].sort());
        const closed = await db1
          .select()
          .from(usageIntervals)
          .where(and(inArray(usageIntervals.sandboxId, ids), isNotNull(usageIntervals.endedAt)));
        expect(closed.map((i) => i.endedAt!.getTime())).toEqual(ids.map(() => last.getTime()));
      },
      TEST_MS,
    );

    test(
      "a beat stamped before the recorded one changes nothing; one stamped before a loss does not end it",
      async () => {
        const url = c.url ? await c.url() : undefined;
        const dir = mkdtempSync(join(tmpdir(), "sandboxd-beat-order-"));
        const handle = await openDb(url ? { url } : { dataDir: dir });
        cleanups.push(async () => {
          await handle.close();
          rmSync(dir, { recursive: true, force: true });
        });
        const db = handle.db;
        const id = `order-${c.name}`;
        await db.delete(agents).where(eq(agents.id, id));
        await db.insert(agents).values({ id, region: "eu-order", url: "http://o.invalid", keyId: "k1" });
        const hb = (free: number) => ({
          id,
          region: "eu-order",
          url: "http://o.invalid",
          capacity: { slotsTotal: 4, slotsFree: free, vcpusFree: 4, memMibFree: 1024 },
        });
        const t = Date.now();
        const row = async () => (await db.select().from(agents).where(eq(agents.id, id)))[0]!;
        // Two beats in flight: the later stamp commits first, the earlier one after it.
        expect(await recordHeartbeat(db, hb(3), "k1", new Date(t + 20))).toBe(true);
        expect(await recordHeartbeat(db, hb(1), "k1", new Date(t + 10))).toBe(true);
        expect([(await row()).lastHeartbeatAt!.getTime(), (await row()).slotsFree]).toEqual([t + 20, 3]);
        // Declared lost at t+5000; a beat stamped at t+4000 (before the claim) lands after it.
        await db
          .update(agents)
          .set({ lostAt: new Date(t + 5000) })
          .where(eq(agents.id, id));
        expect(await recordHeartbeat(db, hb(2), "k1", new Date(t + 4000))).toBe(true);
        expect([(await row()).lastHeartbeatAt!.getTime(), (await row()).lostAt?.getTime()]).toEqual([
          t + 4000,
          t + 5000,
        ]);
        // A beat after the loss brings it back.
        expect(await recordHeartbeat(db, hb(2), "k1", new Date(t + 6000))).toBe(true);
        expect((await row()).lostAt).toBeNull();
        // Another key (re-keyed or revoked) is refused, stale or not.
        expect(await recordHeartbeat(db, hb(2), "k2", new Date(t + 7000))).toBe(false);
        expect(await recordHeartbeat(db, hb(2), "k2", new Date(t))).toBe(false);
      },
      TEST_MS,
    );
  });
}
