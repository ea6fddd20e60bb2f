/**
 * Kept snapshots in `snapshot_gb_months` (docs/quotas-and-usage.md "Usage metering"): snapshots
 * taken, failed and deleted through the real gateway routes with an injected clock, the usage
 * computed by the report SQL (gateway/core/usage.ts, `usage_lines`) on PGlite and PostgreSQL, read
 * back through `GET /v1/usage`, `usageReport` (what `sandboxd usage` prints) and the operator views
 * to exact figures.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { eq, sql } from "drizzle-orm";
import { usageTable } from "../../cli/usage.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { snapshots } from "../../db/schema/snapshots.ts";
import { tenantIdOf, usageReport } from "../../gateway/core/usage.ts";
import { type Harness, makeHarness } from "../support/gateway-harness.ts";
import { databaseCases } from "../support/postgres-suite.ts";
import { sqlRows } from "../support/sql-rows.ts";

const { cases } = databaseCases();
/** A migrating PGlite or a PostgreSQL start takes seconds on a loaded host. */
const TEST_TIMEOUT_MS = 60_000;
const GiB = 1024 ** 3;
const HOUR = 3_600_000;
/** Two hours before a UTC midnight: the window crosses into the next day. */
const T0 = Date.parse("2025-03-01T22:00:00Z");
const at = (h: number) => new Date(T0 + h * HOUR);

// biome-ignore lint/suspicious/noExplicitAny: response bodies are checked field by field in the tests
type Body = Record<string, any>;

describe.each(cases)("snapshot_gb_months ($name)", (db) => {
  let h: Harness;
  let acme: string;
  let globex: string;
  const ids: Record<string, string> = {};

  async function post(path: string, key: string, json: Body, status: number): Promise<Body> {
    const res = await h.req("POST", path, { key, json });
    const body = (await res.json()) as Body;
    if (res.status !== status) throw new Error(`POST ${path}: ${res.status} ${JSON.stringify(body)}`);
    return body;
  }
  async function sizeOf(id: string): Promise<number> {
    const [row] = await h.handle.db.select().from(snapshots).where(eq(snapshots.id, id));
    return row!.sizeBytes!;
  }

  beforeAll(async () => {
    h = await makeHarness(db.url ? { url: await db.url() } : {});
    acme = await h.key("acme", "pro");
    globex = await h.key("globex", "pro");
    h.now.ms = at(0).getTime();
    const src = (await post("/v1/sandboxes", acme, { template: "python" }, 201)).id;
    const theirs = (await post("/v1/sandboxes", globex, { template: "python" }, 201)).id;
    // kept: ready at T0, never deleted.
    ids.kept = (await post(`/v1/sandboxes/${src}/snapshots`, acme, {}, 201)).id;
    ids.foreign = (await post(`/v1/sandboxes/${theirs}/snapshots`, globex, {}, 201)).id;
    // gone: ready at T0+1h, deleted at T0+3h.
    h.now.ms = at(1).getTime();
    ids.gone = (await post(`/v1/sandboxes/${src}/snapshots`, acme, {}, 201)).id;
    // failed: the agent refuses it (an exec in flight); it never held anything.
    const [row] = await h.handle.db.select().from(sandboxes).where(eq(sandboxes.id, src));
    const vm = h.agent.vms.get(row!.vmId!)!;
    vm.busy = true;
    await post(`/v1/sandboxes/${src}/snapshots`, acme, {}, 409);
    vm.busy = false;
    const [failed] = await h.handle.db.select().from(snapshots).where(eq(snapshots.state, "failed"));
    ids.failed = failed!.id;
    h.now.ms = at(3).getTime();
    expect((await h.req("DELETE", `/v1/snapshots/${ids.gone}`, { key: acme })).status).toBe(200);
    h.now.ms = at(5).getTime();
  }, TEST_TIMEOUT_MS);
  afterAll(() => h?.close());

  test(
    "an interval per kept snapshot from ready to delete, weighted by size, clipped to the window",
    async () => {
      // What the agent reported: 512 MiB each (the stand-in's memory image, no files written).
      const gib = (await sizeOf(ids.kept!)) / GiB;
      expect(gib).toBe(0.5);
      expect((await sizeOf(ids.gone!)) / GiB).toBe(0.5);
      const usage = async (from: Date, to: Date, key = acme) => {
        const res = await h.req("GET", `/v1/usage?from=${from.toISOString()}&to=${to.toISOString()}`, {
          key,
        });
        expect(res.status).toBe(200);
        return ((await res.json()) as Body).totals.snapshot_gb_months as number;
      };
      // [T0+0.5h, T0+4h): kept 3.5 h, gone 2 h (T0+1h..T0+3h), each 0.5 GiB.
      expect(await usage(at(0.5), at(4))).toBeCloseTo((3.5 * 0.5 + 2 * 0.5) / 730, 12);
      // To T0+10h with now T0+5h: the kept one runs until now (5 h), the deleted one 2 h.
      expect(await usage(at(0), at(10))).toBeCloseTo((5 * 0.5 + 2 * 0.5) / 730, 12);
      // After the delete only the kept one: [T0+3.5h, T0+4h).
      expect(await usage(at(3.5), at(4))).toBeCloseTo((0.5 * 0.5) / 730, 12);
      // Before either was ready: nothing.
      expect(await usage(at(-2), at(0))).toBe(0);
      // The other tenant's: its own only (ready at T0, until now).
      expect(await usage(at(0), at(10), globex)).toBeCloseTo((5 * 0.5) / 730, 12);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "per UTC day and per line: a snapshot is a line of kind `snapshot`; a failed one has none",
    async () => {
      const tenantId = (await tenantIdOf(h.handle.db, "acme"))!;
      const q = { tenantId, from: at(0.5), to: at(4), now: at(5) };
      const days = await usageReport(h.handle.db, { ...q, by: "day" });
      expect(days.map((d) => d.day)).toEqual(["2025-03-01", "2025-03-02"]);
      // Until midnight (T0+2h): kept 1.5 h, gone 1 h; after it: kept 2 h, gone 1 h.
      expect(days[0]!.snapshot_gb_months).toBeCloseTo((1.5 * 0.5 + 1 * 0.5) / 730, 12);
      expect(days[1]!.snapshot_gb_months).toBeCloseTo((2 * 0.5 + 1 * 0.5) / 730, 12);

      const lines = await usageReport(h.handle.db, { ...q, by: "sandbox" });
      const snaps = lines.filter((l) => l.kind === "snapshot");
      expect(snaps.map((l) => [l.sandbox_id, l.state])).toEqual(
        [
          [ids.kept, "ready"],
          [ids.gone, "deleted"],
        ].sort((a, b) => a[0]!.localeCompare(b[0]!)),
      );
      const byId = new Map(snaps.map((l) => [l.sandbox_id, l]));
      expect(byId.get(ids.kept)!.snapshot_gb_months).toBeCloseTo((3.5 * 0.5) / 730, 12);
      expect(byId.get(ids.gone)!).toMatchObject({ running_seconds: 0, cpu_core_hours: 0 });
      expect(byId.get(ids.gone)!.snapshot_gb_months).toBeCloseTo((2 * 0.5) / 730, 12);
      expect(lines.some((l) => l.sandbox_id === ids.failed || l.sandbox_id === ids.foreign)).toBe(false);
      // The source sandbox ran all along and was never suspended: its line has no snapshot figure.
      const src = lines.find((l) => l.kind === "sandbox")!;
      expect(src.snapshot_gb_months).toBe(0);
      expect(src.running_seconds).toBe(3.5 * 3600);

      const total = await usageReport(h.handle.db, { ...q, by: "total" });
      expect(total[0]!.snapshot_gb_months).toBeCloseTo((3.5 * 0.5 + 2 * 0.5) / 730, 12);
      const table = usageTable(lines, "sandbox");
      expect(table).toContain(`${ids.kept}  snapshot  ready`);
    },
    TEST_TIMEOUT_MS,
  );
  test(
    "the operator views carry them: a usage_by_sandbox line per snapshot, and usage_by_tenant_day and usage_by_tenant add them",
    async () => {
      const tenantId = (await tenantIdOf(h.handle.db, "acme"))!;
      const lines = await sqlRows(
        h.handle.db,
        sql`select sandbox_id, kind, template_id, state, end_detail, destroyed_at, running_seconds, snapshot_gb_months
          from usage_by_sandbox where tenant_id = ${tenantId} and kind = 'snapshot' order by sandbox_id`,
      );
      expect(lines.map((l) => [l.sandbox_id, l.state])).toEqual(
        [
          [ids.kept, "ready"],
          [ids.gone, "deleted"],
          [ids.failed, "failed"],
        ].sort((a, b) => a[0]!.localeCompare(b[0]!)),
      );
      const byId = new Map(lines.map((l) => [l.sandbox_id as string, l]));
      // All time: the deleted one from ready (T0+1h) to its delete (T0+3h), 0.5 GiB; a failed one costs nothing.
      const gone = byId.get(ids.gone!)!;
      expect(Number(gone.snapshot_gb_months)).toBeCloseTo((2 * 0.5) / 730, 12);
      expect(Number(gone.running_seconds)).toBe(0);
      expect(new Date(gone.destroyed_at as string).getTime()).toBe(at(3).getTime());
      expect(gone.template_id).toBe("python");
      expect(Number(byId.get(ids.failed!)!.snapshot_gb_months)).toBe(0);
      // The kept one runs until the database's now (the views are all time): at least from T0 to T0+5h.
      const kept = Number(byId.get(ids.kept!)!.snapshot_gb_months);
      expect(kept).toBeGreaterThan((5 * 0.5) / 730);

      // Per day: 2025-03-01 is closed (T0 to its midnight at T0+2h): kept 2 h, gone 1 h.
      const days = await sqlRows(
        h.handle.db,
        sql`select day::text as day, snapshot_gb_months from usage_by_tenant_day where tenant_id = ${tenantId} order by day`,
      );
      expect(days[0]!.day).toBe("2025-03-01");
      expect(Number(days[0]!.snapshot_gb_months)).toBeCloseTo((2 * 0.5 + 1 * 0.5) / 730, 12);
      // Per tenant: every snapshot line's figure, and nothing of the other tenant's (its sandboxes
      // were never suspended, so snapshots are all of it).
      const [tenant] = await sqlRows(
        h.handle.db,
        sql`select snapshot_gb_months from usage_by_tenant where tenant_id = ${tenantId}`,
      );
      const sum = lines.reduce((a, l) => a + Number(l.snapshot_gb_months), 0);
      // The views read now() each: the kept one grows between the two reads by microseconds.
      expect(Number(tenant!.snapshot_gb_months)).toBeCloseTo(sum, 6);
      expect(Number(tenant!.snapshot_gb_months)).toBeGreaterThanOrEqual(sum);
    },
    TEST_TIMEOUT_MS,
  );
});
