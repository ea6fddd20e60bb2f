/**
 * The registry of host agents (the `agents` table), kept current by their heartbeats
 * (contracts/agent/heartbeat.ts). An agent's row is made when it enrolls (enrollment.ts), in the
 * region its token named; each heartbeat, signed with that agent's own key and for that agent's id
 * only, refreshes its capacity and, unless enrollment pinned it, its URL. A heartbeat naming
 * another region, or another URL than a pinned one, is refused: a host's key alone never moves it
 * into another region's placement. Placement (router.ts) reads the live ones from here.
 */
import { and, eq, gt, isNotNull, isNull, lte, or, type SQL, sql } from "drizzle-orm";
import type { PgUpdateSetSource } from "drizzle-orm/pg-core";
import { HEARTBEAT_INTERVAL_MS, Heartbeat } from "../../contracts/agent/heartbeat.ts";
import {
  type AgentTokenPurpose,
  heartbeatTokenAgent,
  secretKey,
  verifyHeartbeatToken,
} from "../../contracts/agent/token.ts";
import type { Db } from "../../db/client.ts";
import { agents } from "../../db/schema/agents.ts";
import { deriveAgentKey } from "./enrollment.ts";
import { jsonAnswer, parseJsonBody } from "./internal-http.ts";

export type AgentRow = typeof agents.$inferSelect;

/**
 * An agent whose last heartbeat is older than this is not live: three missed beats, so one slow
 * or lost beat does not take a healthy host out of placement, while a dead or frozen host stops
 * receiving creates, and its sandboxes' calls fail at once with `agent_unavailable`, within 15 s.
 */
export const AGENT_STALE_AFTER_MS = 3 * HEARTBEAT_INTERVAL_MS;

/**
 * Refreshes the row of the enrolled agent `hb.id` whose current key id is `keyId`; false when
 * there is none (revoked or re-keyed since the heartbeat was checked).
 *
 * Beats are stamped when their handler reaches this point, and two of one agent's beats may be
 * in flight at once (a slow one and the next, or two gateways): a beat stamped before the one
 * already recorded changes nothing (true all the same: the agent is enrolled). Otherwise the last
 * heartbeat would move back in time after host loss (gateway/core/host-loss.ts) closed usage at
 * the later one, and a beat from before a loss would count as the agent coming back.
 */
export async function recordHeartbeat(db: Db, hb: Heartbeat, keyId: string, at: Date): Promise<boolean> {
  const mine = and(eq(agents.id, hb.id), eq(agents.keyId, keyId));
  const fresh = or(isNull(agents.lastHeartbeatAt), lte(agents.lastHeartbeatAt, at));
  const done = await updateAgent(db, and(mine, fresh), {
    url: hb.url,
    slotsTotal: hb.capacity.slotsTotal,
    slotsFree: hb.capacity.slotsFree,
    vcpusFree: hb.capacity.vcpusFree,
    memMibFree: hb.capacity.memMibFree,
    diskMibFree: hb.capacity.diskMibFree ?? null,
    templates: hb.templates ?? [],
    // The beat reports what the agent holds now, the VMs placed before it included, so the
    // gateways' count of placements since the last beat starts again from 0.
    placedSlots: 0,
    placedVcpus: 0,
    placedMemMib: 0,
    placedDiskMib: 0,
    lastHeartbeatAt: at,
    // Back from lost (gateway/core/host-loss.ts): its rows have ended; reconciliation destroys
    // their VMs on it, and it takes new ones again. A beat stamped before the loss was declared
    // (committed late) proves nothing after it: the agent stays lost.
    lostAt: sql`CASE WHEN ${agents.lostAt} > ${at.toISOString()}::timestamptz THEN ${agents.lostAt} END`,
  });
  if (done) return true;
  // Not updated: stale (still enrolled with this key) or revoked/re-keyed.
  const [row] = await db.select({ id: agents.id }).from(agents).where(mine);
  return row !== undefined;
}

/**
 * Clears agent `id`'s key: nothing it signs is accepted, nothing is sent to it, and it leaves
 * placement at once. False when it had no key (unknown, or already revoked).
 */
export function revokeAgent(db: Db, id: string, now: Date = new Date()): Promise<boolean> {
  return updateAgent(db, and(eq(agents.id, id), isNotNull(agents.keyId)), {
    keyId: null,
    revokedAt: now,
    lastHeartbeatAt: null,
  });
}

/** Updates the one agent row `where` selects; false when there is none. */
async function updateAgent(
  db: Db,
  where: SQL | undefined,
  set: PgUpdateSetSource<typeof agents>,
): Promise<boolean> {
  const done = await db.update(agents).set(set).where(where).returning({ id: agents.id });
  return done.length === 1;
}

/** The enrolled agent `id` and its current key, or undefined (unknown, never enrolled, revoked). */
export async function enrolledAgent(
  db: Db,
  agentSecret: string,
  id: string,
): Promise<{ row: AgentRow & { keyId: string }; key: string } | undefined> {
  const [row] = await db.select().from(agents).where(eq(agents.id, id));
  if (!row?.keyId) return undefined;
  return { row: { ...row, keyId: row.keyId }, key: deriveAgentKey(agentSecret, id, row.keyId) };
}

/** Enrolled agents of `region` whose heartbeat is fresher than `staleAfterMs`. */
export async function liveAgents(
  db: Db,
  region: string,
  nowMs: number,
  staleAfterMs: number,
): Promise<AgentRow[]> {
  return db
    .select()
    .from(agents)
    .where(
      and(
        eq(agents.region, region),
        isNotNull(agents.keyId),
        gt(agents.lastHeartbeatAt, new Date(nowMs - staleAfterMs)),
      ),
    );
}

export function isLive(row: AgentRow, nowMs: number, staleAfterMs: number): boolean {
  return (
    row.keyId !== null && row.lastHeartbeatAt !== null && row.lastHeartbeatAt.getTime() > nowMs - staleAfterMs
  );
}

/**
 * Who sent an agent's report (heartbeat or events): the token names an agent (`kid`) and must be
 * signed with that enrolled agent's key; otherwise the 401 to answer. The body is not read here.
 */
export async function authenticateAgentReport(
  db: Db,
  agentSecret: string,
  request: Request,
  what: string,
  purpose: AgentTokenPurpose = "report",
): Promise<{ ok: true; agent: AgentRow & { keyId: string }; key: string } | { ok: false; answer: Response }> {
  const header = request.headers.get("authorization");
  const claimed = heartbeatTokenAgent(header);
  const agent = claimed === undefined ? undefined : await enrolledAgent(db, agentSecret, claimed);
  if (claimed === undefined || agent === undefined) {
    const why = claimed === undefined ? "no agent named" : `agent ${claimed} is not enrolled`;
    return {
      ok: false,
      answer: jsonAnswer(401, { code: "unauthorized", message: `${what} token rejected: ${why}` }),
    };
  }
  const token = await verifyHeartbeatToken(secretKey(agent.key), agent.row.id, header, purpose);
  if (!token.ok) {
    return { ok: false, answer: jsonAnswer(401, { code: token.error.code, message: token.error.message }) };
  }
  return { ok: true, agent: agent.row, key: agent.key };
}

/**
 * Why a heartbeat from enrolled agent `row` may not be recorded, or undefined: it names another
 * region than its enrollment gave it, or another URL than its enrollment pinned. An agent
 * enrolled before regions were data has region '' and none to contradict (its row keeps '').
 */
export function heartbeatConflict(row: AgentRow, hb: Heartbeat): string | undefined {
  if (row.region !== "" && hb.region !== row.region)
    return `agent ${row.id} is enrolled in region ${row.region}, not ${hb.region}; enroll it again with a token for ${hb.region} to move it`;
  if (row.urlPinned && hb.url !== row.url)
    return `agent ${row.id} is enrolled at ${row.url}, not ${hb.url}; enroll it again with a token for the new URL to move it`;
  return undefined;
}

/** 403 unless a report about agent `about` comes from that agent. */
export function sameAgent(from: AgentRow, about: string): Response | undefined {
  if (about === from.id) return undefined;
  return jsonAnswer(403, {
    code: "forbidden",
    message: `agent ${from.id} may not report for agent ${about}`,
  });
}

/**
 * The gateway's side: the token names an agent (`kid`) and must be signed with that enrolled
 * agent's key (401 otherwise); the body must be about that same agent (403 otherwise). A refused
 * heartbeat changes nothing. One naming another region or pinned URL than the agent's enrollment
 * is refused with 403 `forbidden` and a log line (`heartbeatConflict`): the agent stays where
 * it was enrolled and drops out of placement once its last accepted heartbeat is stale. `onBeat`
 * hears of each accepted one with the heartbeat before it (null: none), so that an agent back
 * after a gap is reconciled (gateway/core/reconcile.ts).
 */
export async function handleHeartbeat(
  db: Db,
  agentSecret: string,
  request: Request,
  clock: () => number,
  onBeat?: (agentId: string, previousAt: Date | null) => void,
  log: (line: string) => void = (line) => console.error(line),
): Promise<Response> {
  const auth = await authenticateAgentReport(db, agentSecret, request, "heartbeat");
  if (!auth.ok) return auth.answer;
  const agent = auth.agent;
  const hb = await parseJsonBody(request, Heartbeat, "heartbeat");
  if (!hb.ok) return hb.answer;
  const other = sameAgent(agent, hb.data.id);
  if (other) return other;
  const conflict = heartbeatConflict(agent, hb.data);
  if (conflict !== undefined) {
    log(`heartbeat refused: ${conflict}`);
    return jsonAnswer(403, { code: "forbidden", message: `heartbeat refused: ${conflict}` });
  }
  // The region stays the enrolled one; a legacy row without one takes its first heartbeat's.
  if (agent.region === "") await updateAgent(db, eq(agents.id, agent.id), { region: hb.data.region });
  if (!(await recordHeartbeat(db, hb.data, agent.keyId, new Date(clock())))) {
    return jsonAnswer(401, { code: "unauthorized", message: `agent ${agent.id} was revoked` });
  }
  onBeat?.(agent.id, agent.lastHeartbeatAt);
  return jsonAnswer(200, { ok: true });
}

/** Ids of the enrolled agents (any region) whose heartbeat is fresher than `staleAfterMs`. */
export async function liveAgentIds(db: Db, nowMs: number, staleAfterMs: number): Promise<string[]> {
  const rows = await db
    .select({ id: agents.id })
    .from(agents)
    .where(and(isNotNull(agents.keyId), gt(agents.lastHeartbeatAt, new Date(nowMs - staleAfterMs))));
  return rows.map((r) => r.id);
}
