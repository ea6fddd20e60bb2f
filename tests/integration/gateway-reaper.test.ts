/**
 * The idle reaper's claim on the database (gateway/core/sandboxes.ts reapIdleSessions): two
 * gateways' reapers racing over one database reclaim a session once (one agent destroy, one end
 * of metering), and an exec counted in flight, as another gateway's exec is, keeps its session
 * however long it runs, until the count is older than any exec could be. Real PGlite, and real
 * PostgreSQL where its binaries are installed, there with each gateway on its own connection
 * pool as separate processes would be; the agent is the in-memory stand-in (tests/support/memory-agent.ts), which only records the calls the
 * claim lets through. The running service's reaper with real VMs: tests/e2e/http-reaper.test.ts.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { eq } from "drizzle-orm";
import type { Db } from "../../db/client.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { usageIntervals } from "../../db/schema/usage-intervals.ts";
import { reapIdleSessions } from "../../gateway/core/sandboxes.ts";
import type { Deps } from "../../gateway/deps.ts";
import type { Harness } from "../support/gateway-harness.ts";
import { gatewayDeps, onBothDatabases } from "../support/postgres-suite.ts";

let h: Harness;
let live: string;
/** Other gateways' connections to h's database (PostgreSQL only: PGlite has one opener). */
let others: Db[] = [];

/** One gateway's view over `db` (by default h's). */
const gateway = (db: Db = h.handle.db): Deps => gatewayDeps(h, db);

async function newSession(): Promise<{ id: string; vmId: string }> {
  const res = await h.req("POST", "/v1/sessions", { key: live, json: { template_id: "python" } });
  expect(res.status).toBe(201);
  const id = ((await res.json()) as { session_id: string }).session_id;
  const [row] = await h.handle.db.select().from(sandboxes).where(eq(sandboxes.id, id));
  return { id, vmId: row!.vmId! };
}

const ttlMs = () => h.config.limits.sessionIdleTtlS * 1000;

function suite(name: string, open: () => Promise<{ harness: Harness; others: Db[] }>): void {
  describe(name, () => {
    beforeAll(async () => {
      ({ harness: h, others } = await open());
      live = await h.key("acme", "live");
    });
    afterAll(() => h.close());

    test("reapers of several gateways racing on one database reclaim a session once", async () => {
      const s = await newSession();
      h.now.ms += ttlMs() + 1000;
      const passes = await Promise.all(
        [h.handle.db, ...others, h.handle.db].map((db) => reapIdleSessions(gateway(db))),
      );
      expect(passes.flat().filter((id) => id === s.id)).toHaveLength(1);
      expect(h.agent.calls.filter((c) => c.startsWith(`destroy ${s.vmId} `))).toEqual([
        `destroy ${s.vmId} force=true`,
      ]);
      const [row] = await h.handle.db.select().from(sandboxes).where(eq(sandboxes.id, s.id));
      expect({ state: row!.state, endReason: row!.endReason }).toEqual({
        state: "destroyed",
        endReason: "reaped",
      });
      const ivs = await h.handle.db.select().from(usageIntervals).where(eq(usageIntervals.sandboxId, s.id));
      expect(ivs.filter((iv) => iv.endedAt === null)).toEqual([]);
      expect((await h.req("GET", `/v1/sessions/${s.id}`, { key: live })).status).toBe(410);
    });

    test("an exec in flight keeps its session past the TTL; a count no exec can still hold does not", async () => {
      const s = await newSession();
      // An exec running on another gateway: counted in the row, as execIn counts it.
      await h.handle.db
        .update(sandboxes)
        .set({ execsInFlight: 1, lastExecAt: new Date(h.now.ms) })
        .where(eq(sandboxes.id, s.id));
      h.now.ms += ttlMs() + 1000;
      expect(await reapIdleSessions(gateway())).not.toContain(s.id);
      const st = (await (await h.req("GET", `/v1/sessions/${s.id}`, { key: live })).json()) as {
        idle_secs: number;
      };
      expect(st.idle_secs).toBe(0);
      // Older than the longest exec plus its margin: the gateway that counted it died mid-exec.
      h.now.ms += (h.config.limits.maxExecTimeoutS + 600) * 1000;
      expect(await reapIdleSessions(gateway())).toContain(s.id);
    });

    test("an exec that ends resets idleness: the session lives a whole TTL after it", async () => {
      const s = await newSession();
      h.now.ms += ttlMs() - 1000;
      const ex = await h.req("POST", `/v1/sessions/${s.id}/exec`, { key: live, json: { code: "print(1)" } });
      expect(ex.status).toBe(200);
      const [row] = await h.handle.db.select().from(sandboxes).where(eq(sandboxes.id, s.id));
      expect(row!.execsInFlight).toBe(0);
      h.now.ms += ttlMs() - 1000;
      expect(await reapIdleSessions(gateway())).not.toContain(s.id);
      h.now.ms += 2000;
      expect(await reapIdleSessions(gateway())).toContain(s.id);
    });
  });
}

onBothDatabases(suite);
