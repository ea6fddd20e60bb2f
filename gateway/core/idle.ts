/**
 * Idle lifetimes of sandboxes API sandboxes (`idle_timeout_seconds` + `idle_action: "suspend"`): the
 * reaper suspends a sandbox idle past its lifetime through the same hold and quota as a user's
 * suspend, and the sandbox's next exec, fork or connect resumes it first (`wakeIfIdle`). The
 * `delete` action is the session reaper's claim (sandboxes/reaping.ts reapIdleSessions), which also takes
 * The sandboxes API rows whose lifetime deletes them. Both claims use one idleness test (`idleClaimable`).
 */
import { and, eq, isNotNull, isNull } from "drizzle-orm";
import { bestEffort } from "../../contracts/best-effort.ts";
import { describeError, SandboxdError } from "../../contracts/errors.ts";
import { apiKeys } from "../../db/schema/api-keys.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import type { Principal } from "../auth/keys.ts";
import type { Deps } from "../deps.ts";
import { logOf } from "../deps.ts";
import { forgetRows } from "./row-cache.ts";
import {
  agentOf,
  applyTransition,
  countInStates,
  getOwned,
  HOLD_TTL_MS,
  idleClaimable,
  inTermsOf,
  resumeVm,
  type SandboxRow,
} from "./sandboxes.ts";
import { type Tx, underTenantLock } from "./tenant-lock.ts";

/**
 * Claims the sandboxes API sandboxes idle past a lifetime that suspends them (one conditional UPDATE:
 * the suspend hold, marked `suspended_by = idle`, so exactly one reaper of all gateways takes
 * each), then suspends each. Returns the ids suspended. A suspend the tenant's suspended quota
 * has no room for leaves the sandbox running (its state is never lost to a quota) and is tried
 * again on later passes; `refused` remembers which were logged so the log says it once.
 */
export async function suspendIdleSandboxes(
  deps: Deps,
  log: (line: string) => void = () => {},
  refused: Set<string> = new Set(),
): Promise<string[]> {
  const at = new Date(deps.clock());
  const claimed = await deps.db
    .update(sandboxes)
    .set({ hold: "suspend", holdUntil: new Date(at.getTime() + HOLD_TTL_MS), suspendedBy: "idle" })
    .where(
      and(
        idleClaimable(deps, at),
        eq(sandboxes.kind, "sandbox"),
        eq(sandboxes.idleAction, "suspend"),
        isNotNull(sandboxes.idleTimeoutS),
      ),
    )
    .returning();
  forgetRows(deps, ...claimed.map((r) => r.id));
  const done: string[] = [];
  // One after the other: each quota check sees the holds the earlier ones released.
  for (const row of claimed) {
    if (await suspendClaimed(deps, row, at, "idle", log, refused)) done.push(row.id);
  }
  if (done.length > 0) log(`reaper: suspended idle sandboxes ${done.join(", ")}`);
  return done;
}

/** How many quota-refused sandboxes a reaper remembers having logged. */
const REFUSED_MEMORY = 10_000;

/**
 * Suspends a row the service claimed (its suspend hold taken, `suspended_by` = `by`): for
 * idleness (here) or at its absolute deadline (lifetimes.ts). Same quota fallback for both.
 */
export async function suspendClaimed(
  deps: Deps,
  row: SandboxRow,
  at: Date,
  by: "idle" | "timeout",
  log: (line: string) => void,
  refused: Set<string>,
): Promise<boolean> {
  const full = await underTenantLock(deps.db, row.tenantId, async (tx) => {
    const cap = await suspendedCap(deps, tx, row.tenantId);
    // The count includes this record's own hold.
    const n = await countInStates(tx, { tenantId: row.tenantId, api: "sandboxes" }, ["suspended"], {
      hold: "suspend",
      now: at,
    });
    if (n <= cap) return undefined;
    await releaseIdleHold(tx, row.id, by);
    return { n: n - 1, cap };
  });
  if (full) forgetRows(deps, row.id);
  if (full) {
    if (!refused.has(row.id)) {
      // Ids of sandboxes deleted meanwhile stay in the set: forgetting them all now and then
      // bounds it, at the price of one repeated log line.
      if (refused.size >= REFUSED_MEMORY) refused.clear();
      refused.add(row.id);
      log(
        `reaper: ${row.id} is ${by === "idle" ? "idle" : "past its timeout"} but stays running: its tenant holds ${full.n} of ${full.cap} suspended sandboxes`,
      );
    }
    return false;
  }
  refused.delete(row.id);
  try {
    const r = await inTermsOf(row, agentOf(deps, row).suspend(row.vmId!));
    await applyTransition(
      deps,
      row,
      "suspend",
      { hold: null, holdUntil: null, suspendedBy: by },
      { state: "suspended", vcpus: 0, memMib: 0, diskBytes: r.snapshotBytes },
    );
    return true;
  } catch (err) {
    await bestEffort(
      logOf(deps),
      `releasing the ${by} hold of ${row.id}`,
      releaseIdleHold(deps.db, row.id, by),
    );
    forgetRows(deps, row.id);
    log(`reaper: ${row.id}: ${by} suspend failed, it stays running: ${describeError(err)}`);
    return false;
  }
}

/** Ends the service's hold on a record it did not suspend (the record keeps running). */
async function releaseIdleHold(db: Tx | Deps["db"], id: string, by: "idle" | "timeout"): Promise<void> {
  await db
    .update(sandboxes)
    .set({ hold: null, holdUntil: null, suspendedBy: null })
    .where(and(eq(sandboxes.id, id), eq(sandboxes.hold, "suspend"), eq(sandboxes.suspendedBy, by)));
}

/**
 * The suspended quota of a tenant for a suspend no key asked for: quotas are per key tier, so the
 * largest of its live keys' tiers (the most that one of its own calls could have suspended).
 */
async function suspendedCap(deps: Deps, tx: Tx, tenantId: string): Promise<number> {
  const tiers = await tx
    .select({ tier: apiKeys.tier })
    .from(apiKeys)
    .where(and(eq(apiKeys.tenantId, tenantId), isNull(apiKeys.revokedAt)));
  const byTier = deps.config.limits.suspendedQuotaByTier;
  return Math.max(0, ...tiers.map((t) => byTier[t.tier] ?? 0));
}

/**
 * How long a call waits for a suspend or resume of its sandbox by the reaper or another call, ms:
 * past the agent client's 120 s bound on either, so the wait ends with the change, not before.
 */
const WAKE_WAIT_MS = 130_000;
/** How often a waiting call looks again: a resume takes a second or more, 100 ms is small beside it. */
const WAKE_POLL_MS = 100;

/**
 * Before a call that needs a running sandbox (exec, fork, connect): a sandbox the service suspended
 * (for idleness, or at its absolute deadline with `on_timeout: suspend`) is resumed first (with the same quota check as a resume call: 429 when the tenant
 * runs its quota already), and a call that finds the reaper's suspend, or another call's resume,
 * in flight waits for it, so concurrent calls resume it once. Any other sandbox is left as it is:
 * one the user suspended keeps refusing calls (409) until resumed.
 */
export async function wakeIfIdle(deps: Deps, p: Principal, id: string): Promise<void> {
  const until = deps.clock() + WAKE_WAIT_MS;
  for (;;) {
    const row = await getOwned(deps, p, id);
    // The service's own suspends (idleness, the absolute deadline) wake transparently.
    if (row.suspendedBy !== "idle" && row.suspendedBy !== "timeout") return;
    const held = row.hold !== null && row.holdUntil !== null && row.holdUntil.getTime() > deps.clock();
    if (!held) {
      if (row.state !== "suspended") return;
      try {
        await resumeVm(deps, p, id);
        return;
      } catch (err) {
        // Another call took the resume first: wait for it like for the reaper's suspend.
        if (!(err instanceof SandboxdError && err.code === "conflict")) throw err;
      }
    }
    if (deps.clock() > until) {
      throw new SandboxdError("conflict", `sandbox ${id} is being suspended or resumed; try again`);
    }
    await new Promise((r) => setTimeout(r, WAKE_POLL_MS));
  }
}

/** The idle lifetime fields of a sandboxes API info answer. */
export function idleInfo(row: SandboxRow): {
  idle_timeout_seconds?: number;
  idle_action?: "suspend" | "delete";
  suspended_by?: "user" | "idle" | "timeout";
} {
  return {
    ...(row.idleTimeoutS !== null ? { idle_timeout_seconds: row.idleTimeoutS } : {}),
    ...(row.idleTimeoutS !== null && row.idleAction !== null ? { idle_action: row.idleAction } : {}),
    ...(row.state === "suspended" && row.suspendedBy !== null ? { suspended_by: row.suspendedBy } : {}),
  };
}
