/**
 * The tenant's caps: what counts against them (`countInStates`), and the quota hold a suspend or
 * resume takes, atomically per tenant, before the agent is called, so a racing request counts it.
 */
import { and, eq, gt, inArray, isNull, lte, or, sql } from "drizzle-orm";
import { SandboxdError } from "../../../contracts/errors.ts";
import { sandboxes } from "../../../db/schema/sandboxes.ts";
import type { Principal } from "../../auth/keys.ts";
import type { Deps } from "../../deps.ts";
import { nextState, RECORD_TRANSITIONS, type RecordState } from "../record-states.ts";
import { forgetRows } from "../row-cache.ts";
import { underTenantLock } from "../tenant-lock.ts";
import type { SandboxRow } from "./records.ts";

/**
 * The tenant's records of its API in `states` (in `db`, or a transaction of it), plus, with
 * `held`, the live records held for that change (`holdForQuota`): they are on their way there.
 */
export async function countInStates(
  db: Pick<Deps["db"], "select">,
  p: Pick<Principal, "tenantId" | "api">,
  states: RecordState[],
  held?: { hold: QuotaHold; now: Date },
): Promise<number> {
  const inStates = inArray(sandboxes.state, states);
  const [c] = await db
    .select({ n: sql<number>`count(*)::int` })
    .from(sandboxes)
    .where(
      and(
        eq(sandboxes.tenantId, p.tenantId),
        eq(sandboxes.api, p.api),
        held === undefined
          ? inStates
          : or(
              inStates,
              and(
                eq(sandboxes.hold, held.hold),
                gt(sandboxes.holdUntil, held.now),
                inArray(sandboxes.state, RECORD_TRANSITIONS[held.hold].from),
              ),
            ),
      ),
    );
  return c?.n ?? 0;
}

export type QuotaHold = "suspend" | "resume";

/**
 * How long a hold counts at most, ms: well past the longest suspend or resume the gateway waits
 * for (the agent client's `vmOp`, 120 s by default), so only a hold whose gateway died during the
 * call ever runs out, and it stops counting then.
 */
export const HOLD_TTL_MS = 10 * 60_000;

/**
 * Checks the quota of the state `hold` leads to and, in the same locked transaction
 * (tenant-lock.ts), marks the record as on its way there, so a racing request counts it. The
 * agent is asked only after the lock is released; `releaseHold` or the recorded change ends it.
 * A record already held (a suspend or resume of it in flight) is a 409.
 */
export async function holdForQuota(
  deps: Deps,
  p: Principal,
  row: SandboxRow,
  hold: QuotaHold,
  quota: { cap: number; what: string },
): Promise<void> {
  const now = new Date(deps.clock());
  const target = nextState(hold);
  // Suspended counts those in the target state; running also those still starting.
  const states: RecordState[] = target === "running" ? ["starting", "running"] : [target];
  await underTenantLock(deps.db, p.tenantId, async (tx) => {
    const n = await countInStates(tx, p, states, { hold, now });
    if (n >= quota.cap) {
      throw new SandboxdError("quota_exceeded", `quota reached: ${n} of ${quota.cap} ${quota.what}`, {
        details: { cap: quota.cap, current: n },
      });
    }
    const held = await tx
      .update(sandboxes)
      .set({ hold, holdUntil: new Date(now.getTime() + HOLD_TTL_MS) })
      .where(
        and(
          eq(sandboxes.id, row.id),
          eq(sandboxes.state, row.state),
          or(isNull(sandboxes.hold), lte(sandboxes.holdUntil, now)),
        ),
      )
      .returning({ id: sandboxes.id })
      .finally(() => forgetRows(deps, row.id));
    if (held.length === 0) {
      throw new SandboxdError(
        "conflict",
        `cannot ${hold} ${row.id}: a suspend or resume of it is in progress`,
      );
    }
  });
}

/** Ends a hold whose change failed (the record keeps its state). */
export async function releaseHold(deps: Deps, id: string, hold: QuotaHold): Promise<void> {
  await deps.db
    .update(sandboxes)
    .set({ hold: null, holdUntil: null })
    .where(and(eq(sandboxes.id, id), eq(sandboxes.hold, hold)))
    .finally(() => forgetRows(deps, id));
}
