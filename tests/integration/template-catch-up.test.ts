/**
 * Templates reach agents that join after their bake (gateway/core/template-catch-up.ts), through
 * the real gateway app (tests/support/gateway-harness.ts, answers checked against openapi.yaml)
 * and AgentRouter on the real `agents` and `templates` tables, with
 * in-memory agents whose registry rows are written by `recordHeartbeat`. A bake while one agent
 * is live builds there and goes Live; an agent that joins later is given a copy from the agent
 * that holds it, from its heartbeat (once: the next beats within the bound ask nothing, and
 * nothing once it reports the template); with no agent to copy from it is asked to build the same
 * OCI reference with the same ready spec; an agent owned by another tenant, or in another region,
 * is never asked; another tenant's agent is never copied from, and an uploaded template with no
 * holder to copy from is not rebuilt. The real bundle and its checks: tests/vm/template-copy.test.ts.
 */
import { afterEach, describe, expect, test } from "bun:test";
import { eq } from "drizzle-orm";
import { DEFAULT_REGION } from "../../contracts/agent/enroll.ts";
import type { Heartbeat } from "../../contracts/agent/heartbeat.ts";
import { agents } from "../../db/schema/agents.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { templates } from "../../db/schema/templates.ts";
import { usageIntervals } from "../../db/schema/usage-intervals.ts";
import { recordHeartbeat } from "../../gateway/agents/registry.ts";
import { AgentRouter } from "../../gateway/agents/router.ts";
import { CATCH_UP_EVERY_MS, TemplateCatchUp } from "../../gateway/core/template-catch-up.ts";
import { makeHarness } from "../support/gateway-harness.ts";
import { MemoryAgent } from "../support/memory-agent.ts";
import { databaseCases } from "../support/postgres-suite.ts";

const SECRET = "catch-up-test-agent-secret-0123456789abcdef";
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
      "an agent that joins after a bake gets a copy from one that holds it, else a rebuild, once; another tenant's agent and another region's never",
      async () => {
        const mem = new Map<string, MemoryAgent>();
        let router!: AgentRouter;
        const h = await makeHarness({
          ...(c.url ? { url: await c.url() } : {}),
          placement: (db, clock) => {
            router = new AgentRouter({
              db,
              agentSecret: SECRET,
              region: DEFAULT_REGION,
              clock,
              connect: (row) => mem.get(row.id)!,
            });
            return router;
          },
        });
        cleanups.push(() => h.close());
        const db = h.handle.db;
        const now = h.now;
        const clock = () => now.ms;
        const config = h.config;
        if (c.url) {
          // A PostgreSQL database outlives a test: start from no agents and no templates.
          await db.delete(usageIntervals);
          await db.delete(sandboxes);
          await db.delete(templates);
          await db.delete(agents);
        }
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
        const pro = await h.key("acme", "pro");
        const req = (method: string, path: string, json?: unknown) =>
          h.req(method, path, { key: pro, ...(json ? { json } : {}) });

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
        const calls = (id: string, what: string) =>
          mem.get(id)?.calls.filter((x) => x.startsWith(what)) ?? [];
        for (const id of ["first", "late", "foreign-owned", "elsewhere"]) catchUp.onHeartbeat(id);
        for (let i = 0; i < 200 && calls("late", "copy ").length === 0; i++) await Bun.sleep(10);
        // Copied from the agent that holds it (the gateway streams one's bundle into the other),
        // not rebuilt; the look waits for the copy to settle.
        expect(calls("late", "copy ")).toEqual([`copy ${ref}`]);
        expect(calls("first", "export ")).toEqual([`export ${ref}`]);
        mem.get("late")!.finishBuild(ref, true);
        for (let i = 0; i < 300 && !lines.some((l) => l.includes("copied from agent first to late")); i++)
          await Bun.sleep(10);
        expect(lines.some((l) => l.includes("copied from agent first to late"))).toBe(true);
        await Bun.sleep(50);
        expect(builds("late")).toEqual([]);
        expect(builds("first")).toHaveLength(1);
        for (const id of ["foreign-owned", "elsewhere"]) {
          expect(builds(id)).toEqual([]);
          expect(calls(id, "copy ")).toEqual([]);
        }

        // Its next beats within the bound ask nothing again, nor after it reports the template.
        catchUp.onHeartbeat("late");
        now.ms += CATCH_UP_EVERY_MS + 1;
        await beat("late");
        expect(await catchUp.look("late")).toEqual([]);
        expect(calls("late", "copy ")).toHaveLength(1);

        // No agent may copy it (its holders gone quiet about it): rebuilt from the stored source,
        // the bake's reference and ready spec (no credentials: none stored).
        await db.update(agents).set({ templates: [] }).where(eq(agents.id, "first"));
        await db.update(agents).set({ templates: [] }).where(eq(agents.id, "late"));
        await beat("fresh");
        expect(await catchUp.look("fresh")).toEqual([ref]);
        expect(builds("fresh")).toEqual([`build ${ref} oci`]);
        const asked = (
          mem.get("fresh") as unknown as { templates: Map<string, { source: unknown }> }
        ).templates.get(ref);
        expect(asked?.source).toMatchObject({ kind: "oci", image: "reg.test/web:1", ready: READY });
        const bake = (
          mem.get("first") as unknown as { templates: Map<string, { source: unknown }> }
        ).templates.get(ref);
        expect(asked?.source).toEqual(bake?.source);
        expect(lines.some((l) => l.includes("building on agent fresh, which joined after its bake"))).toBe(
          true,
        );

        // An uploaded template (no stored reference) held only by another tenant's agent: a
        // shared agent is never given a copy from it, and there is nothing to rebuild from.
        await db.update(templates).set({ image: null }).where(eq(templates.id, "web"));
        await db
          .update(agents)
          .set({ templates: [ref] })
          .where(eq(agents.id, "foreign-owned"));
        await beat("newest");
        expect(await catchUp.look("newest")).toEqual([]);
        expect(calls("foreign-owned", "export ")).toEqual([]);
        expect(calls("newest", "copy ")).toEqual([]);
        expect(builds("newest")).toEqual([]);
        expect(
          lines.some((l) => l.includes("agent newest lacks it and no agent holds it to copy from")),
        ).toBe(true);
      },
      TEST_TIMEOUT_MS,
    );

    test(
      "a template of several size classes is rebuilt on a late agent with every class, not copied",
      async () => {
        const mem = new Map<string, MemoryAgent>();
        let router!: AgentRouter;
        const h = await makeHarness({
          ...(c.url ? { url: await c.url() } : {}),
          placement: (db, clock) => {
            router = new AgentRouter({
              db,
              agentSecret: SECRET,
              region: DEFAULT_REGION,
              clock,
              connect: (row) => mem.get(row.id)!,
            });
            return router;
          },
        });
        cleanups.push(() => h.close());
        const db = h.handle.db;
        if (c.url) {
          await db.delete(usageIntervals);
          await db.delete(sandboxes);
          await db.delete(templates);
          await db.delete(agents);
        }
        const catchUp = new TemplateCatchUp(
          { db, clock: () => h.now.ms, placement: router, config: h.config },
          () => {},
        );
        const beat = async (id: string) => {
          if (!mem.has(id)) {
            mem.set(id, new MemoryAgent());
            await db.insert(agents).values({ id, region: h.config.region, url: `mem://${id}`, keyId: "k1" });
          }
          const held = [...mem.get(id)!.templates]
            .filter(([, t]) => t.status === "ready")
            .map(([ref]) => ref);
          const hb: Heartbeat = {
            id,
            region: h.config.region,
            url: `mem://${id}`,
            capacity: { slotsFree: 8, slotsTotal: 8, vcpusFree: 32, memMibFree: 16_384 },
            templates: held,
          };
          expect(await recordHeartbeat(db, hb, "k1", new Date(h.now.ms))).toBe(true);
        };
        const pro = await h.key("acme", "pro");
        await beat("first");
        const sizes = [
          { vcpus: 1, memory_mib: 128 },
          { vcpus: 2, memory_mib: 192 },
        ];
        const bake = { name: "multi", image: "reg.test/web:1", sizes };
        expect((await h.req("POST", "/v1/templates", { key: pro, json: bake })).status).toBe(202);
        const [row] = await db.select().from(templates).where(eq(templates.id, "multi"));
        const ref = row!.agentRef;
        mem.get("first")!.finishBuild(ref, true);
        await h.req("GET", "/v1/templates/multi", { key: pro });
        await beat("first");
        await beat("late");
        expect(await catchUp.look("late")).toEqual([ref]);
        const late = mem.get("late")!;
        expect(late.calls.filter((x) => x.startsWith("copy "))).toEqual([]);
        expect(mem.get("first")!.calls.filter((x) => x.startsWith("export "))).toEqual([]);
        expect(late.calls.filter((x) => x.startsWith("build "))).toEqual([`build ${ref} oci`]);
        expect(late.templates.get(ref)?.source).toMatchObject({
          kind: "oci",
          sizes: [
            { vcpus: 1, memMib: 128 },
            { vcpus: 2, memMib: 192 },
          ],
        });
      },
      TEST_TIMEOUT_MS,
    );
  });
}
