/**
 * Absolute lifetimes of sandboxes API sandboxes (`timeout_seconds`, `on_timeout`; columns
 * `timeout_s`, `expires_at`, `on_timeout`), and what the deadline timer (reaper.ts) needs to act on
 * every lifetime, absolute and idle, within about a second of its end:
 *
 * - `Deadlines` (deadlines.ts): this process's writes that make a deadline (a create, a new
 *   timeout, a resume, a call's end) say so, and the timer wakes at the earliest.
 * - `expireSandboxes`: the claims at the deadline, one conditional UPDATE each, so with several
 *   gateways exactly one acts on a row (`delete`: to `destroyed`, `end_reason` `expired`;
 *   `suspend`: the suspend hold, then the same suspend as an idle one, idle.ts).
 * - `nextDeadline`: the earliest deadline in the database, read after each pass and now and then
 *   (rows another gateway wrote, or whose writer died).
 */
import { and, eq, inArray, isNotNull, isNull, lte, or, type SQL, sql } from "drizzle-orm";
import { describeError, SandboxdError } from "../../contracts/errors.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import type { Principal } from "../auth/keys.ts";
import type { Deps } from "../deps.ts";
import { noteDeadline } from "./deadlines.ts";
import { suspendClaimed } from "./idle.ts";
import { recordChange } from "./record-states.ts";
import { forgetRows } from "./row-cache.ts";
import { STALE_EXEC_MARGIN_S } from "./sandboxes/reaping.ts";
import { agentOf, getOwned, HOLD_TTL_MS, inTermsOf, type SandboxRow, switchInterval } from "./sandboxes.ts";

/**
 * Rows past their absolute deadline that no suspend or resume holds: a hold lasts as long as the
 * agent's call (a second or two; `hold_until` ends one whose gateway died), and the row's state
 * after it decides what the deadline does.
 */
function dueAt(at: Date): SQL {
  return and(
    eq(sandboxes.kind, "sandbox"),
    isNotNull(sandboxes.expiresAt),
    lte(sandboxes.expiresAt, at),
    or(isNull(sandboxes.hold), lte(sandboxes.holdUntil, at)),
  )!;
}

/**
 * Applies `on_timeout` to the sandboxes past their deadline: `delete` ends running and suspended
 * ones (one UPDATE claims them all, so each is ended once whichever gateways race), `suspend`
 * takes the suspend hold of running ones (one UPDATE) and suspends each as an idle suspend is
 * (same quota fallback: a full suspended quota leaves it running, tried again later). Whatever
 * the sandbox is doing: calls in flight on it fail, relays on it close. Returns the ids acted on.
 */
export async function expireSandboxes(
  deps: Deps,
  log: (line: string) => void = () => {},
  refused: Set<string> = new Set(),
): Promise<string[]> {
  const at = new Date(deps.clock());
  const ended = recordChange("destroy");
  const deleted = await deps.db.transaction(async (tx) => {
    const rows = await tx
      .update(sandboxes)
      .set({ state: ended.state, endReason: "expired", destroyedAt: at, expiresAt: null })
      .where(
        and(dueAt(at), eq(sandboxes.onTimeout, "delete"), inArray(sandboxes.state, ["running", "suspended"])),
      )
      .returning();
    for (const row of rows) await switchInterval(tx, row, null, at);
    return rows;
  });
  forgetRows(deps, ...deleted.map((r) => r.id));
  for (const row of deleted) {
    deps.relays?.closeSandbox(row.id, 1001, "sandbox deleted at its timeout");
    if (row.vmId === null) continue;
    try {
      await inTermsOf(row, agentOf(deps, row).destroy(row.vmId, { force: true }));
    } catch (err) {
      // The row is ended and no longer billed; a VM left on the agent has no live row, and the
      // agent's reconciliation with the gateway removes it.
      log(`reaper: ${row.id}: agent ${row.agentId} did not destroy ${row.vmId}: ${describeError(err)}`);
    }
  }
  const claimed = await deps.db
    .update(sandboxes)
    .set({ hold: "suspend", holdUntil: new Date(at.getTime() + HOLD_TTL_MS), suspendedBy: "timeout" })
    .where(and(dueAt(at), eq(sandboxes.onTimeout, "suspend"), eq(sandboxes.state, "running")))
    .returning();
  forgetRows(deps, ...claimed.map((r) => r.id));
  const suspended: string[] = [];
  for (const row of claimed) {
    deps.relays?.closeSandbox(row.id, 1001, "sandbox suspended at its timeout");
    if (await suspendClaimed(deps, row, at, "timeout", log, refused)) suspended.push(row.id);
  }
  if (deleted.length > 0) log(`reaper: deleted at their timeout ${deleted.map((r) => r.id).join(", ")}`);
  if (suspended.length > 0) log(`reaper: suspended at their timeout ${suspended.join(", ")}`);
  return [...deleted.map((r) => r.id), ...suspended];
}

/**
 * The earliest deadline after `after` (ms), absolute or idle, of any live row in the database,
 * and whether rows already due were left (held by a suspend or resume in flight, or kept
 * running by a full suspended quota): the timer comes back for those a little later.
 *
 * Two reads: the absolute one walks `sandboxes_expires_idx` from `after` (rows deleted before
 * their deadline keep `expires_at` only when something other than a delete ended them);
 * the idle one is a computed deadline per running row with an idle lifetime (no index can hold
 * it: it moves with every call), so it reads those rows, once per pass and per re-read (bounded
 * in reaper.ts), never per request.
 */
export async function nextDeadline(
  deps: Deps,
  after: Date,
): Promise<{ next: number | null; dueLeft: boolean }> {
  const limits = deps.config.limits;
  const afterIso = after.toISOString();
  const live = or(
    eq(sandboxes.state, "running"),
    and(eq(sandboxes.state, "suspended"), eq(sandboxes.onTimeout, "delete")),
  );
  const [abs] = await deps.db
    .select({
      next: sql<
        Date | string | null
      >`min(${sandboxes.expiresAt}) filter (where ${sandboxes.expiresAt} > ${afterIso}::timestamptz)`,
      due: sql<boolean | null>`bool_or(${sandboxes.expiresAt} <= ${afterIso}::timestamptz)`,
    })
    .from(sandboxes)
    .where(and(eq(sandboxes.kind, "sandbox"), isNotNull(sandboxes.expiresAt), live));
  const staleS = limits.maxExecTimeoutS + STALE_EXEC_MARGIN_S;
  const last = sql`coalesce(${sandboxes.lastExecAt}, ${sandboxes.createdAt})`;
  const idleFor = sql`coalesce(${sandboxes.idleTimeoutS}, ${limits.sessionIdleTtlS}::int)`;
  // A call in flight holds the row until it ends (its end notes its own deadline) or until its
  // count is old enough to be taken for a dead gateway's; a hold until it ends.
  const deadline = sql`greatest(
    ${last} + make_interval(secs => ${idleFor}),
    case when ${sandboxes.execsInFlight} > 0 then ${last} + make_interval(secs => ${staleS}::int) end,
    case when ${sandboxes.hold} is not null then ${sandboxes.holdUntil} end
  )`;
  const [idle] = await deps.db
    .select({
      next: sql<Date | string | null>`min(${deadline}) filter (where ${deadline} > ${afterIso}::timestamptz)`,
      due: sql<boolean | null>`bool_or(${deadline} <= ${afterIso}::timestamptz)`,
    })
    .from(sandboxes)
    .where(
      and(
        eq(sandboxes.state, "running"),
        or(
          and(eq(sandboxes.kind, "session"), eq(sandboxes.api, "sessions")),
          and(eq(sandboxes.kind, "sandbox"), isNotNull(sandboxes.idleTimeoutS)),
        ),
      ),
    );
  const ms = (v: Date | string | null | undefined) =>
    v === null || v === undefined ? null : new Date(v).getTime();
  const candidates = [ms(abs?.next), ms(idle?.next)].filter((v): v is number => v !== null);
  return {
    next: candidates.length > 0 ? Math.min(...candidates) : null,
    dueLeft: abs?.due === true || idle?.due === true,
  };
}

/**
 * `POST /v1/sandboxes/{id}/timeout`: a new absolute lifetime, counted from this call, on a
 * running or suspended sandbox (one compare-and-set on those states: a sandbox ending meanwhile
 * answers as an ended one). `onTimeout` absent: the sandbox's own, else `delete`.
 */
export async function setSandboxTimeout(
  deps: Deps,
  p: Principal,
  id: string,
  timeoutS: number,
  onTimeout: "delete" | "suspend" | undefined,
): Promise<SandboxRow> {
  const row = await getOwned(deps, p, id);
  const on = onTimeout ?? row.onTimeout ?? "delete";
  const expiresAt = new Date(deps.clock() + timeoutS * 1000);
  const [updated] = await deps.db
    .update(sandboxes)
    .set({ timeoutS, onTimeout: on, expiresAt })
    .where(and(eq(sandboxes.id, row.id), inArray(sandboxes.state, ["running", "suspended"])))
    .returning()
    .finally(() => forgetRows(deps, row.id));
  if (!updated) {
    const now = await getOwned(deps, p, id); // 404 once ended
    throw new SandboxdError("conflict", `cannot set the timeout of ${id}: it is ${now.state}`, {
      details: { state: now.state },
    });
  }
  noteDeadline(deps, expiresAt.getTime());
  return updated;
}

/**
 * The absolute lifetime fields of a sandboxes API answer. `expires_at` while it applies: running,
 * or suspended with a deadline that deletes it (a suspended sandbox whose deadline suspends it
 * has nothing to fear from it, and its next resume counts the lifetime again).
 */
export function lifetimeInfo(row: SandboxRow): {
  timeout_seconds?: number;
  on_timeout?: "delete" | "suspend";
  expires_at?: string;
} {
  if (row.timeoutS === null) return {};
  const applies = row.state === "running" || (row.state === "suspended" && row.onTimeout === "delete");
  return {
    timeout_seconds: row.timeoutS,
    on_timeout: row.onTimeout ?? "delete",
    ...(applies && row.expiresAt !== null ? { expires_at: row.expiresAt.toISOString() } : {}),
  };
}
