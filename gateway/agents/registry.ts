/**
 * The registry of host agents (the `agents` table), kept current by their heartbeats
 * (contracts/agent/heartbeat.ts): the first heartbeat of an agent registers it, every later one
 * refreshes its URL, region and capacity. Placement (router.ts) reads the live ones from here.
 */
import { and, eq, gt } from "drizzle-orm";
import { HEARTBEAT_INTERVAL_MS, Heartbeat } from "../../contracts/agent/heartbeat.ts";
import { verifyHeartbeatToken } from "../../contracts/agent/token.ts";
import type { Db } from "../../db/client.ts";
import { agents } from "../../db/schema/agents.ts";

export type AgentRow = typeof agents.$inferSelect;

/**
 * An agent whose last heartbeat is older than this is not live: three missed beats, so one slow
 * or lost beat does not take a healthy host out of placement, while a dead or frozen host stops
 * receiving creates, and its sandboxes' calls fail at once with `agent_unavailable`, within 15 s.
 */
export const AGENT_STALE_AFTER_MS = 3 * HEARTBEAT_INTERVAL_MS;

/** Registers the agent or refreshes its row (URL and region may change across restarts). */
export async function recordHeartbeat(db: Db, hb: Heartbeat, at: Date): Promise<void> {
  const set = {
    region: hb.region,
    url: hb.url,
    slotsTotal: hb.capacity.slotsTotal,
    slotsFree: hb.capacity.slotsFree,
    vcpusFree: hb.capacity.vcpusFree,
    memMibFree: hb.capacity.memMibFree,
    lastHeartbeatAt: at,
  };
  await db
    .insert(agents)
    .values({ id: hb.id, ...set })
    .onConflictDoUpdate({ target: agents.id, set });
}

/** Agents of `region` whose heartbeat is fresher than `staleAfterMs`. */
export async function liveAgents(
  db: Db,
  region: string,
  nowMs: number,
  staleAfterMs: number,
): Promise<AgentRow[]> {
  return db
    .select()
    .from(agents)
    .where(and(eq(agents.region, region), gt(agents.lastHeartbeatAt, new Date(nowMs - staleAfterMs))));
}

export function isLive(row: AgentRow, nowMs: number, staleAfterMs: number): boolean {
  return row.lastHeartbeatAt !== null && row.lastHeartbeatAt.getTime() > nowMs - staleAfterMs;
}

/** The gateway's side: checks the token, validates the body, upserts the row. */
export async function handleHeartbeat(
  db: Db,
  key: Uint8Array,
  request: Request,
  clock: () => number,
): Promise<Response> {
  const json = (status: number, body: unknown) => Response.json(body, { status });
  const token = await verifyHeartbeatToken(key, request.headers.get("authorization"));
  if (!token.ok) return json(401, { code: token.error.code, message: token.error.message });
  let body: unknown;
  try {
    body = await request.json();
  } catch {
    return json(400, { code: "bad_request", message: "heartbeat body is not JSON" });
  }
  const hb = Heartbeat.safeParse(body);
  if (!hb.success) return json(400, { code: "bad_request", message: hb.error.message });
  await recordHeartbeat(db, hb.data, new Date(clock()));
  return json(200, { ok: true });
}
