/**
 * The deadlines this process's writes make, said to its deadline timer (reaper.ts startReaper), and
 * how a row's deadlines are computed. A leaf: the sandbox modules that write deadlines import it.
 */
import type { sandboxes } from "../../db/schema/sandboxes.ts";

type Row = typeof sandboxes.$inferSelect;

/**
 * Where this process's writes say that a deadline now exists (ms on the gateway's clock); the
 * deadline timer (reaper.ts startReaper) listens. A note only ever brings the timer earlier: a
 * deadline that moves later (a call's activity) is found by the pass that wakes at the old one,
 * which reads the next from the database.
 */
export class Deadlines {
  private wake: ((ms: number) => void) | undefined;

  note(ms: number | null | undefined): void {
    if (ms === null || ms === undefined || !Number.isFinite(ms)) return;
    this.wake?.(ms);
  }

  /** One listener (the process's deadline timer); returns its removal. */
  listen(wake: (ms: number) => void): () => void {
    this.wake = wake;
    return () => {
      if (this.wake === wake) this.wake = undefined;
    };
  }
}

/** Says a deadline to this process's timer, if it has one (tests without a reaper have none). */
export function noteDeadline(deps: { deadlines?: Deadlines }, ms: number | null | undefined): void {
  deps.deadlines?.note(ms);
}

/**
 * When a row's idle lifetime ends if no call comes after `lastMs` (null: it has none): its own
 * `idle_timeout_s`, or for a sessions API session the operator's TTL.
 */
export function idleDeadlineMs(
  deps: { config: { limits: { sessionIdleTtlS: number } } },
  row: Pick<Row, "kind" | "api" | "idleTimeoutS">,
  lastMs: number,
): number | null {
  if (row.kind === "session" && row.api === "sessions") {
    return lastMs + (row.idleTimeoutS ?? deps.config.limits.sessionIdleTtlS) * 1000;
  }
  if (row.kind === "sandbox" && row.idleTimeoutS !== null) return lastMs + row.idleTimeoutS * 1000;
  return null;
}

/** The absolute lifetime a row starts with, counted from `nowMs`: the columns to write. */
export function lifetimeColumns(
  lifetime: { timeoutS: number | null; onTimeout: "delete" | "suspend" | null } | undefined,
  nowMs: number,
): { timeoutS: number | null; onTimeout: "delete" | "suspend" | null; expiresAt: Date | null } {
  if (lifetime === undefined) return { timeoutS: null, onTimeout: null, expiresAt: null };
  const expiresAt = lifetime.timeoutS !== null ? new Date(nowMs + lifetime.timeoutS * 1000) : null;
  return { timeoutS: lifetime.timeoutS, onTimeout: lifetime.onTimeout, expiresAt };
}
