/**
 * A gateway over several in-memory agents (memory-agent.ts) behind the REAL router
 * (gateway/agents/router.ts: placement, cordon, `agentFor`), with the real reconciler and
 * host-loss sweeper on the real clock, so that timelines are measured, not stepped. Each agent
 * "heartbeats" by the registry's own write (`recordHeartbeat`) and the reconciler's hook, as
 * `handleHeartbeat` does after checking a signed token (that part: tests/integration/agent-credentials.test.ts).
 * Requests go through `app.request()` and are checked against openapi.yaml. Test code only.
 */
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { eq } from "drizzle-orm";
import type { Limits } from "../../contracts/api/limits.ts";
import { type DbHandle, openDb } from "../../db/client.ts";
import { agents } from "../../db/schema/agents.ts";
import { recordHeartbeat } from "../../gateway/agents/registry.ts";
import { AgentRouter } from "../../gateway/agents/router.ts";
import { createApp } from "../../gateway/app.ts";
import { createKey } from "../../gateway/auth/keys.ts";
import { resolveConfig } from "../../gateway/config.ts";
import { startHostLossSweeper } from "../../gateway/core/host-loss.ts";
import { startReconciler } from "../../gateway/core/reconcile.ts";
import { upsertPublicTemplate } from "../../gateway/core/templates.ts";
import { PEPPER } from "./gateway-harness.ts";
import { MemoryAgent } from "./memory-agent.ts";
import { assertFetchResponse } from "./openapi-check.ts";

const SECRET = "fleet-harness-agent-secret-0123456789abcdef";

export interface FleetHarness {
  handle: DbHandle;
  agents: Map<string, MemoryAgent>;
  router: AgentRouter;
  /** Sweeps for lost agents now (the timer does too). */
  sweep(): Promise<{ lost: string[]; ended: string[] }>;
  /**
   * Starts (or stops) agent `id`'s heartbeats; resolves once no beat of it is in flight (one
   * begun before a stop may otherwise land seconds later on a loaded host, as a live agent's
   * late beat would: the agent is then not silent from the stop on).
   */
  beating(id: string, on: boolean): Promise<void>;
  key(tenant: string): Promise<string>;
  req(method: string, path: string, opts?: { key?: string; json?: unknown }): Promise<Response>;
  logs: string[];
  close(): Promise<void>;
}

export async function makeFleet(opts: {
  url?: string;
  ids: string[];
  /** The region of these agents and of the gateway: tests sharing one PostgreSQL each take their own. */
  region: string;
  limits?: Partial<Limits>;
  staleAfterMs: number;
  lostAfterMs: number;
  sweepMs: number;
  beatMs: number;
}): Promise<FleetHarness> {
  const dir = mkdtempSync(join(tmpdir(), "sandboxd-fleet-"));
  const handle = await openDb(opts.url !== undefined ? { url: opts.url } : { dataDir: dir });
  const db = handle.db;
  const REGION = opts.region;
  const clock = Date.now;
  const logs: string[] = [];
  const log = (line: string) => logs.push(line);
  const fleet = new Map(opts.ids.map((id) => [id, new MemoryAgent()]));
  for (const [id, a] of fleet) {
    a.addReadyTemplate("python");
    await db.insert(agents).values({
      id,
      region: REGION,
      url: `http://${id}.invalid`,
      keyId: "k1",
      enrolledAt: new Date(),
      lastHeartbeatAt: new Date(),
      slotsTotal: 1000,
      slotsFree: 1000,
    });
  }
  const config = resolveConfig({
    keyPepper: PEPPER,
    connectSecret: "test-connect-secret-0123",
    uploadDir: join(dir, "uploads"),
    publicBaseUrl: "https://api.example.test",
    version: "test-1",
    region: REGION,
    ...(opts.limits ? { limits: opts.limits } : {}),
  });
  await upsertPublicTemplate({ db, clock }, { id: "python", name: "Python 3", description: "CPython 3.12" });
  const router = new AgentRouter({
    db,
    agentSecret: SECRET,
    region: REGION,
    clock,
    staleAfterMs: opts.staleAfterMs,
    connect: (row) => fleet.get(row.id)!,
  });
  const app = createApp({ db, agent: router, placement: router, config, clock, log });
  const reconciler = startReconciler(
    { db, clock, placement: router },
    {
      liveAgents: async () => [...fleet.keys()],
      staleAfterMs: opts.staleAfterMs,
      // Only the heartbeat after a gap runs it here: the timer's passes would blur what is measured.
      intervalMs: 3_600_000,
      log,
    },
  );
  const sweeper = startHostLossSweeper(
    { db, clock },
    { lostAfterMs: opts.lostAfterMs, intervalMs: opts.sweepMs, log },
  );
  const beats = new Map<string, ReturnType<typeof setInterval>>();
  const beat = async (id: string) => {
    const a = fleet.get(id)!;
    const [prev] = await db.select().from(agents).where(eq(agents.id, id));
    const h = await a.health();
    await recordHeartbeat(
      db,
      { id, region: REGION, url: `http://${id}.invalid`, capacity: h.capacity },
      "k1",
      new Date(clock()),
    );
    reconciler.onHeartbeat(id, prev?.lastHeartbeatAt ?? null);
  };
  const inFlight = new Set<Promise<void>>();
  // A beat still in flight when the harness closes fails on the closed db: logged, not thrown.
  const fire = (id: string) => {
    const p: Promise<void> = beat(id)
      .catch((err) => {
        log(`beat ${id}: ${String(err)}`);
      })
      .finally(() => inFlight.delete(p));
    inFlight.add(p);
  };
  const beating = async (id: string, on: boolean) => {
    clearInterval(beats.get(id));
    beats.delete(id);
    if (on) {
      fire(id);
      beats.set(
        id,
        setInterval(() => fire(id), opts.beatMs),
      );
    } else await Promise.all([...inFlight]);
  };
  for (const id of opts.ids) beating(id, true);
  return {
    handle,
    agents: fleet,
    router,
    sweep: sweeper.sweep,
    beating,
    logs,
    key: async (tenant) => (await createKey(db, PEPPER, { tenant, tier: "pro" })).key,
    req: async (method, path, o = {}) => {
      const headers: Record<string, string> = {};
      if (o.key !== undefined) headers.authorization = `Bearer ${o.key}`;
      const init: RequestInit = { method, headers };
      if (o.json !== undefined) {
        init.body = JSON.stringify(o.json);
        headers["content-type"] = "application/json";
      }
      const res = await app.request(path, init);
      await assertFetchResponse(method, path, res);
      return res;
    },
    close: async () => {
      for (const id of opts.ids) await beating(id, false);
      reconciler.stop();
      sweeper.stop();
      await handle.close();
      rmSync(dir, { recursive: true, force: true });
    },
  };
}
