import { afterAll, afterEach, describe, expect, test } from "bun:test";
import { copyFile, rm } from "node:fs/promises";
import { join } from "node:path";
import { eq } from "drizzle-orm";
import type { HeartbeatSender } from "../../agent/api/heartbeat.ts";
import { SandboxManager } from "../../agent/sandbox/manager.ts";
import { HEARTBEAT_PATH } from "../../contracts/agent/heartbeat.ts";
import { agents } from "../../db/schema/agents.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { liveAgents } from "../../gateway/agents/registry.ts";
import { createKey } from "../../gateway/auth/keys.ts";
import { upsertPublicTemplate } from "../../gateway/core/templates.ts";
import type { RunningGateway } from "../../gateway/server.ts";
import { startEnrolledAgent, startRoutingGateway } from "../support/agents.ts";
import { BootDriver } from "../support/boot-driver.ts";
import {
  busyboxArchive,
  leftovers,
  removeBusyboxArchive,
  TEST_CACHE_DIR,
  tempStateDir,
  waitFor,
} from "../support/real-vm.ts";

/**
 * Routing to several host agents (gateway/agents/router.ts): a real gateway (startGateway, PGlite)
 * and real agent HTTP servers (startAgentServer over a SandboxManager) that enroll with a one-time
 * token, then heartbeat over HTTP with their own keys. The VM tests cold-boot REAL busybox VMs under TCG (BootDriver).
 */

/** The gateway's agent secret, from which each enrolled agent's key is derived. */
const SECRET = "routing-test-agent-secret-0123456789abcdef";
/** Fast beats and a short staleness bound keep the test quick; the ratio is production's (1:3+). */
const HB_MS = 200;
const STALE_MS = 1_500;
const VM_TEST_TIMEOUT_MS = 240_000;
/** Three PGlite enrollments and two staleness waits (2 x 1.8 s) on a loaded host. */
const TEST_TIMEOUT_MS = 60_000;
/**
 * A bound on waits for what takes a beat or a staleness bound (a few seconds at most): it only
 * catches a hang, on a 2-core TCG host shared with other test files.
 */
const HANG_MS = 20_000;
/**
 * A call to a dead agent fails on its refused connection; without that it would wait out the
 * agent client's deadline (a VM operation's 60 s and more). Only that is caught by this bound.
 */
const FAILS_FAST_MS = 15_000;

const cleanups: Array<() => Promise<void>> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});
afterAll(removeBusyboxArchive);

interface TestAgent {
  id: string;
  url: string;
  manager: SandboxManager;
  hb: HeartbeatSender;
  /** Stops serving and heartbeating (the process "dies"); VMs stay for cleanup. */
  kill(): Promise<void>;
}

async function startGw(): Promise<{ gw: RunningGateway; key: string }> {
  const gw = await startRoutingGateway({
    agentSecret: SECRET,
    staleAfterMs: STALE_MS,
    // A create with no live agent waits this long for one before at_capacity (15 s by default).
    agentWaitMs: 1_000,
    onCleanup: (c) => cleanups.push(c),
  });
  const key = await gw.withDb(async (db) => {
    await upsertPublicTemplate(
      { db, clock: Date.now },
      { id: "busybox", name: "busybox", description: "test", status: "ready" },
    );
    return (await createKey(db, gw.config.keyPepper, { tenant: "routing", tier: "pro" })).key;
  });
  return { gw, key };
}

async function startAgent(
  gw: RunningGateway,
  id: string,
  region: string,
  slots: number,
  opts: { template?: boolean } = {},
): Promise<TestAgent> {
  const stateDir = await tempStateDir();
  const driver = await BootDriver.create({ cacheDir: TEST_CACHE_DIR, stateDir });
  const manager = await SandboxManager.open({ driver, stateDir, capacity: { slots } });
  const { server, hb } = await startEnrolledAgent({
    gw,
    agentSecret: SECRET,
    manager,
    stateDir,
    id,
    region,
    intervalMs: HB_MS,
  });
  let killed = false;
  const kill = async () => {
    if (killed) return;
    killed = true;
    hb.stop();
    await server.stop();
  };
  cleanups.push(async () => {
    await kill();
    for (const s of manager.list()) await manager.destroy(s.id, { force: true });
    await manager.detach();
    const left = await leftovers(stateDir);
    await rm(stateDir, { recursive: true, force: true });
    expect(left).toEqual({ qemus: [], vmDirs: [] });
  });
  if (opts.template) {
    const path = join(stateDir, "busybox.tar");
    await copyFile(await busyboxArchive(), path);
    manager.buildTemplate("busybox", { kind: "archive", path }, { vcpus: 1, memMib: 256 });
    for (let i = 0; ; i++) {
      const st = manager.templates.status("busybox");
      if (st.status === "ready") break;
      if (st.status === "failed" || i > 1200) throw new Error(`busybox template: ${JSON.stringify(st)}`);
      await Bun.sleep(100);
    }
  }
  await hb.first;
  return { id, url: server.url, manager, hb, kill };
}

async function api(gw: RunningGateway, key: string, method: string, path: string, json?: unknown) {
  const started = performance.now();
  const res = await fetch(`${gw.url}${path}`, {
    method,
    headers: { authorization: `Bearer ${key}`, ...(json ? { "content-type": "application/json" } : {}) },
    ...(json ? { body: JSON.stringify(json) } : {}),
  });
  const text = await res.text();
  return {
    status: res.status,
    body: (text ? JSON.parse(text) : {}) as Record<string, unknown>,
    ms: performance.now() - started,
  };
}

const agentOfSandbox = (gw: RunningGateway, id: string) =>
  gw.withDb(async (db) => (await db.select().from(sandboxes).where(eq(sandboxes.id, id)))[0]?.agentId);

describe("routing to registered agents", () => {
  test(
    "registration and heartbeat, region, least-loaded order, stale agents and at_capacity",
    async () => {
      const tStart = Date.now();
      const { gw, key } = await startGw();
      const a = await startAgent(gw, "eu-a", "eu", 2);
      const b = await startAgent(gw, "eu-b", "eu", 4);
      await startAgent(gw, "us-c", "us", 8);

      const rows = await gw.withDb((db) => db.select().from(agents).orderBy(agents.id));
      expect(rows.map((r) => [r.id, r.region, r.slotsTotal])).toEqual([
        ["eu-a", "eu", 2],
        ["eu-b", "eu", 4],
        ["us-c", "us", 8],
      ]);
      expect(rows[0]!.url).toBe(a.url);
      // The beat's time is this run's (the database stores it to the millisecond; 1 s of slack).
      const first = rows[0]!.lastHeartbeatAt!.getTime();
      expect(first).toBeGreaterThanOrEqual(tStart - 1_000);
      expect(first).toBeLessThanOrEqual(Date.now() + 1_000);
      // And the next beats move it on.
      const lastBeat = async () =>
        (
          await gw.withDb((db) => db.select().from(agents).where(eq(agents.id, "eu-a")))
        )[0]!.lastHeartbeatAt!.getTime();
      expect(await waitFor(async () => (await lastBeat()) > first, HANG_MS)).toBe(true);

      // A heartbeat needs an enrolled agent's key.
      const forged = await fetch(`${gw.url}${HEARTBEAT_PATH}`, {
        method: "POST",
        headers: { authorization: "Bearer x.y.z", "content-type": "application/json" },
        body: "{}",
      });
      expect(forged.status).toBe(401);

      // Only the gateway's region; least-loaded (both empty: the one with more free slots) first.
      const router = gw.router!;
      expect((await router.candidates()).map((r) => r.id)).toEqual(["eu-b", "eu-a"]);
      expect((await router.candidates("us")).map((r) => r.id)).toEqual(["us-c"]);

      // A stale heartbeat takes an agent out of placement.
      b.hb.stop();
      const ids = async () => (await router.candidates()).map((r) => r.id).join(",");
      expect(await waitFor(async () => (await ids()) === "eu-a", HANG_MS)).toBe(true);

      // No live agent with room in the region: 503 at_capacity once the wait for one (1 s here) has passed.
      a.hb.stop();
      expect(await waitFor(async () => (await ids()) === "", HANG_MS)).toBe(true);
      const res = await api(gw, key, "POST", "/v1/sandboxes", { template: "busybox" });
      expect(res.status).toBe(503);
      expect(res.body.code).toBe("at_capacity");
      // ...and it left no sandbox behind.
      const live = await gw.withDb((db) => db.select().from(sandboxes).where(eq(sandboxes.state, "running")));
      expect(live).toEqual([]);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "real VMs: creates land on agents with room, calls follow the sandbox, a dead agent is 503 agent_unavailable",
    async () => {
      const { gw, key } = await startGw();
      const [a, b] = await Promise.all([
        startAgent(gw, "eu-a", "eu", 1, { template: true }),
        startAgent(gw, "eu-b", "eu", 1, { template: true }),
      ]);
      const byId = new Map([
        [a.id, a],
        [b.id, b],
      ]);

      const s1 = await api(gw, key, "POST", "/v1/sandboxes", { template: "busybox" });
      expect(s1.status).toBe(201);
      const s2 = await api(gw, key, "POST", "/v1/sandboxes", { template: "busybox" });
      expect(s2.status).toBe(201);
      const id1 = s1.body.id as string;
      const id2 = s2.body.id as string;
      const ag1 = await agentOfSandbox(gw, id1);
      const ag2 = await agentOfSandbox(gw, id2);
      // One slot each: the second create went to the other agent.
      expect(new Set([ag1, ag2])).toEqual(new Set(["eu-a", "eu-b"]));
      expect(byId.get(ag1!)!.manager.list()).toHaveLength(1);
      expect(byId.get(ag2!)!.manager.list()).toHaveLength(1);

      // Exec follows each sandbox to its own agent.
      for (const id of [id1, id2]) {
        const r = await api(gw, key, "POST", `/v1/sandboxes/${id}/exec`, { command: "echo hi-$(hostname)" });
        expect(r.status).toBe(200);
        expect(r.body.stdout as string).toStartWith("hi-");
        expect(r.body.exit_code).toBe(0);
      }

      // Both agents full: 503 at_capacity.
      const full = await api(gw, key, "POST", "/v1/sandboxes", { template: "busybox" });
      expect(full.status).toBe(503);
      expect(full.body.code).toBe("at_capacity");

      // The agent of sandbox 1 dies: its calls fail at once, the other agent's keep working.
      await byId.get(ag1!)!.kill();
      const dead = await api(gw, key, "POST", `/v1/sandboxes/${id1}/exec`, { command: "true" });
      expect(dead.status).toBe(503);
      expect(dead.body.code).toBe("agent_unavailable");
      expect(dead.ms).toBeLessThan(FAILS_FAST_MS);
      const alive = await api(gw, key, "POST", `/v1/sandboxes/${id2}/exec`, { command: "echo still" });
      expect(alive.status).toBe(200);
      expect(alive.body.stdout).toBe("still\n");

      // Once its heartbeat is stale the gateway does not even try it (both are full, so the
      // placement candidates are empty either way: the live agents are what changes).
      const ids = async () =>
        (await gw.withDb((db) => liveAgents(db, "eu", Date.now(), STALE_MS))).map((r) => r.id).join(",");
      expect(await waitFor(async () => (await ids()) === ag2!, HANG_MS)).toBe(true);
      for (const [method, path] of [
        ["POST", `/v1/sandboxes/${id1}/exec`],
        ["DELETE", `/v1/sandboxes/${id1}`],
      ] as const) {
        const r = await api(gw, key, method, path, method === "POST" ? { command: "true" } : undefined);
        expect(r.status).toBe(503);
        expect(r.body.code).toBe("agent_unavailable");
        expect(r.ms).toBeLessThan(FAILS_FAST_MS);
      }
      // The dead agent is out of placement; the live one stays a candidate (it decides its room).
      expect(await ids()).toBe(ag2!);
    },
    VM_TEST_TIMEOUT_MS,
  );
});
