import { afterEach, beforeEach, describe, expect, test } from "bun:test";
import { eq } from "drizzle-orm";
import { HEARTBEAT_PATH, type Heartbeat } from "../../contracts/agent/heartbeat.ts";
import { secretKey, signHeartbeatToken } from "../../contracts/agent/token.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { agents } from "../../db/schema/agents.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { tenants } from "../../db/schema/tenants.ts";
import { createEnrollmentToken, enrollAgent } from "../../gateway/agents/enrollment.ts";
import { AGENT_STALE_AFTER_MS, handleHeartbeat } from "../../gateway/agents/registry.ts";
import { AgentRouter } from "../../gateway/agents/router.ts";
import { createKey } from "../../gateway/auth/keys.ts";
import { errorOf } from "../support/agents.ts";
import { type Harness, makeHarness, PEPPER } from "../support/gateway-harness.ts";
import { MemoryAgent } from "../support/memory-agent.ts";

/**
 * Regions are data (docs/regions.md "Rules of regions"): one gateway (the real app over PGlite,
 * its placement the real `AgentRouter` over the `agents` table) serves tenants at home in two
 * regions. The agents are in-memory stand-ins reached through the router's `connect`; they are
 * enrolled with real tokens and report through the real heartbeat handler, so the regions placement
 * reads are the ones enrollment wrote.
 */

const SECRET = "regions-test-agent-secret-0123456789abcdef";

let h: Harness;
let logged: string[];
const memory = new Map<string, MemoryAgent>();
const keys = new Map<string, string>();

/** Enrolls agent `id` with a token for `region` (pinning `pinUrl` if given); its first heartbeat follows. */
async function enrollIn(id: string, region: string, pinUrl?: string): Promise<MemoryAgent> {
  const db = h.handle.db;
  const { token } = await createEnrollmentToken(db, SECRET, {
    region,
    ...(pinUrl !== undefined ? { url: pinUrl } : {}),
  });
  const { key } = await enrollAgent(db, SECRET, { token, id }, new Date(h.now.ms));
  keys.set(id, key);
  const agent = new MemoryAgent();
  agent.addReadyTemplate("python");
  memory.set(id, agent);
  expect((await beat(id, { region, url: pinUrl ?? `http://${id}.test:7070` })).status).toBe(200);
  return agent;
}

/** One heartbeat of agent `id`, signed with its own key, claiming `region` and `url`. */
async function beat(id: string, claim: { region: string; url: string }) {
  const hb: Heartbeat = {
    id,
    ...claim,
    capacity: { slotsFree: 8, slotsTotal: 8, vcpusFree: 8, memMibFree: 8192 },
  };
  const res = await handleHeartbeat(
    h.handle.db,
    SECRET,
    new Request(`http://gw.test${HEARTBEAT_PATH}`, {
      method: "POST",
      headers: {
        authorization: `Bearer ${await signHeartbeatToken(secretKey(keys.get(id)!), id)}`,
        "content-type": "application/json",
      },
      body: JSON.stringify(hb),
    }),
    () => h.now.ms,
    undefined,
    (line) => logged.push(line),
  );
  return { status: res.status, body: (await res.json()) as { code?: string; message?: string } };
}

const agentRow = async (id: string) => (await h.handle.db.select().from(agents).where(eq(agents.id, id)))[0]!;

async function json(res: Response): Promise<Record<string, unknown>> {
  return (await res.json()) as Record<string, unknown>;
}

async function createSandbox(key: string): Promise<Response> {
  return h.req("POST", "/v1/sandboxes", { key, json: { template: "python" } });
}

/** The agent each of `tenant`'s sandboxes is recorded on. */
async function agentsOf(tenant: string): Promise<string[]> {
  const [t] = await h.handle.db.select().from(tenants).where(eq(tenants.name, tenant));
  const rows = await h.handle.db.select().from(sandboxes).where(eq(sandboxes.tenantId, t!.id));
  return rows.map((r) => r.agentId!).sort();
}

beforeEach(async () => {
  logged = [];
  memory.clear();
  keys.clear();
  h = await makeHarness({
    region: "eu",
    placement: (db, clock) =>
      new AgentRouter({
        db,
        agentSecret: SECRET,
        region: "eu",
        clock,
        connect: (row) => {
          const agent = memory.get(row.id);
          if (!agent) throw new SandboxdError("internal", `no in-memory agent ${row.id}`);
          return agent;
        },
      }),
  });
});
afterEach(() => h.close());

describe("regions are data", () => {
  test("each tenant's sandboxes and template builds land only in its home region", async () => {
    const euA = await enrollIn("eu-a", "eu");
    const euB = await enrollIn("eu-b", "eu");
    const usA = await enrollIn("us-a", "us");
    const acme = await h.key("acme", "pro", "eu");
    const globex = await h.key("globex", "pro", "us");

    for (let i = 0; i < 4; i++) {
      expect((await createSandbox(acme)).status).toBe(201);
      expect((await createSandbox(globex)).status).toBe(201);
    }
    // Spread over eu's two agents by load; none on us-a, and globex's all there.
    expect((await agentsOf("acme")).filter((a) => !a.startsWith("eu-"))).toEqual([]);
    expect(new Set(await agentsOf("acme"))).toEqual(new Set(["eu-a", "eu-b"]));
    expect(await agentsOf("globex")).toEqual(["us-a", "us-a", "us-a", "us-a"]);
    expect(euA.vms.size + euB.vms.size).toBe(4);
    expect(usA.vms.size).toBe(4);

    // A bake is built on every live agent of the owner's region, and only there.
    const bake = (key: string, name: string) =>
      h.req("POST", "/v1/templates", { key, json: { name, image: "docker.io/library/python:3" } });
    expect((await bake(acme, "acme-img")).status).toBe(202);
    expect((await bake(globex, "globex-img")).status).toBe(202);
    const built = (a: MemoryAgent) =>
      [...a.templates.keys()].filter((k) => k !== "python").map((k) => k.split(".").at(-1));
    expect(built(euA)).toEqual(["acme-img"]);
    expect(built(euB)).toEqual(["acme-img"]);
    expect(built(usA)).toEqual(["globex-img"]);

    // A tenant made without a region is at home in the gateway's default region (eu).
    const plain = await h.key("plain", "pro");
    expect((await createSandbox(plain)).status).toBe(201);
    expect((await agentsOf("plain"))[0]).toStartWith("eu-");
  });

  test("a tenant whose home region has no live agent gets 503 naming that region", async () => {
    await enrollIn("eu-a", "eu");
    const usA = await enrollIn("us-a", "us");
    const initech = await h.key("initech", "pro", "ap");
    const res = await createSandbox(initech);
    expect(res.status).toBe(503);
    const body = await json(res);
    expect(body.code).toBe("at_capacity");
    expect(body.message).toContain("no live agent in region ap");
    expect(res.headers.get("retry-after")).toBe("5");
    // Nothing was placed anywhere else, and the reserved row ended failed.
    expect(usA.vms.size).toBe(0);
    expect(memory.get("eu-a")!.vms.size).toBe(0);

    // A region whose agents went quiet is empty too: globex (us) is refused, acme (eu) still served.
    const globex = await h.key("globex", "pro", "us");
    const acme = await h.key("acme", "pro", "eu");
    h.now.ms += AGENT_STALE_AFTER_MS + 1;
    expect((await beat("eu-a", { region: "eu", url: "http://eu-a.test:7070" })).status).toBe(200);
    const stale = await createSandbox(globex);
    expect(stale.status).toBe(503);
    expect((await json(stale)).message).toContain("no live agent in region us");
    expect((await createSandbox(acme)).status).toBe(201);
  });

  test("a heartbeat cannot move an agent to another region; a pinned URL cannot change", async () => {
    const usA = await enrollIn("us-a", "us");
    const euA = await enrollIn("eu-a", "eu", "http://10.0.0.5:7070");
    const acme = await h.key("acme", "pro", "eu");

    // us-a claims eu: refused, logged, and its row stays in us.
    const moved = await beat("us-a", { region: "eu", url: "http://us-a.test:7070" });
    expect(moved.status).toBe(403);
    expect(moved.body.code).toBe("forbidden");
    expect(moved.body.message).toContain("enrolled in region us, not eu");
    expect(logged.some((l) => l.includes("heartbeat refused: agent us-a is enrolled in region us"))).toBe(
      true,
    );
    expect((await agentRow("us-a")).region).toBe("us");
    for (let i = 0; i < 3; i++) expect((await createSandbox(acme)).status).toBe(201);
    expect(usA.vms.size).toBe(0);
    expect(euA.vms.size).toBe(3);

    // An unpinned URL follows the agent's heartbeats (it restarted elsewhere, same key).
    expect((await beat("us-a", { region: "us", url: "http://us-a.test:7171" })).status).toBe(200);
    expect((await agentRow("us-a")).url).toBe("http://us-a.test:7171");

    // A pinned one does not: refused and unchanged; the pinned URL itself is accepted.
    const away = await beat("eu-a", { region: "eu", url: "http://attacker.test:7070" });
    expect(away.status).toBe(403);
    expect(away.body.message).toContain("enrolled at http://10.0.0.5:7070");
    expect((await agentRow("eu-a")).url).toBe("http://10.0.0.5:7070");
    expect((await beat("eu-a", { region: "eu", url: "http://10.0.0.5:7070" })).status).toBe(200);
  });

  test("a home region is fixed when the tenant is created; a tenant with none takes the first named", async () => {
    await createKey(h.handle.db, PEPPER, { tenant: "acme", tier: "pro", region: "eu" });
    const again = await createKey(h.handle.db, PEPPER, { tenant: "acme", tier: "pro" });
    expect(again.region).toBe("eu");
    const moved = await errorOf(
      createKey(h.handle.db, PEPPER, { tenant: "acme", tier: "pro", region: "us" }),
    );
    expect(moved.code).toBe("conflict");
    expect(moved.message).toContain("at home in region eu, not us");

    const legacy = await createKey(h.handle.db, PEPPER, { tenant: "old-co", tier: "pro" });
    expect(legacy.region).toBeNull();
    expect(
      (await createKey(h.handle.db, PEPPER, { tenant: "old-co", tier: "pro", region: "us" })).region,
    ).toBe("us");
    const [row] = await h.handle.db.select().from(tenants).where(eq(tenants.name, "old-co"));
    expect(row!.region).toBe("us");
  });
});
