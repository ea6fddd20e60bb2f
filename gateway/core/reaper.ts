/**
 * The reaper: one timer per gateway process whose pass reclaims idle sessions API sessions and the
 * Sandboxes of the sandboxes API whose idle lifetime deletes them (sandboxes/reaping.ts reapIdleSessions), suspends
 * those whose lifetime suspends them (idle.ts), and ends one-shot execs whose call was lost. Each
 * claim is one conditional UPDATE, so several gateways on one database act once per record.
 */
import { describeError } from "../../contracts/errors.ts";
import type { Deps } from "../deps.ts";
import { suspendIdleSandboxes } from "./idle.ts";
import { endStaleExecs, reapIdleSessions, touchRelayed } from "./sandboxes.ts";

/**
 * Runs a pass every `reaperIntervalS`. Returns its stop, which waits for a pass in progress so
 * that the database is not closed under it.
 */
export function startReaper(
  deps: Deps,
  log: (line: string) => void = console.error,
): { stop(): Promise<void> } {
  let pass: Promise<void> | undefined;
  const refused = new Set<string>();
  const timer = setInterval(() => {
    if (pass) return; // a slow pass must not overlap the next
    // This process's ends written first, so that its own finished calls count as finished.
    pass = (deps.activity?.flush() ?? Promise.resolve())
      .then(() => touchRelayed(deps))
      .then(() => reapIdleSessions(deps, log))
      .then(() => suspendIdleSandboxes(deps, log, refused))
      .then(() => endStaleExecs(deps))
      .then((ended) => {
        if (ended.length > 0) log(`reaper: ended one-shot execs whose call was lost: ${ended.join(", ")}`);
      })
      .catch((err) => log(`reaper: ${describeError(err)}`))
      .finally(() => {
        pass = undefined;
      });
  }, deps.config.limits.reaperIntervalS * 1000);
  return {
    async stop() {
      clearInterval(timer);
      await pass;
    },
  };
}
