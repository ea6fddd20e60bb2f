/**
 * The agent's VM events on their way to the gateway, without VMs: the sender (agent/api/events.ts)
 * against a real routing gateway (startGateway on PGlite, an agent enrolled with a one-time token):
 * events signed with the agent's own key are written into the row that names the VM, in order;
 * a forged token is 401 and a report for another agent 403. Then the sender's own rules against a
 * loopback server that plays a failing gateway: a refused batch is sent again, whole and in order,
 * and a full queue drops the oldest and says how many. The VM flow: tests/e2e/usage.test.ts.
 */
import { afterEach, describe, expect, test } from "bun:test";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { and, eq, isNull } from "drizzle-orm";
import { enroll } from "../../agent/api/enroll.ts";
import { EventReporter } from "../../agent/api/events.ts";
import { AGENT_EVENTS_PATH, type VmEventBatch } from "../../contracts/agent/events.ts";
import { secretKey, signHeartbeatToken } from "../../contracts/agent/token.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { templates } from "../../db/schema/templates.ts";
import { usageIntervals } from "../../db/schema/usage-intervals.ts";
import { createEnrollmentToken } from "../../gateway/agents/enrollment.ts";
import { ensureTenant } from "../../gateway/auth/keys.ts";
import { startRoutingGateway } from "../support/agents.ts";
import { waitFor } from "../support/e2e-service.ts";

const AGENT_SECRET = "agent-events-test-secret-0123456789abcdef";
const cleanups: (() => Promise<void>)[] = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

/** PGlite's migrations, an enrollment and a few writes on a host shared with other suites. */
const GATEWAY_TEST_TIMEOUT_MS = 60_000;

const R = { vcpus: 1, memMib: 256, diskBytes: 4 * 1024 * 1024 };

describe("VM events to a real gateway", () => {
  test(
    "signed events land in the row's usage intervals in order; forged or foreign ones are refused",
    async () => {
      const gw = await startRoutingGateway({
        agentSecret: AGENT_SECRET,
        staleAfterMs: 15_000,
        onCleanup: (c) => cleanups.push(c),
      });
      const stateDir = await mkdtemp(join(tmpdir(), "sbx-events-"));
      cleanups.push(() => rm(stateDir, { recursive: true, force: true }));
      const { token } = await gw.withDb((db) => createEnrollmentToken(db, AGENT_SECRET, { region: "eu" }));
      const credentials = await enroll({ gatewayUrl: gw.url, token, id: "ev-a", stateDir });
      const t0 = Date.now() - 60_000;
      // A running sandbox on agent ev-a (as markStarted leaves it), with its open interval.
      await gw.withDb(async (db) => {
        const tenantId = await ensureTenant(db, "events-co");
        await db
          .insert(templates)
          .values({ pk: "tpl_ev", id: "ev", api: "sandboxes", agentRef: "ev", name: "ev", status: "ready" });
        await db.insert(sandboxes).values({
          id: "sbx_events000000000001",
          tenantId,
          api: "sandboxes",
          kind: "sandbox",
          templatePk: "tpl_ev",
          templateId: "ev",
          agentId: "ev-a",
          vmId: "vm-00000000000000e1",
          state: "running",
          createdAt: new Date(t0),
        });
        await db.insert(usageIntervals).values({
          sandboxId: "sbx_events000000000001",
          tenantId,
          state: "running",
          ...R,
          startedAt: new Date(t0),
        });
      });
      const reporter = new EventReporter();
      cleanups.push(() => reporter.stop());
      reporter.start({ gatewayUrl: gw.url, credentials });
      const vmId = "vm-00000000000000e1";
      reporter.push({ vmId, state: "paused", atMs: t0 + 10_000, resources: R });
      reporter.push({
        vmId,
        state: "running",
        atMs: t0 + 20_000,
        resources: { ...R, diskBytes: 64 * 1024 * 1024 },
      });
      reporter.push({
        vmId,
        state: "failed",
        atMs: t0 + 30_000,
        reason: "QEMU exited (signal SIGKILL)",
        resources: R,
      });
      const intervals = () =>
        gw.withDb((db) =>
          db
            .select()
            .from(usageIntervals)
            .where(eq(usageIntervals.sandboxId, "sbx_events000000000001"))
            .orderBy(usageIntervals.startedAt),
        );
      expect(await waitFor(async () => reporter.pending === 0, 10_000)).toBe(true);
      const ivs = await intervals();
      expect(
        ivs.map((i) => [i.state, i.startedAt.getTime() - t0, (i.endedAt?.getTime() ?? 0) - t0, i.diskBytes]),
      ).toEqual([
        ["running", 0, 10_000, R.diskBytes],
        ["paused", 10_000, 20_000, R.diskBytes],
        ["running", 20_000, 30_000, 64 * 1024 * 1024],
      ]);
      const [row] = await gw.withDb((db) =>
        db.select().from(sandboxes).where(eq(sandboxes.id, "sbx_events000000000001")),
      );
      expect(row).toMatchObject({
        state: "destroyed",
        endReason: "failed",
        endDetail: "QEMU exited (signal SIGKILL)",
      });
      const open = await gw.withDb((db) =>
        db
          .select()
          .from(usageIntervals)
          .where(and(eq(usageIntervals.sandboxId, row!.id), isNull(usageIntervals.endedAt))),
      );
      expect(open).toEqual([]);

      const post = async (authorization: string, body: VmEventBatch) =>
        (
          await fetch(`${gw.url}${AGENT_EVENTS_PATH}`, {
            method: "POST",
            headers: { authorization, "content-type": "application/json" },
            body: JSON.stringify(body),
          })
        ).status;
      const batch = (id: string): VmEventBatch => ({ id, dropped: 0, events: [] });
      const signed = `Bearer ${await signHeartbeatToken(secretKey(credentials.key), "ev-a")}`;
      expect(await post(signed, batch("ev-a"))).toBe(200);
      expect(await post("Bearer x.y.z", batch("ev-a"))).toBe(401);
      const forged = `Bearer ${await signHeartbeatToken(secretKey("k".repeat(64)), "ev-a")}`;
      expect(await post(forged, batch("ev-a"))).toBe(401);
      expect(await post(signed, batch("ev-b"))).toBe(403);
    },
    GATEWAY_TEST_TIMEOUT_MS,
  );
});

describe("the sender's queue", () => {
  /** A loopback stand-in for the gateway's route: refuses the first `refuse` batches. */
  function fakeGateway(refuse: number) {
    const got: VmEventBatch[] = [];
    let calls = 0;
    const server = Bun.serve({
      hostname: "127.0.0.1",
      port: 0,
      fetch: async (req) => {
        calls++;
        const body = (await req.json()) as VmEventBatch;
        if (calls <= refuse)
          return Response.json({ code: "db_unavailable", message: "down" }, { status: 503 });
        got.push(body);
        return Response.json({ ok: true });
      },
    });
    cleanups.push(async () => {
      await server.stop(true);
    });
    return { url: `http://127.0.0.1:${server.port}`, got, calls: () => calls };
  }
  const credentials = { id: "ev-q", key: "q".repeat(64) };
  const ev = (i: number) => ({
    vmId: "vm-000000000000000a",
    state: "running" as const,
    atMs: i,
    resources: R,
  });

  test("a refused batch is sent again, whole and in order", async () => {
    const gw = fakeGateway(2);
    const r = new EventReporter();
    cleanups.push(() => r.stop());
    r.start({ gatewayUrl: gw.url, credentials });
    for (let i = 0; i < 5; i++) r.push(ev(i));
    expect(await waitFor(() => r.pending === 0, 10_000)).toBe(true);
    expect(gw.calls()).toBeGreaterThanOrEqual(3);
    const seqs = gw.got.flatMap((b) => b.events.map((e) => e.seq));
    expect(seqs).toEqual([0, 1, 2, 3, 4]);
    expect(gw.got.flatMap((b) => b.events.map((e) => e.atMs))).toEqual([0, 1, 2, 3, 4]);
  });

  test("a full queue drops the oldest and the next batch says how many", async () => {
    const gw = fakeGateway(0);
    const r = new EventReporter({ maxQueued: 3 });
    cleanups.push(() => r.stop());
    for (let i = 0; i < 5; i++) r.push(ev(i)); // before start: nowhere to send yet
    expect(r.pending).toBe(3);
    r.start({ gatewayUrl: gw.url, credentials });
    expect(await waitFor(() => r.pending === 0, 10_000)).toBe(true);
    expect(gw.got.flatMap((b) => b.events.map((e) => e.seq))).toEqual([2, 3, 4]);
    expect(gw.got[0]!.dropped).toBe(2);
    r.push(ev(5));
    expect(await waitFor(() => r.pending === 0, 10_000)).toBe(true);
    expect(gw.got.at(-1)!.dropped).toBe(0);
  });
});
