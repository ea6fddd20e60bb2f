/**
 * Templates reach agents that join after their bake (gateway/core/template-catch-up.ts), through
 * the real gateway app and AgentRouter on the real `agents` and `templates` tables, with
 * in-memory agents whose registry rows are written by `recordHeartbeat`. A bake while one agent
 * is live builds there and goes Live; an agent that joins later is asked, from its heartbeat, to
 * build the same OCI reference with the same ready spec (once: the next beats within the bound ask
 * nothing, and nothing once it reports the template); an agent owned by another tenant, or in
 * another region, is never asked; an uploaded template is not rebuilt.
 */
import { afterEach, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { eq } from "drizzle-orm";
import type { Heartbeat } from "../../contracts/agent/heartbeat.ts";
import { openDb } from "../../db/client.ts";
import { agents } from "../../db/schema/agents.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { templates } from "../../db/schema/templates.ts";
import { usageIntervals } from "../../db/schema/usage-intervals.ts";
import { recordHeartbeat } from "../../gateway/agents/registry.ts";
import { AgentRouter } from "../../gateway/agents/router.ts";
import { createApp } from "../../gateway/app.ts";
import { createKey } from "../../gateway/auth/keys.ts";
import { resolveConfig } from "../../gateway/config.ts";
import { CATCH_UP_EVERY_MS, TemplateCatchUp } from "../../gateway/core/template-catch-up.ts";
import { MemoryAgent } from "../support/memory-agent.ts";
import { databaseCases } from "../support/postgres-suite.ts";

const SECRET = "catch-up-test-agent-secret-0123456789abcdef";
const PEPPER = "catch-up-test-pepper-0123456789";
const TEST_TIMEOUT_MS = 60_000;
const READY = { cmd: "true", ports: [8080] };

const cleanups: Array<() => Promise<void>> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

const { cases } = databaseCases();

for (const c of cases) {
  describe(`template catch-up (${c.name})`, () => {
    test(
      "an agent that joins after a bake is asked to build it, once; another tenant's agent and another region's never",
      async () => {
        const dir = mkdtempSync(join(tmpdir(), "sandboxd-catchup-"));
        const u = c.url ? await c.url() : undefined;
        const h = await openDb(u !== undefined ? { url: u } : { dataDir: dir });
        cleanups.push(async () => {
          await h.close();
          rmSync(dir, { recursive: true, force: true });
        });
        const db = h.db;
        if (u !== undefined) {
          await db.delete(usageIntervals);
          await db.delete(sandboxes);
          await db.delete(templates);
          await db.delete(agents);
        }
        const now = { ms: Date.parse("2025-03-01T12:00:00Z") };
        const clock = () => now.ms;
        const config = resolveConfig({
          keyPepper: PEPPER,
          connectSecret: "test-connect-secret-0123",
          uploadDir: join(dir, "uploads"),
          publicBaseUrl: "https://api.example.test",
          version: "test-1",
        });
        const mem = new Map<string, MemoryAgent>();
        const router = new AgentRouter({
          db,
          agentSecret: SECRET,
          region: config.region,
          clock,
          connect: (row) => mem.get(row.id)!,
        });
        const app = createApp({ db, agent: router, placement: router, config, clock, log: () => {} });
        const lines: string[] = [];
        const catchUp = new TemplateCatchUp({ db, clock, placement: router, config }, (l) => lines.push(l));
        const beat = async (id: string, region = config.region) => {
          if (!mem.has(id)) {
            mem.set(id, new MemoryAgent());
            await db.insert(agents).values({ id, region, url: `mem://${id}`, keyId: "k1" });
          }
          const held = [
            ...(mem.get(id) as unknown as { templates: Map<string, { status: string }> }).templates,
          ]
            .filter(([, t]) => t.status === "ready")
            .map(([ref]) => ref);
          const hb: Heartbeat = {
            id,
            region,
            url: `mem://${id}`,
            capacity: { slotsFree: 8, slotsTotal: 8, vcpusFree: 32, memMibFree: 16_384 },
            templates: held,
          };
          expect(await recordHeartbeat(db, hb, "k1", new Date(now.ms))).toBe(true);
        };
        const builds = (id: string) => mem.get(id)?.calls.filter((x) => x.startsWith("build ")) ?? [];
        const pro = (await createKey(db, PEPPER, { tenant: "acme", tier: "pro" })).key;
        const req = (method: string, path: string, body?: unknown) =>
          app.request(path, {
            method,
            headers: { authorization: `Bearer ${pro}`, "content-type": "application/json" },
            ...(body ? { body: JSON.stringify(body) } : {}),
          });

        await beat("first");
        expect(
          (await req("POST", "/v1/templates", { name: "web", image: "reg.test/web:1", ready: READY })).status,
        ).toBe(202);
        const [row] = await db.select().from(templates).where(eq(templates.id, "web"));
        const ref = row!.agentRef;
        expect(builds("first")).toEqual([`build ${ref} oci`]);
        mem.get("first")!.finishBuild(ref, true);
        const got = await (await req("GET", "/v1/templates/web")).json();
        expect((got as { phase: string }).phase).toBe("Live");
        await beat("first");

        // Later: an agent of the region, one owned by another tenant, one of another region.
        await beat("late");
        await beat("foreign-owned");
        await db.update(agents).set({ ownerTenant: "ten_other" }).where(eq(agents.id, "foreign-owned"));
        await beat("elsewhere", "far");
        for (const id of ["first", "late", "foreign-owned", "elsewhere"]) catchUp.onHeartbeat(id);
        for (let i = 0; i < 100 && builds("late").length === 0; i++) await Bun.sleep(10);
        expect(builds("late")).toEqual([`build ${ref} oci`]);
        // The stored source: the bake's reference and ready spec (no credentials: none stored).
        const asked = (
          mem.get("late") as unknown as { templates: Map<string, { source: unknown }> }
        ).templates.get(ref);
        expect(asked?.source).toMatchObject({ kind: "oci", image: "reg.test/web:1", ready: READY });
        // What the bake itself sent, but for credentials (this bake gave none).
        const first = (
          mem.get("first") as unknown as { templates: Map<string, { source: unknown }> }
        ).templates.get(ref);
        expect(asked?.source).toEqual(first?.source);
        await Bun.sleep(50);
        expect(builds("first")).toHaveLength(1);
        expect(builds("foreign-owned")).toEqual([]);
        expect(builds("elsewhere")).toEqual([]);

        // Its next beats within the bound ask nothing again, nor after it reports the template.
        catchUp.onHeartbeat("late");
        now.ms += CATCH_UP_EVERY_MS + 1;
        mem.get("late")!.finishBuild(ref, true);
        await beat("late");
        expect(await catchUp.look("late")).toEqual([]);
        expect(builds("late")).toHaveLength(1);
        expect(lines.some((l) => l.includes("joined after its bake"))).toBe(true);

        // An uploaded template (no stored reference) is not rebuilt on a new agent.
        await db.update(templates).set({ image: null }).where(eq(templates.id, "web"));
        await beat("newest");
        expect(await catchUp.look("newest")).toEqual([]);
      },
      TEST_TIMEOUT_MS,
    );
  });
}
