/**
 * The db layer against both backends: PGlite in a temp dir and a real PostgreSQL started by the
 * test (skipped, with a message, only when the postgres binaries are absent). Migrations apply,
 * keys are issued/listed/revoked and stored only hashed, and usage is computed in SQL.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { eq } from "drizzle-orm";
import { parseApiKey } from "../../contracts/api/api-key.ts";
import { type DbHandle, openDb } from "../../db/client.ts";
import { agents } from "../../db/schema/agents.ts";
import { apiKeys } from "../../db/schema/api-keys.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { templates } from "../../db/schema/templates.ts";
import { usageIntervals } from "../../db/schema/usage-intervals.ts";
import { createKey, ensureTenant, listKeys, revokeKey, verifyKey } from "../../gateway/auth/keys.ts";
import { usageTotals } from "../../gateway/core/usage.ts";
import { onPostgres } from "../support/postgres-suite.ts";

const PEPPER = "db-test-pepper-0123456789";

function suite(name: string, open: () => Promise<DbHandle>) {
  describe(name, () => {
    let h: DbHandle;
    beforeAll(async () => {
      h = await open();
    });
    afterAll(() => h.close());

    test("keys: created once, stored hashed, listed, verified, revoked", async () => {
      const k = await createKey(h.db, PEPPER, { tenant: "t1", tier: "pro", name: "ci" });
      expect(k.key).toMatch(/^svc_pro_[a-z0-9]{12}_[A-Za-z0-9]{40}$/);
      const [row] = await h.db.select().from(apiKeys).where(eq(apiKeys.id, k.keyId));
      expect(row!.hash).toMatch(/^[0-9a-f]{64}$/);
      expect(JSON.stringify(row)).not.toContain(k.key.split("_").at(-1)!);
      expect(await verifyKey(h.db, PEPPER, k.key)).toEqual({
        tenantId: k.tenantId,
        keyId: k.keyId,
        tier: "pro",
        api: "sandboxes",
      });
      expect(await verifyKey(h.db, "another-pepper-0123456789", k.key)).toBeNull();
      const k2 = await createKey(h.db, PEPPER, { tenant: "t1", tier: "live" });
      expect(k2.tenantId).toBe(k.tenantId); // tenant created on demand, once
      const listed = await listKeys(h.db, { tenant: "t1" });
      expect(listed.map((l) => l.prefix)).toEqual([k.prefix, k2.prefix]);
      expect(await revokeKey(h.db, k.prefix)).toBe(true);
      expect(await revokeKey(h.db, k.keyId)).toBe(false);
      expect(await verifyKey(h.db, PEPPER, k.key)).toBeNull();
      expect(await verifyKey(h.db, PEPPER, k2.key)).not.toBeNull();
      expect((await listKeys(h.db, { tenant: "t1" }))[0]!.revokedAt).toBeInstanceOf(Date);
    });

    test("keys of a tenant at home in a region name it; they verify, list and revoke by prefix", async () => {
      const k = await createKey(h.db, PEPPER, { tenant: "homed", tier: "pro", region: "eu_west.1-b" });
      expect(k.key).toMatch(/^svc_pro_eu_west\.1-b_[a-z0-9]{12}_[A-Za-z0-9]{40}$/);
      expect(k.prefix).toBe(`svc_pro_eu_west.1-b_${k.keyId}`);
      expect(parseApiKey(k.key)).toMatchObject({ tier: "pro", keyId: k.keyId, region: "eu_west.1-b" });
      expect(await verifyKey(h.db, PEPPER, k.key)).toMatchObject({ keyId: k.keyId, tier: "pro" });
      // The region is covered by the hash: another region on the same id and secret is refused.
      expect(await verifyKey(h.db, PEPPER, k.key.replace("_eu_west.1-b_", "_us_"))).toBeNull();
      expect(await verifyKey(h.db, PEPPER, k.key.replace("_eu_west.1-b_", "_"))).toBeNull();
      // A later key of the tenant, naming no region, still carries its home.
      const k2 = await createKey(h.db, PEPPER, { tenant: "homed", tier: "live" });
      expect(k2.key.startsWith("svc_live_eu_west.1-b_")).toBe(true);
      expect(await revokeKey(h.db, k.prefix)).toBe(true);
      expect(await verifyKey(h.db, PEPPER, k.key)).toBeNull();
      expect(await revokeKey(h.db, k2.key)).toBe(true); // a whole key names its id too
    });

    test("usage: overlap of intervals with the window, by state, in SQL", async () => {
      const tenantId = await ensureTenant(h.db, "usage-co");
      const other = await ensureTenant(h.db, "other-co");
      await h.db.insert(agents).values({ id: "a1", region: "r", url: "u" }).onConflictDoNothing();
      await h.db
        .insert(templates)
        .values({ pk: "tpl_u", id: "u", api: "sandboxes", agentRef: "u", name: "u", status: "ready" })
        .onConflictDoNothing();
      const sb = (id: string, t: string) => ({
        id,
        tenantId: t,
        api: "sandboxes" as const,
        kind: "sandbox" as const,
        templatePk: "tpl_u",
        templateId: "u",
        agentId: "a1",
        state: "running" as const,
        createdAt: new Date("2025-01-01T00:00:00Z"),
      });
      await h.db
        .insert(sandboxes)
        .values([sb("sbx_u1", tenantId), sb("sbx_u2", tenantId), sb("sbx_o1", other)]);
      const GiB = 1024 ** 3;
      const iv = (
        sandboxId: string,
        t: string,
        state: "running" | "paused" | "suspended",
        start: string,
        end: string | null,
        vcpus: number,
        memMib: number,
        diskBytes: number,
      ) => ({
        sandboxId,
        tenantId: t,
        state,
        vcpus,
        memMib,
        diskBytes,
        startedAt: new Date(start),
        endedAt: end === null ? null : new Date(end),
      });
      await h.db.insert(usageIntervals).values([
        // 2 vCPU, 2 GiB RAM, 1 GiB disk, running 09:00-11:00: 1h inside a 10:00-12:00 window
        iv("sbx_u1", tenantId, "running", "2025-01-01T09:00:00Z", "2025-01-01T11:00:00Z", 2, 2048, GiB),
        // suspended 11:00 onwards (open) with a 4 GiB snapshot: until now=11:30 -> 0.5h
        iv("sbx_u1", tenantId, "suspended", "2025-01-01T11:00:00Z", null, 0, 0, 4 * GiB),
        // paused 10:30-11:30: memory and disk only, 1h
        iv("sbx_u2", tenantId, "paused", "2025-01-01T10:30:00Z", "2025-01-01T11:30:00Z", 4, 1024, 2 * GiB),
        // entirely before the window
        iv("sbx_u2", tenantId, "running", "2025-01-01T08:00:00Z", "2025-01-01T09:00:00Z", 8, 8192, GiB),
        // another tenant
        iv("sbx_o1", other, "running", "2025-01-01T10:00:00Z", null, 16, 16384, GiB),
      ]);
      const t = await usageTotals(
        h.db,
        tenantId,
        new Date("2025-01-01T10:00:00Z"),
        new Date("2025-01-01T12:00:00Z"),
        new Date("2025-01-01T11:30:00Z"),
      );
      expect(t.cpu_core_hours).toBeCloseTo(2 * 1, 9);
      expect(t.ram_gb_hours).toBeCloseTo(2 * 1 + 1 * 1, 9);
      expect(t.disk_gb_hours).toBeCloseTo(1 * 1 + 2 * 1, 9);
      expect(t.snapshot_gb_months).toBeCloseTo((4 * 0.5) / 730, 12);
      const none = await usageTotals(
        h.db,
        tenantId,
        new Date("2024-01-01T00:00:00Z"),
        new Date("2024-02-01T00:00:00Z"),
        new Date("2025-01-01T11:30:00Z"),
      );
      expect(none).toEqual({ cpu_core_hours: 0, ram_gb_hours: 0, disk_gb_hours: 0, snapshot_gb_months: 0 });
    });

    test("one open usage interval per sandbox, one live template id per owner", async () => {
      const tenantId = await ensureTenant(h.db, "usage-co");
      await expect(
        (async () =>
          h.db.insert(usageIntervals).values({
            sandboxId: "sbx_u1",
            tenantId,
            state: "running",
            vcpus: 1,
            memMib: 1,
            diskBytes: 1,
            startedAt: new Date(),
          }))(),
      ).rejects.toThrow();
      await expect(
        (async () =>
          h.db.insert(templates).values({
            pk: "tpl_dup",
            id: "u",
            api: "sandboxes",
            agentRef: "u2",
            name: "u",
            status: "ready",
          }))(),
      ).rejects.toThrow();
    });
  });
}

const dirs: string[] = [];
afterAll(() => {
  for (const d of dirs) rmSync(d, { recursive: true, force: true });
});

suite("PGlite", async () => {
  const d = mkdtempSync(join(tmpdir(), "sandboxd-db-"));
  dirs.push(d);
  return openDb({ dataDir: d });
});

onPostgres((name, url) => suite(name, async () => openDb({ url: await url() })));
