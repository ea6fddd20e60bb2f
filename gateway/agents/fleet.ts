/**
 * The operator's view and hands on the fleet of agents (docs/fleet.md): which agents there are and
 * in what state (live, stale, lost, revoked), how many live sandboxes each holds, and cordon:
 * a cordoned agent keeps its VMs and takes no new ones (router.ts `candidates`). A drain is a
 * cordon and then a wait for `liveSandboxes` to reach 0 (cli/fleet.ts).
 */
import { eq, inArray, sql } from "drizzle-orm";
import type { Db } from "../../db/client.ts";
import { agents } from "../../db/schema/agents.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { isLive } from "./registry.ts";

export interface FleetAgent {
  id: string;
  region: string;
  /** live: heartbeats fresh; stale: out of placement, not lost yet; lost: its sandboxes ended. */
  state: "live" | "stale" | "lost" | "revoked" | "not enrolled";
  cordoned: boolean;
  liveSandboxes: number;
  lastHeartbeatAt: string | null;
  lostAt: string | null;
  cordonedAt: string | null;
  /** The templates its last heartbeat said it holds ready (agent refs). */
  templates: string[];
}

const iso = (d: Date | null) => (d === null ? null : d.toISOString());

/**
 * Every agent, by id, with its state and the live sandboxes recorded on it: rows in `liveStates`
 * (the record states a lost host ends, core/record-states.ts; the caller names them, as the
 * agents room does not import the core).
 */
export async function fleetAgents(
  db: Db,
  nowMs: number,
  staleAfterMs: number,
  liveStates: readonly string[],
): Promise<FleetAgent[]> {
  const rows = await db.select().from(agents).orderBy(agents.id);
  const counts = await db
    .select({ agentId: sandboxes.agentId, n: sql<number>`count(*)::int` })
    .from(sandboxes)
    .where(inArray(sandboxes.state, [...liveStates] as (typeof sandboxes.state._.data)[]))
    .groupBy(sandboxes.agentId);
  const byAgent = new Map(counts.map((c) => [c.agentId, c.n]));
  return rows.map((r) => ({
    id: r.id,
    region: r.region,
    state: !r.keyId
      ? r.revokedAt
        ? "revoked"
        : "not enrolled"
      : r.lostAt
        ? "lost"
        : isLive(r, nowMs, staleAfterMs)
          ? "live"
          : "stale",
    cordoned: r.cordonedAt !== null,
    liveSandboxes: byAgent.get(r.id) ?? 0,
    lastHeartbeatAt: iso(r.lastHeartbeatAt),
    lostAt: iso(r.lostAt),
    cordonedAt: iso(r.cordonedAt),
    templates: r.templates ?? [],
  }));
}

/**
 * Cordons (`on`) or uncordons agent `id`; false when there is no such agent. Cordoning one
 * already cordoned keeps its first time.
 */
export async function setCordon(db: Db, id: string, on: boolean, now: Date): Promise<boolean> {
  const done = await db
    .update(agents)
    .set({ cordonedAt: on ? sql`coalesce(${agents.cordonedAt}, ${now.toISOString()}::timestamptz)` : null })
    .where(eq(agents.id, id))
    .returning({ id: agents.id });
  return done.length === 1;
}
