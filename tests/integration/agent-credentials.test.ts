import { afterEach, describe, expect, test } from "bun:test";
import { randomBytes } from "node:crypto";
import { rm, stat } from "node:fs/promises";
import { join } from "node:path";
import { eq } from "drizzle-orm";
import { CREDENTIALS_FILE, enroll, loadOrEnroll } from "../../agent/api/enroll.ts";
import type { HeartbeatSender } from "../../agent/api/heartbeat.ts";
import { SandboxManager } from "../../agent/sandbox/manager.ts";
import { ENROLL_PATH } from "../../contracts/agent/enroll.ts";
import { HEARTBEAT_PATH, type Heartbeat } from "../../contracts/agent/heartbeat.ts";
import { type AgentCredentials, secretKey, signHeartbeatToken } from "../../contracts/agent/token.ts";
import { agentEnrollmentTokens, agents } from "../../db/schema/agents.ts";
import { AgentHttpClient } from "../../gateway/agents/client.ts";
import { createEnrollmentToken } from "../../gateway/agents/enrollment.ts";
import { revokeAgent } from "../../gateway/agents/registry.ts";
import type { RunningGateway } from "../../gateway/server.ts";
import { errorOf, inertDriver, startEnrolledAgent, startRoutingGateway } from "../support/agents.ts";
import { databaseCases } from "../support/postgres-suite.ts";
import { tempStateDir } from "../support/real-vm.ts";

/**
 * Per-agent credentials (gateway/agents/enrollment.ts, agent/api/enroll.ts): a real gateway
 * (startGateway, PGlite) and real agent HTTP servers (startAgentServer over a SandboxManager
 * whose driver boots nothing) that enroll with one-time tokens and heartbeat with their own keys.
 * No VM is started: every check is on the authentication of heartbeats, enrollments and the
 * gateway's calls to agents.
 */

const SECRET = "credentials-test-agent-secret-0123456789abcdef";
const HB_MS = 200;
/** A PGlite gateway migrates on start: seconds on a loaded host. */
const TEST_TIMEOUT_MS = 60_000;
const STALE_MS = 1_500;

const cleanups: Array<() => Promise<void>> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

const startGw = () =>
  startRoutingGateway({ agentSecret: SECRET, staleAfterMs: STALE_MS, onCleanup: (c) => cleanups.push(c) });

const newToken = (gw: RunningGateway, opts: Parameters<typeof createEnrollmentToken>[2] = {}) =>
  gw.withDb(async (db) => (await createEnrollmentToken(db, SECRET, opts)).token);

interface TestAgent {
  credentials: AgentCredentials;
  url: string;
  stateDir: string;
  hb: HeartbeatSender;
}

async function startAgent(gw: RunningGateway, id: string): Promise<TestAgent> {
  const stateDir = await tempStateDir();
  const manager = await SandboxManager.open({ driver: inertDriver(), stateDir, capacity: { slots: 2 } });
  const { credentials, server, hb } = await startEnrolledAgent({
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
  return { credentials, url: server.url, stateDir, hb };
}

async function postEnroll(gw: RunningGateway, token: string, id: string) {
  const res = await fetch(`${gw.url}${ENROLL_PATH}`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ token, id }),
  });
  return { status: res.status, body: (await res.json()) as { code?: string; message?: string } };
}

/** A heartbeat for `body.id` signed with `signer`'s key, its token naming `claim` (default: signer). */
async function heartbeatAs(gw: RunningGateway, signer: AgentCredentials, body: Heartbeat, claim = signer.id) {
  const res = await fetch(`${gw.url}${HEARTBEAT_PATH}`, {
    method: "POST",
    headers: {
      authorization: `Bearer ${await signHeartbeatToken(secretKey(signer.key), claim)}`,
      "content-type": "application/json",
    },
    body: JSON.stringify(body),
  });
  return { status: res.status, body: (await res.json()) as { code?: string } };
}

const rowOf = (gw: RunningGateway, id: string) =>
  gw.withDb(async (db) => (await db.select().from(agents).where(eq(agents.id, id)))[0]);

describe("per-agent credentials", () => {
  test(
    "an enrolled agent heartbeats, is placed on, and its key is its own (0600 on disk)",
    async () => {
      const gw = await startGw();
      const a = await startAgent(gw, "eu-a");
      const row = await rowOf(gw, "eu-a");
      expect(row).toMatchObject({ id: "eu-a", region: "eu", url: a.url, slotsTotal: 2 });
      expect(row!.keyId).toMatch(/^[a-f0-9]{32}$/);
      // The database holds no key, only the key id it is derived from.
      expect(JSON.stringify(row)).not.toContain(a.credentials.key as string);
      const mode = (await stat(join(a.stateDir, CREDENTIALS_FILE))).mode & 0o777;
      expect(mode).toBe(0o600);
      // Placement picks it, and the call the gateway signs for it is accepted.
      expect((await gw.router!.candidates()).map((r) => r.id)).toEqual(["eu-a"]);
      const placed = await gw.router!.place((api) => api.health());
      expect(placed.agentId).toBe("eu-a");
      expect(placed.result.ok).toBe(true);
      // Its kept snapshots, as reconciliation asks a host back from lost (a driver keeping none).
      expect(await gw.router!.agentFor("eu-a").listSnapshots()).toEqual([]);
      // A later start reuses the stored key; no token needed.
      const again = await loadOrEnroll({ gatewayUrl: gw.url, stateDir: a.stateDir, defaultId: "x" });
      expect(again).toEqual({ id: "eu-a", key: a.credentials.key as string });
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "a second agent's key cannot heartbeat as the first: refused, the first agent's row unchanged",
    async () => {
      const gw = await startGw();
      const a = await startAgent(gw, "eu-a");
      const b = await startAgent(gw, "eu-b");
      a.hb.stop();
      b.hb.stop();
      // A beat of A's own may still be in flight: it moves only the beat's time, so the row is
      // compared without it.
      const withoutBeatTime = async () => {
        const { lastHeartbeatAt: _, ...rest } = (await rowOf(gw, "eu-a"))!;
        return rest;
      };
      const before = await withoutBeatTime();
      const forged: Heartbeat = {
        id: "eu-a",
        region: "eu",
        url: "http://127.0.0.1:9/attacker",
        capacity: { slotsFree: 999, slotsTotal: 999, vcpusFree: 999, memMibFree: 999_999 },
      };
      // B's own token, A's id in the body: 403.
      const asBody = await heartbeatAs(gw, b.credentials, forged);
      expect(asBody.status).toBe(403);
      expect(asBody.body.code).toBe("forbidden");
      // B's key, a token claiming to be A: the signature is not A's, 401.
      const asClaim = await heartbeatAs(gw, b.credentials, forged, "eu-a");
      expect(asClaim.status).toBe(401);
      // A token naming an agent that never enrolled: 401.
      const ghost = await heartbeatAs(gw, { id: "eu-z", key: b.credentials.key }, { ...forged, id: "eu-z" });
      expect(ghost.status).toBe(401);
      expect(await withoutBeatTime()).toEqual(before);
      // A's own key still works.
      expect((await heartbeatAs(gw, a.credentials, { ...forged, url: a.url })).status).toBe(200);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "an enrollment token is single use and expires",
    async () => {
      const gw = await startGw();
      const stateDir = await tempStateDir();
      cleanups.push(() => rm(stateDir, { recursive: true, force: true }));
      const token = await newToken(gw);
      const first = await postEnroll(gw, token, "eu-a");
      expect(first.status).toBe(200);
      const second = await postEnroll(gw, token, "eu-b");
      expect(second.status).toBe(401);
      expect(second.body.message).toContain("already used");
      expect(await rowOf(gw, "eu-b")).toBeUndefined();

      const expired = await newToken(gw, { ttlS: 60, now: new Date(Date.now() - 120_000) });
      const late = await postEnroll(gw, expired, "eu-c");
      expect(late.status).toBe(401);
      expect(late.body.message).toContain("expired");
      expect(await rowOf(gw, "eu-c")).toBeUndefined();

      // A made-up or altered token is refused the same way.
      const altered = `${token.slice(0, -4)}AAAA`;
      expect((await postEnroll(gw, altered, "eu-d")).status).toBe(401);
      expect((await postEnroll(gw, "sbxe_0123456789abcdef_nope", "eu-d")).status).toBe(401);
      // The agent's side surfaces the refusal as a typed error and stores nothing.
      const err = await errorOf(enroll({ gatewayUrl: gw.url, token, id: "eu-e", stateDir }));
      expect(err.code).toBe("unauthorized");
      expect(await Bun.file(join(stateDir, CREDENTIALS_FILE)).exists()).toBe(false);
      const none = await errorOf(loadOrEnroll({ gatewayUrl: gw.url, stateDir, defaultId: "eu-e" }));
      expect(none.code).toBe("unauthorized");
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "a token cannot take over an enrolled id; a token bound to the id re-keys it",
    async () => {
      const gw = await startGw();
      const a = await startAgent(gw, "eu-a");
      const token = await newToken(gw);
      const takeover = await postEnroll(gw, token, "eu-a");
      expect(takeover.status).toBe(409);
      // Refused before it was spent: the same token still enrolls a new id.
      const used = await gw.withDb((db) => db.select().from(agentEnrollmentTokens));
      expect(used.filter((t) => t.usedAt === null)).toHaveLength(1);
      expect((await postEnroll(gw, token, "eu-new")).status).toBe(200);
      // A token bound to eu-b cannot enroll eu-a; one bound to eu-a re-keys it.
      expect((await postEnroll(gw, await newToken(gw, { agentId: "eu-b" }), "eu-a")).status).toBe(403);
      const rekey = await postEnroll(gw, await newToken(gw, { agentId: "eu-a" }), "eu-a");
      expect(rekey.status).toBe(200);
      a.hb.stop();
      const old = await heartbeatAs(gw, a.credentials, {
        id: "eu-a",
        region: "eu",
        url: a.url,
        capacity: { slotsFree: 1, slotsTotal: 1, vcpusFree: 1, memMibFree: 1 },
      });
      expect(old.status).toBe(401);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "a call signed for agent A is refused by agent B",
    async () => {
      const gw = await startGw();
      const a = await startAgent(gw, "eu-a");
      const b = await startAgent(gw, "eu-b");
      const call = (url: string, creds: AgentCredentials, agentId = creds.id) =>
        new AgentHttpClient({ baseUrl: url, agentId, key: creds.key }).health();
      expect((await call(a.url, a.credentials)).ok).toBe(true);
      expect((await call(b.url, b.credentials)).ok).toBe(true);
      // A's token (A's key, A's audience) sent to B.
      expect((await errorOf(call(b.url, a.credentials))).code).toBe("unauthorized");
      // B's key with A's audience, and A's key with B's audience: neither agent takes it.
      expect((await errorOf(call(a.url, b.credentials, "eu-a"))).code).toBe("unauthorized");
      expect((await errorOf(call(b.url, a.credentials, "eu-b"))).code).toBe("unauthorized");
      // The tunnel upgrade is checked the same way, before anything else.
      const tunnel = await errorOf(
        new AgentHttpClient({ baseUrl: b.url, agentId: "eu-a", key: a.credentials.key }).openTunnel(
          "vm-0000000000000000",
          80,
          "tcp",
        ),
      );
      expect(tunnel.code).toBe("unauthorized");
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "a revoked agent: its heartbeats are refused, it leaves placement, the gateway stops calling it",
    async () => {
      const gw = await startGw();
      const a = await startAgent(gw, "eu-a");
      const b = await startAgent(gw, "eu-b");
      expect((await gw.router!.candidates()).map((r) => r.id).sort()).toEqual(["eu-a", "eu-b"]);
      expect(await gw.withDb((db) => revokeAgent(db, "eu-a"))).toBe(true);
      expect(await gw.withDb((db) => revokeAgent(db, "eu-a"))).toBe(false);
      a.hb.stop();
      const beat = await heartbeatAs(gw, a.credentials, {
        id: "eu-a",
        region: "eu",
        url: a.url,
        capacity: { slotsFree: 2, slotsTotal: 2, vcpusFree: 2, memMibFree: 512 },
      });
      expect(beat.status).toBe(401);
      const row = await rowOf(gw, "eu-a");
      expect(row!.keyId).toBeNull();
      expect(row!.lastHeartbeatAt).toBeNull();
      expect((await gw.router!.candidates()).map((r) => r.id)).toEqual(["eu-b"]);
      expect((await errorOf(gw.router!.agentFor("eu-a").listVms())).code).toBe("agent_unavailable");
      expect(await gw.router!.agentFor(b.credentials.id).listVms()).toEqual([]);
    },
    TEST_TIMEOUT_MS,
  );
});

/**
 * Tokens of several uses (`agent-token create --uses N`: one token in a Secret for a DaemonSet's
 * pods), on PGlite and on a real PostgreSQL, where two gateways' connections race for real.
 */
const { cases } = databaseCases();
for (const db of cases) {
  describe(`an enrollment token of several uses, ${db.name}`, () => {
    const gateway = async () =>
      startRoutingGateway({
        agentSecret: SECRET,
        staleAfterMs: STALE_MS,
        onCleanup: (c) => cleanups.push(c),
        ...(db.url ? { databaseUrl: await db.url() } : {}),
      });
    /** A fresh id per test: a PostgreSQL database is shared by the file's tests. */
    const ids = (prefix: string, n: number) =>
      Array.from({ length: n }, (_, i) => `${prefix}-${i}-${randomBytes(3).toString("hex")}`);
    const tokenRow = (gw: RunningGateway, token: string) =>
      gw.withDb(
        async (d) =>
          (
            await d
              .select()
              .from(agentEnrollmentTokens)
              .where(eq(agentEnrollmentTokens.id, token.slice(5, 21)))
          )[0]!,
      );

    test(
      "enrolls N new ids and no more; never an id that is known, enrolled or revoked",
      async () => {
        const gw = await gateway();
        const token = await newToken(gw, { uses: 3, region: "eu" });
        const [a, b, c, d] = ids("node", 4) as [string, string, string, string];
        for (const id of [a, b, c]) expect((await postEnroll(gw, token, id)).status).toBe(200);
        const fourth = await postEnroll(gw, token, d);
        expect(fourth.status).toBe(401);
        expect(fourth.body.message).toContain("all 3 uses spent");
        expect(await rowOf(gw, d)).toBeUndefined();
        expect(await rowOf(gw, a)).toMatchObject({ region: "eu", urlPinned: false });

        // Taking over an enrolled id, or coming back as a revoked one, is refused and spends nothing.
        const other = await newToken(gw, { uses: 5 });
        const takeover = await postEnroll(gw, other, a);
        expect(takeover.status).toBe(409);
        expect(takeover.body.message).toContain("new ids only");
        expect(await gw.withDb((d2) => revokeAgent(d2, b))).toBe(true);
        const back = await postEnroll(gw, other, b);
        expect(back.status).toBe(409);
        expect((await rowOf(gw, b))!.keyId).toBeNull();
        expect((await tokenRow(gw, other)).useCount).toBe(0);
        // Re-keying is a single-use token bound to that id, as before.
        expect((await postEnroll(gw, await newToken(gw, { agentId: b }), b)).status).toBe(200);
      },
      TEST_TIMEOUT_MS,
    );

    test(
      "an expired token of several uses enrolls nobody; --agent with --uses is refused",
      async () => {
        const gw = await gateway();
        const expired = await newToken(gw, { uses: 10, ttlS: 60, now: new Date(Date.now() - 120_000) });
        const [id] = ids("late", 1) as [string];
        const late = await postEnroll(gw, expired, id);
        expect(late.status).toBe(401);
        expect(late.body.message).toContain("expired");
        expect(await rowOf(gw, id)).toBeUndefined();
        expect((await errorOf(newToken(gw, { uses: 2, agentId: id }))).code).toBe("bad_request");
        expect((await errorOf(newToken(gw, { uses: 0 }))).code).toBe("bad_request");
        expect((await errorOf(newToken(gw, { uses: 5001 }))).code).toBe("bad_request");
      },
      TEST_TIMEOUT_MS,
    );

    test(
      "pods racing for the last use: exactly one enrolls; two racing for one id: exactly one",
      async () => {
        const gw = await gateway();
        // Redemptions through two gateways' connection pools at once (PostgreSQL) or one (PGlite).
        const gw2 = db.url ? await gateway() : gw;
        const token = await newToken(gw, { uses: 2 });
        const [first, ...racers] = ids("race", 9) as [string, ...string[]];
        expect((await postEnroll(gw, token, first)).status).toBe(200);
        const raced = await Promise.all(racers.map((id, i) => postEnroll(i % 2 ? gw2 : gw, token, id)));
        expect(raced.map((r) => r.status).sort()).toEqual([200, 401, 401, 401, 401, 401, 401, 401]);
        expect((await tokenRow(gw, token)).useCount).toBe(2);
        const rows = await gw.withDb((d) => d.select().from(agents));
        expect(rows.filter((r) => racers.includes(r.id))).toHaveLength(1);

        const many = await newToken(gw, { uses: 5 });
        const [same] = ids("same", 1) as [string];
        const both = await Promise.all([postEnroll(gw, many, same), postEnroll(gw2, many, same)]);
        expect(both.map((r) => r.status).sort()).toEqual([200, 409]);
        // The refused one spent nothing.
        expect((await tokenRow(gw, many)).useCount).toBe(1);
      },
      TEST_TIMEOUT_MS,
    );

    test(
      "SANDBOXD_ENROLL_TOKEN (firstStartToken) is redeemed at the first start only",
      async () => {
        const gw = await gateway();
        const token = await newToken(gw, { uses: 2 });
        const [id] = ids("pod", 1) as [string];
        const stateDir = await tempStateDir();
        cleanups.push(() => rm(stateDir, { recursive: true, force: true }));
        const start = () =>
          loadOrEnroll({ gatewayUrl: gw.url, stateDir, id, firstStartToken: token, defaultId: "unused" });
        const first = await start();
        expect(first.id).toBe(id);
        // A restart of the pod (the same host data dir) reads its key and spends no use.
        expect(await start()).toEqual(first);
        expect((await tokenRow(gw, token)).useCount).toBe(1);
        // A host whose data dir was lost cannot take its old id back with the shared token.
        const wiped = await tempStateDir();
        cleanups.push(() => rm(wiped, { recursive: true, force: true }));
        const again = await errorOf(
          loadOrEnroll({ gatewayUrl: gw.url, stateDir: wiped, id, firstStartToken: token, defaultId: "x" }),
        );
        expect(again.code).toBe("conflict");
        expect((await tokenRow(gw, token)).useCount).toBe(1);
      },
      TEST_TIMEOUT_MS,
    );
  });
}
