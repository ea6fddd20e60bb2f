/**
 * Work accepted while no agent of the region is live (docs/templates.md "Waiting for an agent"):
 * a bake waits for one and starts on it, or fails with the reason past the bound; health says
 * `starting` (503) until an agent has been live. Two layers, each real: the gateway's app over
 * PGlite with the in-memory stand-in answering as a region with no agent (`absent`), and a routing
 * gateway (startGateway, PGlite) whose agent enrolls and heartbeats over HTTP.
 */
import { afterAll, afterEach, beforeAll, describe, expect, setDefaultTimeout, test } from "bun:test";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { SandboxManager } from "../../agent/sandbox/manager.ts";
import { startGateway } from "../../gateway/server.ts";
import { errorOf, inertDriver, startEnrolledAgent } from "../support/agents.ts";
import { type Harness, makeHarness } from "../support/gateway-harness.ts";
import { tempStateDir } from "../support/real-vm.ts";

/** Short, so that a test sees a wait run out; the default is 15 s (gateway/config.ts AGENT_WAIT_MS). */
const WAIT_MS = 1_500;
/**
 * The wait of a gateway that is to see an agent arrive: the agent's enrollment and first beat
 * took over 1.5 s on a loaded test host, so a short wait would run out first; the placement
 * must land on the agent, however long its enrollment took within this.
 */
const ARRIVAL_WAIT_MS = 30_000;
/** A PGlite gateway migrates on start: seconds on a loaded host. */
const TEST_TIMEOUT_MS = 60_000;

const cleanups: Array<() => Promise<void>> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

setDefaultTimeout(TEST_TIMEOUT_MS);

// One app and database for the stand-in's tests (PGlite migrates on open: seconds); each test
// names its own templates and sets the stand-in's `absent` itself.
let h: Harness;
beforeAll(async () => {
  h = await makeHarness({ agentWaitMs: WAIT_MS });
});
afterAll(async () => {
  h.agent.absent = false;
  await h.close();
});

const json = async (res: Response) => (await res.json()) as Record<string, unknown>;

/** Polls `f` every 50 ms until it is true or `ms` pass. */
async function waitFor(f: () => Promise<boolean>, ms: number): Promise<boolean> {
  const end = performance.now() + ms;
  while (performance.now() < end) {
    if (await f()) return true;
    await Bun.sleep(50);
  }
  return f();
}

describe("with no live agent (gateway app, PGlite, stand-in agent)", () => {
  test("health is 503 `starting` until an agent has answered, then 200 `ok`", async () => {
    h.agent.absent = true;
    const before = await h.req("GET", "/v1/health");
    expect(before.status).toBe(503);
    const b = await json(before);
    expect(b.status).toBe("starting");
    expect(b.reason).toContain("no agent of region local has been live yet");
    h.agent.absent = false;
    const after = await h.req("GET", "/v1/health");
    expect(after.status).toBe(200);
    expect((await json(after)).status).toBe("ok");
  });

  test("a bake accepted with no agent stays Pending, starts once one is live, and goes Live", async () => {
    const pro = await h.key("t1", "pro");
    h.agent.absent = true;
    const res = await h.req("POST", "/v1/templates", {
      key: pro,
      json: { name: "app", image: "docker.io/library/python:3" },
    });
    expect(res.status).toBe(202);
    expect(await json(res)).toMatchObject({ id: "app", phase: "Pending" });
    await Bun.sleep(WAIT_MS / 3);
    // Still waiting: not failed, and no agent has it.
    expect((await json(await h.req("GET", "/v1/templates/app", { key: pro }))).phase).toBe("Pending");
    expect([...h.agent.templates.keys()].some((r) => r.endsWith(".app"))).toBe(false);
    h.agent.absent = false; // an agent registers
    const ref = () => [...h.agent.templates.keys()].find((r) => r.endsWith(".app"));
    expect(await waitFor(async () => ref() !== undefined, WAIT_MS)).toBe(true);
    h.agent.finishBuild(ref()!, true);
    expect((await json(await h.req("GET", "/v1/templates/app", { key: pro }))).phase).toBe("Live");
    // Well past the bound it stays Live: the wait ended when the agent took the build.
    await Bun.sleep(WAIT_MS);
    expect((await json(await h.req("GET", "/v1/templates/app", { key: pro }))).phase).toBe("Live");
  });

  test("past the bound the bake is Failed with the reason, never a silent Pending", async () => {
    const pro = await h.key("t1", "pro");
    h.agent.absent = true;
    const t0 = performance.now();
    const res = await h.req("POST", "/v1/templates", {
      key: pro,
      json: { name: "late", image: "docker.io/library/python:3" },
    });
    expect(res.status).toBe(202);
    const failed = async () =>
      (await json(await h.req("GET", "/v1/templates/late", { key: pro }))).phase === "Failed";
    expect(await waitFor(failed, WAIT_MS * 3)).toBe(true);
    // Not before the bound.
    expect(performance.now() - t0).toBeGreaterThanOrEqual(WAIT_MS - 100);
    const t = await json(await h.req("GET", "/v1/templates/late", { key: pro }));
    expect(t.error).toContain(
      "agent_unavailable: no agent of region local was live to build on within 1.5 s",
    );
    // An agent that comes later does not get it: the request failed and says so.
    h.agent.absent = false;
    await Bun.sleep(700);
    expect([...h.agent.templates.keys()].some((r) => r.endsWith(".late"))).toBe(false);
  });

  test("an upload accepted with no agent is built once one is live, from the same file", async () => {
    const scale = await h.key("t1", "scale");
    h.agent.absent = true;
    const res = await h.req("POST", "/v1/templates?id=img", {
      key: scale,
      body: "an image body",
      headers: { "content-type": "application/octet-stream" },
    });
    expect(res.status, await res.clone().text()).toBe(202);
    h.agent.absent = false;
    const entry = () => [...h.agent.templates.entries()].find(([r]) => r.endsWith(".img"))?.[1];
    expect(await waitFor(async () => entry() !== undefined, WAIT_MS)).toBe(true);
    expect(entry()!.uploadHead).toBe("an image body");
  });
});

const SECRET = "agent-wait-test-agent-secret-0123456789abcdef";
/** The test agent beats this often: well inside the 1.5 s wait. */
const HB_MS = 200;

async function routingGateway(waitMs = WAIT_MS) {
  const dir = await mkdtemp(join(tmpdir(), "sbx-wait-gw-"));
  const gw = await startGateway({
    dataDir: dir,
    port: 0,
    agentSecret: SECRET,
    staleAfterMs: 3 * HB_MS,
    config: { region: "eu", version: "test", agentWaitMs: waitMs },
    log: () => {},
  });
  cleanups.push(async () => {
    await gw.stop();
    await rm(dir, { recursive: true, force: true });
  });
  return gw;
}

async function enrollAgent(gw: Awaited<ReturnType<typeof routingGateway>>, id: string): Promise<void> {
  const stateDir = await tempStateDir();
  const manager = await SandboxManager.open({ driver: inertDriver(), stateDir, capacity: { slots: 2 } });
  const { server, hb } = await startEnrolledAgent({
    gw,
    agentSecret: SECRET,
    manager,
    stateDir,
    id,
    region: "eu",
    intervalMs: HB_MS,
  });
  cleanups.push(async () => {
    hb.stop();
    await server.stop();
    await manager.detach();
    await rm(stateDir, { recursive: true, force: true });
  });
  await hb.first;
}

describe("a routing gateway (startGateway, PGlite) and an agent that enrolls over HTTP", () => {
  test(
    "health is 503 `starting` before the agent registers; a placement waits for it and lands on it",
    async () => {
      const gw = await routingGateway(ARRIVAL_WAIT_MS);
      const health = async () => {
        const res = await fetch(`${gw.url}/v1/health`);
        return { code: res.status, body: (await res.json()) as { status: string; reason?: string } };
      };
      const before = await health();
      expect(before.code).toBe(503);
      expect(before.body).toMatchObject({
        status: "starting",
        reason: "no agent of region eu has been live yet",
      });
      // A placement asked now waits (the router polls the agents table) and gets the agent.
      const t0 = performance.now();
      const placed = gw.router!.placementOrder();
      await Bun.sleep(200);
      await enrollAgent(gw, "eu-a");
      expect((await placed).map((r) => r.id)).toEqual(["eu-a"]);
      // It was answered by the agent's arrival, not by the wait running out.
      expect(performance.now() - t0).toBeLessThan(ARRIVAL_WAIT_MS);
      const after = await health();
      expect(after.code).toBe(200);
      expect(after.body.status).toBe("ok");
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "with no agent at all a placement is 503 at_capacity once the bound has passed, saying so",
    async () => {
      const gw = await routingGateway();
      const t0 = performance.now();
      const err = await errorOf(gw.router!.placementOrder());
      expect(performance.now() - t0).toBeGreaterThanOrEqual(WAIT_MS - 50);
      expect(err.code).toBe("at_capacity");
      expect(err.message).toContain("no live agent in region eu (waited 1.5 s for one)");
      expect(err.details?.retryAfterSeconds).toBe(5);
    },
    TEST_TIMEOUT_MS,
  );
});
