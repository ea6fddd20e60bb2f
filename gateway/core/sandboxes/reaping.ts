/**
 * What the service reaps on its own: sessions and sandboxes idle past their lifetime, relayed
 * activity written behind, and execs whose record never saw their end.
 */
import { and, eq, inArray, isNotNull, isNull, lte, or, type SQL, sql } from "drizzle-orm";
import { describeError } from "../../../contracts/errors.ts";
import { sandboxes } from "../../../db/schema/sandboxes.ts";
import type { Deps } from "../../deps.ts";
import { nextState, recordChange } from "../record-states.ts";
import { forgetRows } from "../row-cache.ts";
import { agentOf, inTermsOf, switchInterval } from "./records.ts";

/**
 * Reclaims sessions API sessions idle past the TTL (docs/sessions.md "Rules of the sessions API"); later calls on them get 410.
 * Returns the ids reclaimed. Safe with several gateways on one database: each session is claimed
 * by one conditional UPDATE (running, no exec in flight, idle past the TTL) that also ends its
 * metering, so exactly one reaper wins it and only the winner calls the agent. An exec counted in
 * flight is never reaped, however long it runs; a count older than any exec may run was left by
 * a gateway that died during the call and no longer holds the session.
 */
export async function reapIdleSessions(
  deps: Deps,
  log: (line: string) => void = () => {},
): Promise<string[]> {
  const at = new Date(deps.clock());
  const claimed = await deps.db.transaction(async (tx) => {
    const rows = await tx
      .update(sandboxes)
      .set({ state: nextState("destroy"), endReason: "reaped", destroyedAt: at, expiresAt: null })
      .where(
        and(
          idleClaimable(deps, at),
          or(
            and(eq(sandboxes.kind, "session"), eq(sandboxes.api, "sessions")),
            // Sandboxes of the sandboxes API whose idle lifetime deletes them (gateway/core/idle.ts suspends
            // the others with the same test).
            and(
              eq(sandboxes.kind, "sandbox"),
              eq(sandboxes.idleAction, "delete"),
              isNotNull(sandboxes.idleTimeoutS),
            ),
          ),
        ),
      )
      .returning();
    for (const row of rows) await switchInterval(tx, row, null, at);
    return rows;
  });
  forgetRows(deps, ...claimed.map((r) => r.id));
  for (const row of claimed) {
    deps.relays?.closeSandbox(row.id, 1001, `${row.kind} reaped`);
    if (row.vmId === null) continue;
    try {
      await inTermsOf(row, agentOf(deps, row).destroy(row.vmId, { force: true }));
    } catch (err) {
      // The row is reclaimed and no longer billed; the VM left on the agent is a VM without a
      // live row, which the agent's reconciliation with the gateway removes.
      log(`reaper: ${row.id}: agent ${row.agentId} did not destroy ${row.vmId}: ${describeError(err)}`);
    }
  }
  if (claimed.length > 0) log(`reaper: reclaimed idle ${claimed.map((r) => r.id).join(", ")}`);
  return claimed.map((r) => r.id);
}

/**
 * The one test of idleness every reaper claim makes, in SQL: running, no suspend or resume held,
 * no call in flight (or only a count left by a gateway that died during the call), and no
 * activity for its idle lifetime (the row's own `idle_timeout_s`; a session without one has the
 * operator's TTL). Open connect relays count as calls in flight (gateway/routes/connect.ts).
 */
export function idleClaimable(deps: Deps, at: Date): SQL {
  const limits = deps.config.limits;
  const lostExecCutoff = new Date(at.getTime() - (limits.maxExecTimeoutS + STALE_EXEC_MARGIN_S) * 1000);
  const lastActivity = sql`coalesce(${sandboxes.lastExecAt}, ${sandboxes.createdAt})`;
  const idleFor = sql`coalesce(${sandboxes.idleTimeoutS}, ${limits.sessionIdleTtlS}::int)`;
  return and(
    eq(sandboxes.state, "running"),
    or(isNull(sandboxes.hold), lte(sandboxes.holdUntil, at)),
    sql`${lastActivity} + make_interval(secs => ${idleFor}) < ${at.toISOString()}::timestamptz`,
    sql`(${sandboxes.execsInFlight} = 0 or ${lastActivity} < ${lostExecCutoff.toISOString()})`,
  )!;
}

/**
 * Keeps the rows of the sandboxes this gateway relays fresh (each reaper pass), so that a relay
 * open longer than any exec is not taken for a count left by a dead gateway.
 */
export async function touchRelayed(deps: Deps): Promise<void> {
  const ids = deps.relays?.sandboxIds() ?? [];
  if (ids.length === 0) return;
  await deps.db
    .update(sandboxes)
    .set({ lastExecAt: new Date(deps.clock()) })
    .where(and(inArray(sandboxes.id, ids), eq(sandboxes.state, "running")))
    .finally(() => forgetRows(deps, ...ids));
}

/**
 * How long past the longest allowed exec a one-shot exec's row may stay `starting` before it is
 * taken for the row of a gateway that died during the call: the agent's own grace and the VM's
 * create fit well within it.
 */
export const STALE_EXEC_MARGIN_S = 600;

/**
 * Ends the rows of one-shot execs whose gateway died during the call (still `starting` long after
 * any exec could have ended), so they stop holding a place in their tenant's cap. Returns the ids.
 */
export async function endStaleExecs(deps: Deps): Promise<string[]> {
  const limits = deps.config.limits;
  const cutoff = new Date(deps.clock() - (limits.maxExecTimeoutS + STALE_EXEC_MARGIN_S) * 1000);
  const failed = recordChange("failed");
  const rows = await deps.db
    .update(sandboxes)
    .set({ state: failed.state, endReason: "failed", destroyedAt: new Date(deps.clock()) })
    .where(
      and(eq(sandboxes.kind, "exec"), failed.from, sql`${sandboxes.createdAt} < ${cutoff.toISOString()}`),
    )
    .returning({ id: sandboxes.id });
  forgetRows(deps, ...rows.map((r) => r.id));
  return rows.map((r) => r.id);
}
