/**
 * Agent -> gateway truth at the gateway's write level, with an injected clock so every total can
 * be checked to the second: a sandboxes API sandbox made and suspended/resumed through the real HTTP
 * routes (app.request, the stand-in agent behind them), and the agent's events (the wire schema,
 * contracts/agent/events.ts) written by the real handler code (gateway/core/agent-events.ts):
 * run, idle-pause, wake with a grown disk, suspend, resume, die. The report SQL (usage_rollup,
 * the operator views, `sandboxd usage`'s report) is checked on PGlite and on PostgreSQL, and
 * reconciliation settles a row whose VM vanished, an orphan VM and a row stuck in `starting`.
 * Real VMs and the real service: tests/e2e/usage.test.ts.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { eq, sql } from "drizzle-orm";
import { usageTable } from "../../cli/usage.ts";
import { type VmEvent, VmEventBatch } from "../../contracts/agent/events.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { usageIntervals } from "../../db/schema/usage-intervals.ts";
import { FixedPlacement } from "../../gateway/agents/placement.ts";
import { applyAgentEvents } from "../../gateway/core/agent-events.ts";
import { BRINGUP_BOUND_MS, endStuckStarting, reconcileAgent } from "../../gateway/core/reconcile.ts";
import { tenantIdOf, usageReport } from "../../gateway/core/usage.ts";
import { runCli } from "../support/e2e-service.ts";
import { type Harness, makeHarness } from "../support/gateway-harness.ts";
import { databaseCases } from "../support/postgres-suite.ts";
import { sqlRows } from "../support/sql-rows.ts";

const GiB = 1024 ** 3;
/** Two bin/sandboxd runs (PostgreSQL suite) and a few dozen writes on a host shared with other suites. */
const TEST_TIMEOUT_MS = 60_000;
/** One minute before a UTC midnight: the timeline crosses into the next day. */
const T0 = Date.parse("2025-03-01T23:59:00Z");
const at = (s: number) => T0 + s * 1000;

interface Created {
  id: string;
}

async function body<T>(res: Response, status: number): Promise<T> {
  const text = await res.text();
  if (res.status !== status) throw new Error(`expected ${status}, got ${res.status}: ${text}`);
  return JSON.parse(text) as T;
}

/**
 * The CLI over this suite's database: `bin/sandboxd usage` on PostgreSQL (DATABASE_URL), as an
 * operator runs it beside a live service. Undefined for PGlite (one process's; the e2e suite
 * runs the CLI on PGlite once `up` has stopped).
 */
function suite(name: string, open: () => Promise<Harness>, databaseUrl?: () => string) {
  describe(name, () => {
    let h: Harness;
    const logs: string[] = [];
    const log = (l: string) => logs.push(l);
    beforeAll(async () => {
      h = await open();
    });
    afterAll(() => h?.close());

    const deps = () => ({ db: h.handle.db, clock: () => h.now.ms });
    async function rowOf(id: string) {
      const [row] = await h.handle.db.select().from(sandboxes).where(eq(sandboxes.id, id));
      return row!;
    }
    /** A batch as it arrives on the wire (parsed by the same schema the handler uses). */
    function send(arriveAt: number, vmId: string, events: Omit<VmEvent, "seq" | "vmId">[]) {
      h.now.ms = arriveAt;
      const batch = VmEventBatch.parse({
        id: "local",
        events: events.map((e, i) => ({ seq: i, vmId, ...e })),
      });
      return applyAgentEvents(deps(), "local", batch.events, log);
    }

    test(
      "run, idle-pause, wake, suspend, resume, die: every total to the second",
      async () => {
        const key = await h.key("acme", "pro");
        h.now.ms = at(0);
        const sb = await body<Created>(
          await h.req("POST", "/v1/sandboxes", { key, json: { template: "python" } }),
          201,
        );
        const vmId = (await rowOf(sb.id)).vmId!;
        const r1 = { vcpus: 2, memMib: 512, diskBytes: GiB };
        // Idle after 30 s: the agent pauses the vCPUs; the report arrives a second later.
        await send(at(31), vmId, [{ state: "paused", atMs: at(30), resources: r1 }]);
        // Woken by an exec at 90 s; the overlay has grown to 2 GiB since.
        await send(at(90.5), vmId, [
          { state: "running", atMs: at(90), resources: { ...r1, diskBytes: 2 * GiB } },
        ]);
        // Suspended through the API at 120 s; the agent's own report of it comes after the
        // gateway's write, with its earlier timestamp: the interval is not split or moved back.
        h.now.ms = at(120);
        await body(await h.req("POST", `/v1/sandboxes/${sb.id}/suspend`, { key }), 200);
        const snap = { vcpus: 0, memMib: 0, diskBytes: 2 * GiB };
        await send(at(121), vmId, [{ state: "suspended", atMs: at(119), resources: snap }]);
        h.now.ms = at(300);
        await body(await h.req("POST", `/v1/sandboxes/${sb.id}/resume`, { key }), 200);
        // QEMU killed at 400 s; the event arrives 2 s later, twice (a retried batch).
        const died: Omit<VmEvent, "seq" | "vmId"> = {
          state: "failed",
          atMs: at(400),
          reason: "QEMU exited (signal SIGKILL)",
          resources: r1,
        };
        await send(at(402), vmId, [died]);
        await send(at(403), vmId, [died, { state: "destroyed", atMs: at(401), resources: r1 }]);

        const row = await rowOf(sb.id);
        expect(row.state).toBe("destroyed");
        expect(row.endReason).toBe("failed");
        expect(row.endDetail).toBe("QEMU exited (signal SIGKILL)");
        expect(row.destroyedAt!.getTime()).toBe(at(400));
        // It no longer exists for its tenant (404) nor counts in its list.
        expect((await h.req("GET", `/v1/sandboxes/${sb.id}`, { key })).status).toBe(404);
        expect(
          (await body<{ sandboxes: unknown[] }>(await h.req("GET", "/v1/sandboxes", { key }), 200)).sandboxes,
        ).toEqual([]);
        expect(logs.some((l) => l.includes(`${sb.id} (${vmId}) failed: QEMU exited (signal SIGKILL)`))).toBe(
          true,
        );

        const ivs = await h.handle.db
          .select()
          .from(usageIntervals)
          .where(eq(usageIntervals.sandboxId, sb.id))
          .orderBy(usageIntervals.startedAt);
        expect(
          ivs.map((i) => [
            i.state,
            (i.startedAt.getTime() - T0) / 1000,
            ((i.endedAt?.getTime() ?? 0) - T0) / 1000,
            i.diskBytes,
          ]),
        ).toEqual([
          ["running", 0, 30, GiB],
          ["paused", 30, 90, GiB],
          ["running", 90, 120, 2 * GiB],
          ["suspended", 120, 300, 2 * GiB],
          ["running", 300, 400, GiB],
        ]);

        h.now.ms = at(3600);
        const tenantId = (await tenantIdOf(h.handle.db, "acme"))!;
        const q = { tenantId, from: new Date(at(-3600)), to: new Date(at(3600)), now: new Date(h.now.ms) };
        const [total] = await usageReport(h.handle.db, { ...q, by: "total" });
        const running = 30 + 30 + 100;
        expect(total!.running_seconds).toBe(running);
        expect(total!.paused_seconds).toBe(60);
        expect(total!.suspended_seconds).toBe(180);
        expect(total!.cpu_core_hours).toBeCloseTo((2 * running) / 3600, 12);
        expect(total!.ram_gb_hours).toBeCloseTo((0.5 * (running + 60)) / 3600, 12);
        expect(total!.disk_gb_hours).toBeCloseTo((1 * (30 + 60) + 2 * 30 + 1 * 100) / 3600, 12);
        expect(total!.snapshot_gb_months).toBeCloseTo((2 * 180) / 3600 / 730, 15);
        // The public API reads the same SQL.
        const api = await body<{ totals: Record<string, number> }>(
          await h.req(
            "GET",
            `/v1/usage?from=${new Date(at(-3600)).toISOString()}&to=${new Date(at(3600)).toISOString()}`,
            { key },
          ),
          200,
        );
        expect(api.totals.cpu_core_hours).toBeCloseTo(total!.cpu_core_hours, 12);

        const days = await usageReport(h.handle.db, { ...q, by: "day" });
        expect(days.map((d) => [d.day, d.running_seconds, d.paused_seconds, d.suspended_seconds])).toEqual([
          ["2025-03-01", 30, 30, 0],
          ["2025-03-02", 130, 30, 180],
        ]);
        const [one] = await usageReport(h.handle.db, { ...q, by: "sandbox" });
        expect(one).toMatchObject({
          sandbox_id: sb.id,
          state: "destroyed",
          end_reason: "failed",
          running_seconds: running,
        });
        expect(usageTable([one!], "sandbox")).toContain("failed: QEMU exited (signal SIGKILL)");

        // The operator views: all time, so the same figures.
        const [vrow] = await sqlRows(
          h.handle.db,
          sql`select running_seconds, paused_seconds, suspended_seconds, end_detail from usage_by_sandbox where sandbox_id = ${sb.id}`,
        );
        if (!vrow) throw new Error(`no usage_by_sandbox line for ${sb.id}`);
        expect(Number(vrow.running_seconds)).toBe(running);
        expect(Number(vrow.suspended_seconds)).toBe(180);
        expect(vrow.end_detail).toBe("QEMU exited (signal SIGKILL)");
        const drows = await sqlRows(
          h.handle.db,
          sql`select day::text as day, running_seconds from usage_by_tenant_day where tenant = 'acme' order by day`,
        );
        expect(drows.map((r) => [r.day, Number(r.running_seconds)])).toEqual([
          ["2025-03-01", 30],
          ["2025-03-02", 130],
        ]);

        if (databaseUrl) {
          const env = { ...process.env, DATABASE_URL: databaseUrl() };
          const window = [
            "--from",
            new Date(at(-3600)).toISOString(),
            "--to",
            new Date(at(3600)).toISOString(),
          ];
          const cli = await runCli(["usage", "--tenant", "acme", ...window, "--by", "day", "--json"], env);
          expect(cli.code).toBe(0);
          const lines = (JSON.parse(cli.stdout) as { lines: Record<string, unknown>[] }).lines;
          expect(lines.map((l) => [l.day, l.running_seconds, l.paused_seconds, l.suspended_seconds])).toEqual(
            [
              ["2025-03-01", 30, 30, 0],
              ["2025-03-02", 130, 30, 180],
            ],
          );
          const table = await runCli(["usage", "--tenant", "acme", ...window, "--by", "sandbox"], env);
          expect(table.stdout).toContain(
            `${sb.id}  sandbox  destroyed  failed: QEMU exited (signal SIGKILL)`,
          );
          console.log(table.stdout);
        }
      },
      TEST_TIMEOUT_MS,
    );

    test(
      "reconciliation: a vanished VM, an orphan VM and a row stuck starting are settled",
      async () => {
        const key = await h.key("recon-co", "pro");
        h.now.ms = at(10_000);
        const gone = await body<Created>(
          await h.req("POST", "/v1/sandboxes", { key, json: { template: "python" } }),
          201,
        );
        const kept = await body<Created>(
          await h.req("POST", "/v1/sandboxes", { key, json: { template: "python" } }),
          201,
        );
        const goneVm = (await rowOf(gone.id)).vmId!;
        h.agent.vms.delete(goneVm); // its agent lost it, and no event said so
        // An orphan: a VM the agent made before the bring-up bound whose create never reached a
        // row (one younger than the bound may still be on its way to one, and is left alone).
        const orphan = await h.agent.createSandbox("python", { kind: "sandbox" });
        h.agent.vms.get(orphan.vmId)!.createdAtMs = h.now.ms - BRINGUP_BOUND_MS - 1;
        const young = await h.agent.createSandbox("python", { kind: "sandbox" });
        // A row whose create never came back (its gateway died during the call).
        const [ref] = await h.handle.db.select().from(sandboxes).where(eq(sandboxes.id, kept.id));
        await h.handle.db.insert(sandboxes).values({
          ...ref!,
          id: "sbx_stuckstarting0000",
          state: "starting",
          vmId: null,
          createdAt: new Date(h.now.ms),
        });
        h.now.ms += 5_000;
        const placement = new FixedPlacement(h.handle.db, h.agent, h.config.agent);
        const settled = await reconcileAgent({ ...deps(), placement }, "local", "test", log);
        expect(
          settled.some((l) => l.startsWith(`${gone.id} failed: its VM ${goneVm} is not on agent local`)),
        ).toBe(true);
        expect(settled.some((l) => l.startsWith(`destroyed VM ${orphan.vmId}`))).toBe(true);
        expect(h.agent.vms.has(orphan.vmId)).toBe(false);
        expect(h.agent.vms.has(young.vmId)).toBe(true);
        expect(settled.some((l) => l.includes(young.vmId))).toBe(false);
        expect((await rowOf(gone.id)).endReason).toBe("failed");
        expect((await rowOf(kept.id)).state).toBe("running");
        // Its billing stopped when it was found.
        const [open] = await h.handle.db
          .select()
          .from(usageIntervals)
          .where(eq(usageIntervals.sandboxId, gone.id))
          .orderBy(usageIntervals.startedAt);
        expect(open!.endedAt!.getTime()).toBe(h.now.ms);
        // Within the bring-up bound a starting row is left alone; past it, it ends.
        expect(await endStuckStarting({ ...deps(), placement }, log)).toEqual([]);
        h.now.ms += BRINGUP_BOUND_MS;
        expect(await endStuckStarting({ ...deps(), placement }, log)).toEqual(["sbx_stuckstarting0000"]);
        expect((await rowOf("sbx_stuckstarting0000")).endDetail).toMatch(
          /still starting \d+ s after its create/,
        );
        // A second pass, the bound later: the young VM, still named by no row, is an orphan now.
        const again = await reconcileAgent({ ...deps(), placement }, "local", "test", log);
        expect(again).toHaveLength(1);
        expect(again[0]).toStartWith(`destroyed VM ${young.vmId}`);
        expect(await reconcileAgent({ ...deps(), placement }, "local", "test", log)).toEqual([]);
      },
      TEST_TIMEOUT_MS,
    );

    test(
      "a create that answers after reconciliation settled its row: its VM is destroyed and nothing bills",
      async () => {
        const key = await h.key("late-co", "pro");
        h.now.ms = at(30_000);
        const placement = new FixedPlacement(h.handle.db, h.agent, h.config.agent);
        const original = h.agent.createSandbox.bind(h.agent);
        let made: string | undefined;
        // The create outlasts the bring-up bound: a reconciliation pass ends its row meanwhile.
        h.agent.createSandbox = async (t, o) => {
          const vm = await original(t, o);
          made = vm.vmId;
          h.now.ms += BRINGUP_BOUND_MS + 1_000;
          await endStuckStarting({ ...deps(), placement }, log);
          return vm;
        };
        try {
          const r = await h.req("POST", "/v1/sandboxes", { key, json: { template: "python" } });
          expect(r.status).toBe(503);
          expect(((await r.json()) as { code: string }).code).toBe("spawn_failed");
        } finally {
          h.agent.createSandbox = original;
        }
        expect(made).toBeDefined();
        expect(h.agent.vms.has(made!)).toBe(false);
        const tenantId = await tenantIdOf(h.handle.db, "late-co");
        const rows = await h.handle.db.select().from(sandboxes).where(eq(sandboxes.tenantId, tenantId!));
        expect(rows.map((r) => [r.state, r.endReason])).toEqual([["destroyed", "failed"]]);
        const open = await h.handle.db
          .select()
          .from(usageIntervals)
          .where(eq(usageIntervals.tenantId, tenantId!));
        expect(open.filter((iv) => iv.endedAt === null)).toEqual([]);
      },
      TEST_TIMEOUT_MS,
    );
  });
}

suite("PGlite", () => makeHarness());

// Started by the suite's first test hook (not for the PGlite suite alone), stopped after the
// file; without the binaries the suite's tests show as skipped, with one test saying why.
const { havePostgres, postgres } = databaseCases();
let pgUrl = "";
describe.skipIf(!havePostgres)("PostgreSQL", () => {
  suite(
    "on a real server",
    async () => {
      pgUrl = (await postgres()).url;
      return makeHarness({ url: pgUrl });
    },
    () => pgUrl,
  );
});
