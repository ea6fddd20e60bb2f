/**
 * The reaper: per gateway process, a pass that reclaims idle sessions API sessions and the
 * Sandboxes of the sandboxes API whose idle lifetime deletes them (sandboxes/reaping.ts reapIdleSessions), suspends
 * those whose lifetime suspends them (idle.ts), applies absolute lifetimes (lifetimes.ts), and ends
 * one-shot execs whose call was lost. Each claim is one conditional UPDATE, so several gateways on
 * one database act once per record.
 *
 * The pass runs every `reaperIntervalS` and, so that a lifetime is acted on within about a second
 * of its end rather than up to one interval late, at the earliest deadline this process knows
 * (the deadline timer): deadlines its own writes make (deadlines.ts `Deadlines.note`) and the
 * earliest one in the database, read after each pass and every `DEADLINE_REREAD_MS` (rows another
 * gateway wrote, whose own timer normally acts first, or whose writer died). One timer, whatever
 * the number of sandboxes.
 */
import { describeError } from "../../contracts/errors.ts";
import type { Deps } from "../deps.ts";
import { suspendIdleSandboxes } from "./idle.ts";
import { expireSandboxes, nextDeadline } from "./lifetimes.ts";
import { endStaleExecs, reapIdleSessions, touchRelayed } from "./sandboxes.ts";

/**
 * The fewest ms between two passes the deadline timer starts: at most five passes a second per
 * gateway however dense the deadlines (each pass is a handful of UPDATEs; deadlines due within
 * one gap are taken by the same pass), and 200 ms is small beside "within about a second".
 */
export const DEADLINE_MIN_GAP_MS = 200;
/**
 * How often the earliest deadline is read from the database when nothing woke the timer sooner:
 * the lateness bound for a deadline no live gateway noted (its writer died, or it was made before
 * this process started), at the cost of two small queries per gateway each time.
 */
export const DEADLINE_REREAD_MS = 5000;
/**
 * When a pass left rows that were due (a suspend or resume held them, which lasts about a second,
 * or the suspended quota was full), the timer comes back after this rather than at once: bounded
 * retries, one pass per 5 s at most for such rows, instead of a pass per gap.
 */
export const DUE_RETRY_MS = 5000;
/**
 * The timer wakes this long after a deadline: the claims test `deadline < now`, and a timer may
 * fire a millisecond early against the gateway's clock.
 */
const WAKE_SLACK_MS = 5;

/**
 * Starts the interval pass and the deadline timer. Returns its stop, which waits for a pass in
 * progress so that the database is not closed under it.
 */
export function startReaper(
  deps: Deps,
  log: (line: string) => void = console.error,
): { stop(): Promise<void> } {
  let pass: Promise<void> | undefined;
  const refused = new Set<string>();
  let stopped = false;

  /** One pass (never two at once: a second caller waits for the one in progress, then runs). */
  const runPass = async (): Promise<void> => {
    while (pass) await pass;
    // This process's ends written first, so that its own finished calls count as finished.
    pass = (deps.activity?.flush() ?? Promise.resolve())
      .then(() => touchRelayed(deps))
      .then(() => reapIdleSessions(deps, log))
      .then(() => suspendIdleSandboxes(deps, log, refused))
      .then(() => expireSandboxes(deps, log, refused))
      .then(() => endStaleExecs(deps))
      .then((ended) => {
        if (ended.length > 0) log(`reaper: ended one-shot execs whose call was lost: ${ended.join(", ")}`);
      })
      .catch((err) => log(`reaper: ${describeError(err)}`))
      .finally(() => {
        pass = undefined;
      });
    await pass;
  };

  const interval = setInterval(() => {
    if (pass) return; // a slow pass must not overlap the next
    void runPass();
  }, deps.config.limits.reaperIntervalS * 1000);

  // The deadline timer's state: the earliest deadline known (null: none within the re-read), the
  // one timer, whether a wake is being handled, when the last pass it ran began.
  let target: number | null = null;
  let timer: ReturnType<typeof setTimeout> | undefined;
  let waking: Promise<void> | undefined;
  let lastPassAt = 0;

  const arm = (): void => {
    clearTimeout(timer);
    timer = undefined;
    if (stopped || waking) return;
    const now = deps.clock();
    let at = Math.min(target ?? Number.POSITIVE_INFINITY, now + DEADLINE_REREAD_MS);
    if (target !== null && at === target) at = Math.max(at + WAKE_SLACK_MS, lastPassAt + DEADLINE_MIN_GAP_MS);
    timer = setTimeout(
      () => {
        timer = undefined;
        waking = wake().finally(() => {
          waking = undefined;
          arm();
        });
      },
      Math.max(0, at - now),
    );
  };

  const wake = async (): Promise<void> => {
    try {
      if (target !== null && deps.clock() >= target) {
        target = null;
        lastPassAt = deps.clock();
        await runPass();
      }
      if (stopped) return;
      // Rows due before the last pass began were tried by it; those due since are the next.
      const { next, dueLeft } = await nextDeadline(deps, new Date(lastPassAt));
      const retry = dueLeft ? Math.max(deps.clock(), lastPassAt + DUE_RETRY_MS) : null;
      // `target` may hold a deadline noted meanwhile.
      const known = [target, next, retry].filter((v): v is number => v !== null);
      target = known.length > 0 ? Math.min(...known) : null;
    } catch (err) {
      log(`reaper: deadline timer: ${describeError(err)}`);
    }
  };

  const unlisten = deps.deadlines?.listen((ms) => {
    if (target !== null && target <= ms) return;
    target = ms;
    arm(); // while a wake is handled, its end arms with the new target
  });
  arm();

  return {
    async stop() {
      stopped = true;
      unlisten?.();
      clearInterval(interval);
      clearTimeout(timer);
      await waking;
      await pass;
    },
  };
}
