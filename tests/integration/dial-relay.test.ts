/**
 * Gateways behind one address (gateway/agents/dial-relay.ts, docs/regions.md "Gateways behind one
 * address"): two routing gateways on one real PostgreSQL, a real agent HTTP server that dials out
 * to the first only (what an edge in front of both would give it). The second gateway reaches the
 * agent through the first's link: it takes it as live, and the agent's own API answers through
 * the relay (health; an error of the agent's comes back as its code). The relay endpoint refuses
 * a request with no token, an agent's token, a relay token of another key, and an agent not
 * linked there. The link closed, the second gateway stops relaying within a scan and calls are
 * `agent_unavailable`. Skipped without PostgreSQL binaries.
 */
import { afterAll, afterEach, beforeAll, expect, test } from "bun:test";
import { rm } from "node:fs/promises";
import WebSocket from "ws";
import { SandboxManager } from "../../agent/sandbox/manager.ts";
import { secretKey, signAgentToken, signRelayToken } from "../../contracts/agent/token.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { RELAY_PATH, RELAY_SCAN_MS } from "../../gateway/agents/dial-relay.ts";
import { deriveAgentKey } from "../../gateway/agents/enrollment.ts";
import type { RunningGateway } from "../../gateway/server.ts";
import { inertDriver, startEnrolledAgent, startRoutingGateway } from "../support/agents.ts";
import { freePort, startPostgres, type TestPostgres } from "../support/postgres.ts";
import { tempStateDir } from "../support/real-vm.ts";
import { until } from "../support/until.ts";

const SECRET = "dial-relay-test-agent-secret-0123456789abcdef";
const HB_MS = 200;
const STALE_MS = 1_500;
/** Two gateways migrating one PostgreSQL, an enrollment and a few scans on a loaded host. */
const TEST_TIMEOUT_MS = 90_000;
/** A link is offered and found within a scan (5 s) and a refresh; generous for a loaded host. */
const RELAY_MS = 4 * RELAY_SCAN_MS;

let pg: TestPostgres | null = null;
beforeAll(async () => {
  pg = await startPostgres();
}, 60_000);
afterAll(async () => pg?.stop());

const cleanups: Array<() => Promise<void>> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

async function gateway(): Promise<RunningGateway> {
  const port = await freePort();
  return startRoutingGateway({
    agentSecret: SECRET,
    staleAfterMs: STALE_MS,
    onCleanup: (c) => cleanups.push(c),
    databaseUrl: pg!.url,
    port,
    peerUrl: `http://127.0.0.1:${port}`,
  });
}

/** Opens the relay endpoint of `gw` for `agent` with `auth`: the refusal's status, or "open". */
function relayStatus(gw: RunningGateway, agent: string, auth?: string): Promise<number | "open"> {
  return new Promise((resolve) => {
    const ws = new WebSocket(`${gw.url.replace(/^http/, "ws")}${RELAY_PATH}?agent=${agent}`, {
      headers: auth ? { authorization: `Bearer ${auth}` } : {},
    });
    ws.once("open", () => {
      ws.close();
      resolve("open");
    });
    ws.once("unexpected-response", (_q, res) => resolve(res.statusCode ?? 0));
    ws.once("error", () => resolve(0));
  });
}

test(
  "a gateway without an agent's link reaches it through the gateway that has it; strangers are refused",
  async () => {
    if (!pg) return console.warn("PostgreSQL binaries not found: dial relay test skipped");
    const g1 = await gateway();
    const g2 = await gateway();
    const stateDir = await tempStateDir();
    const manager = await SandboxManager.open({ driver: inertDriver(), stateDir, capacity: { slots: 2 } });
    // Enrolled to dial out, its heartbeats and its one link to the first gateway only (what an
    // edge in front of both would give it).
    const byoc = await startEnrolledAgent({
      gw: g1,
      agentSecret: SECRET,
      manager,
      stateDir,
      id: "byoc-relay",
      region: "eu",
      intervalMs: HB_MS,
      dial: true,
    });
    const credentials = byoc.credentials;
    let dialer = byoc.dialer;
    // Enrolled and never linked anywhere.
    const lonelyDir = await tempStateDir();
    const lonely = await startEnrolledAgent({
      gw: g1,
      agentSecret: SECRET,
      manager,
      stateDir: lonelyDir,
      id: "byoc-unlinked",
      region: "eu",
      intervalMs: HB_MS,
    });
    cleanups.push(async () => {
      dialer?.stop();
      byoc.hb.stop();
      lonely.hb.stop();
      await lonely.server.stop();
      await byoc.server.stop();
      await manager.detach();
      await rm(stateDir, { recursive: true, force: true });
      await rm(lonelyDir, { recursive: true, force: true });
    });
    const r1 = g1.router!;
    const r2 = g2.router!;
    await until(async () => (await r1.candidates("eu")).some((a) => a.id === "byoc-relay"), RELAY_MS);
    // The second gateway finds the link on the first, and relays to it.
    const found = await until(
      async () => (await r2.candidates("eu")).some((a) => a.id === "byoc-relay"),
      RELAY_MS,
      100,
    );
    const health = await r2.hostOn("byoc-relay").health();
    expect(health.ok).toBe(true);
    expect(health.version).toBe("test");
    // An answer of the agent's own comes back as its code, through both gateways.
    const unknown = await r2
      .hostOn("byoc-relay")
      .templateStatus("nobody.nothing")
      .then(
        () => "ok",
        (e: unknown) => (e instanceof SandboxdError ? e.code : String(e)),
      );
    expect(unknown).toBe("not_found");
    // A relay is a gateway's alone.
    const agentKey = secretKey(credentials.key);
    expect(await relayStatus(g1, "byoc-relay")).toBe(401);
    expect(await relayStatus(g1, "byoc-relay", await signAgentToken(agentKey, "byoc-relay"))).toBe(401);
    // Signed with a key of another fleet's secret.
    const foreignKey = secretKey(deriveAgentKey("another-fleet-secret-0123456789abcdef", "byoc-relay", "k"));
    expect(await relayStatus(g1, "byoc-relay", await signRelayToken(foreignKey, "byoc-relay"))).toBe(401);
    const lonelyKey = secretKey(lonely.credentials.key);
    expect(await relayStatus(g1, "byoc-unlinked", await signRelayToken(lonelyKey, "byoc-unlinked"))).toBe(
      503,
    );
    expect(await relayStatus(g1, "byoc-relay", await signRelayToken(agentKey, "byoc-relay"))).toBe("open");

    // The link closed: the first gateway withdraws it, the second stops relaying.
    dialer?.stop();
    dialer = undefined;
    const gone = await until(
      async () => !(await r2.candidates("eu")).some((a) => a.id === "byoc-relay"),
      RELAY_MS,
      100,
    );
    const after = await r2
      .hostOn("byoc-relay")
      .health()
      .then(
        () => "ok",
        (e: unknown) => (e instanceof SandboxdError ? e.code : String(e)),
      );
    expect(after).toBe("agent_unavailable");
    console.log(
      `DIAL_RELAY ${JSON.stringify({ found_ms: Math.round(found), withdrawn_ms: Math.round(gone) })}`,
    );
  },
  TEST_TIMEOUT_MS,
);
