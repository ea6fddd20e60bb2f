/**
 * Losing a host (docs/fleet.md "Losing a host"). Reconciliation (reconcile.ts) asks live agents
 * only; an agent that never heartbeats again would leave its sandboxes' rows live for good:
 * counted against their tenants' quotas, billed up to now, and refused on delete (every call to it
 * fails `agent_unavailable`). Here an agent silent past `AGENT_LOST_AFTER_MS` is `lost`:
 * - one gateway declares it (a conditional UPDATE of `agents.lost_at`: of several gateways on one
 *   database exactly one gets the row back, and only it logs the loss);
 * - each of its live rows ends `destroyed`, end_reason `host_lost` (record-states.ts `lost`), each
 *   by one conditional UPDATE so that no row is ended twice, with the agent row locked so that a
 *   heartbeat that brings the agent back waits and is seen: rows are ended only while it is lost;
 * - the open usage interval closes at the agent's LAST HEARTBEAT, the last moment the VM is known
 *   to have run (never after: we do not bill time we cannot prove ran), or at the interval's own
 *   start when that came later;
 * - quota follows the rows: it counts live states only (sandboxes/quota.ts), holds included.
 *
 * - its kept snapshots (docs/snapshots.md) read `lost`: no longer counted against the cap, metered
 *   until the same last heartbeat (`deleted_at` holds that end), creating from one is 410, a
 *   delete needs no agent. One conditional UPDATE per sweep, so a snapshot that became ready on a
 *   host already lost is caught by the next sweep.
 *
 * An agent that comes back clears `lost_at` with its heartbeat (registry.ts) and is reconciled as
 * any agent back after a gap: VMs whose rows have ended are destroyed on it (reconcile.ts
 * `destroyOrphans`), never brought back; its late VM events find no live row and change nothing,
 * so the closed usage stays closed. Its kept snapshots are settled by reconciliation as well: one
 * whose files the agent still lists is `ready` again, and the agent drops those whose rows were
 * deleted meanwhile (reconcile.ts `reconcileSnapshots`).
 */
import { and, eq, inArray, isNotNull, isNull, lt, sql } from "drizzle-orm";
import { HEARTBEAT_INTERVAL_MS } from "../../contracts/agent/heartbeat.ts";
import { describeError } from "../../contracts/errors.ts";
import type { Db } from "../../db/client.ts";
import { agents } from "../../db/schema/agents.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { snapshots } from "../../db/schema/snapshots.ts";
import { usageIntervals } from "../../db/schema/usage-intervals.ts";
import type { Deps } from "../deps.ts";
import { RECORD_TRANSITIONS, recordChange } from "./record-states.ts";
import { forgetRows } from "./row-cache.ts";
import { switchInterval } from "./sandboxes.ts";

export type HostLossDeps = Pick<Deps, "db" | "clock" | "relays"> & { rows?: Deps["rows"] };

/**
 * An agent silent this long is lost: 12 heartbeats (60 s), four times the staleness bound
 * (registry.ts AGENT_STALE_AFTER_MS, 15 s) that already takes it out of placement. Ending its
 * sandboxes cannot be undone, so a host that is only slow or briefly cut off (an agent process
 * restart, a gateway replica or a switch failing over: seconds to tens of seconds) is left alone;
 * a dead host's quota comes back within about a minute, and nothing is billed meanwhile past its
 * last heartbeat either way.
 */
export const AGENT_LOST_AFTER_MS = 12 * HEARTBEAT_INTERVAL_MS;
/**
 * How often a gateway looks for lost agents: once a heartbeat interval (5 s), so detection is at
 * most that late; each look is one UPDATE of the agents table and one read of lost agents' rows.
 */
export const LOST_SWEEP_INTERVAL_MS = HEARTBEAT_INTERVAL_MS;

/** Stable code of a sandbox ended by its host's loss: its `end_reason` and its detail's first word. */
export const HOST_LOST = "host_lost";

const LIVE = [...RECORD_TRANSITIONS.lost.from];

/**
 * Marks the enrolled agents silent since before `nowMs - lostAfterMs` lost; returns those this
 * call marked (another gateway's concurrent call gets none of them) with their last heartbeat.
 */
export async function claimLostAgents(
  db: Db,
  nowMs: number,
  lostAfterMs: number,
): Promise<{ id: string; lastHeartbeatAt: Date }[]> {
  const rows = await db
    .update(agents)
    .set({ lostAt: new Date(nowMs) })
    .where(
      and(
        isNotNull(agents.keyId),
        isNull(agents.lostAt),
        lt(agents.lastHeartbeatAt, new Date(nowMs - lostAfterMs)),
      ),
    )
    .returning({ id: agents.id, lastHeartbeatAt: agents.lastHeartbeatAt });
  return rows.map((r) => ({ id: r.id, lastHeartbeatAt: r.lastHeartbeatAt! }));
}

/**
 * Ends the live rows of every agent that is lost now (those just claimed, and any whose claimer
 * died before it had ended them all). Returns the ids this call ended.
 */
export async function endLostRows(deps: HostLossDeps, log: (line: string) => void): Promise<string[]> {
  const rows = await deps.db
    .select({ id: sandboxes.id, tenantId: sandboxes.tenantId, agentId: sandboxes.agentId })
    .from(sandboxes)
    .innerJoin(agents, eq(agents.id, sandboxes.agentId))
    .where(and(isNotNull(agents.lostAt), inArray(sandboxes.state, LIVE)));
  const ended: string[] = [];
  for (const row of rows) {
    const at = await deps.db.transaction(async (tx) => {
      // The agent row locked: a heartbeat bringing it back waits for this row's end, or comes
      // first and is seen here, and the row is then kept.
      const [agent] = await tx
        .select({ lostAt: agents.lostAt, lastHeartbeatAt: agents.lastHeartbeatAt })
        .from(agents)
        .where(eq(agents.id, row.agentId))
        .for("update");
      if (!agent?.lostAt || !agent.lastHeartbeatAt) return undefined;
      const [open] = await tx
        .select({ startedAt: usageIntervals.startedAt })
        .from(usageIntervals)
        .where(and(eq(usageIntervals.sandboxId, row.id), isNull(usageIntervals.endedAt)));
      const end = new Date(Math.max(agent.lastHeartbeatAt.getTime(), open?.startedAt.getTime() ?? 0));
      const lost = recordChange("lost");
      const done = await tx
        .update(sandboxes)
        .set({
          state: lost.state,
          endReason: HOST_LOST,
          endDetail: `${HOST_LOST}: agent ${row.agentId} last heartbeat ${agent.lastHeartbeatAt.toISOString()}, silent since`,
          destroyedAt: end,
          hold: null,
          holdUntil: null,
        })
        .where(and(eq(sandboxes.id, row.id), lost.from))
        .returning({ id: sandboxes.id });
      if (done.length === 0) return undefined;
      await switchInterval(tx, row, null, end);
      return end;
    });
    if (at === undefined) continue;
    ended.push(row.id);
    forgetRows(deps, row.id);
    deps.relays?.closeSandbox(row.id, 1001, "sandbox's host was lost");
    log(
      `host loss: ${row.id} ended ${HOST_LOST} (agent ${row.agentId}), usage closed at ${at.toISOString()}`,
    );
  }
  return ended;
}

/**
 * Marks the ready snapshots of every lost agent `lost`, their metered interval ending at the
 * agent's last heartbeat (never before the snapshot was ready). Returns the ids it marked.
 */
export async function loseSnapshots(deps: HostLossDeps, log: (line: string) => void): Promise<string[]> {
  const lost = deps.db.select({ id: agents.id }).from(agents).where(isNotNull(agents.lostAt));
  const lastBeat = sql`(SELECT ${agents.lastHeartbeatAt} FROM ${agents} WHERE ${agents.id} = ${snapshots.agentId})`;
  const rows = await deps.db
    .update(snapshots)
    .set({
      state: "lost",
      deletedAt: sql`greatest(${snapshots.readyAt}, coalesce(${lastBeat}, ${new Date(deps.clock()).toISOString()}::timestamptz))`,
      error: sql`${`${HOST_LOST}: its host, agent `}::text || ${snapshots.agentId} || ${", was lost; its files went with it unless that host comes back with them"}::text`,
    })
    .where(and(eq(snapshots.state, "ready"), inArray(snapshots.agentId, lost)))
    .returning({ id: snapshots.id, agentId: snapshots.agentId, until: snapshots.deletedAt });
  for (const r of rows) {
    log(`host loss: snapshot ${r.id} lost (agent ${r.agentId}), metered until ${r.until?.toISOString()}`);
  }
  return rows.map((r) => r.id);
}

/** One look: claims newly lost agents (unless `judge` is false), then ends lost agents' rows. */
export async function sweepLostAgents(
  deps: HostLossDeps,
  opts: { lostAfterMs: number; judge: boolean; log: (line: string) => void },
): Promise<{ lost: string[]; ended: string[] }> {
  const now = deps.clock();
  const claimed = opts.judge ? await claimLostAgents(deps.db, now, opts.lostAfterMs) : [];
  for (const a of claimed) {
    opts.log(
      `host loss: agent ${a.id} lost: no heartbeat since ${a.lastHeartbeatAt.toISOString()} ` +
        `(${Math.round((now - a.lastHeartbeatAt.getTime()) / 1000)} s, bound ${opts.lostAfterMs / 1000} s)`,
    );
  }
  const ended = await endLostRows(deps, opts.log);
  await loseSnapshots(deps, opts.log);
  return { lost: claimed.map((a) => a.id), ended };
}

/**
 * Runs `sweepLostAgents` every `intervalMs`. A gateway judges silence only once it has itself
 * been up for `lostAfterMs`: agents heartbeat to the gateways, so after all of them were down
 * every agent looks silent, and none of it was the agents' doing.
 */
export function startHostLossSweeper(
  deps: HostLossDeps,
  opts: { lostAfterMs?: number; intervalMs?: number; log: (line: string) => void },
): { stop(): void; sweep(): Promise<{ lost: string[]; ended: string[] }> } {
  const lostAfterMs = opts.lostAfterMs ?? AGENT_LOST_AFTER_MS;
  const startedAt = deps.clock();
  let running: Promise<{ lost: string[]; ended: string[] }> | undefined;
  const sweep = () => {
    running ??= sweepLostAgents(deps, {
      lostAfterMs,
      judge: deps.clock() - startedAt >= lostAfterMs,
      log: opts.log,
    }).finally(() => {
      running = undefined;
    });
    return running;
  };
  const timer = setInterval(() => {
    sweep().catch((err) => opts.log(`host loss: sweep failed: ${describeError(err)}`));
  }, opts.intervalMs ?? LOST_SWEEP_INTERVAL_MS);
  timer.unref?.(); // never keeps the gateway process alive
  return { stop: () => clearInterval(timer), sweep };
}

/** Live rows on agent `id` (what a drain waits for). */
export async function liveRowsOn(db: Db, id: string): Promise<number> {
  const [c] = await db
    .select({ n: sql<number>`count(*)::int` })
    .from(sandboxes)
    .where(and(eq(sandboxes.agentId, id), inArray(sandboxes.state, LIVE)));
  return c?.n ?? 0;
}
