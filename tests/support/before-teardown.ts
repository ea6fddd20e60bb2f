/**
 * `beforeServiceTeardown(fn)`: what a file deletes through the API after its tests (the sandboxes,
 * sessions and templates a failed test left), while `up` still runs. Call it BEFORE `useService`:
 * bun runs a file's afterAll hooks in the order they were registered, so it then runs before the
 * fixture's stop.
 *
 * It never fails its hook: a throwing afterAll makes bun skip the afterAll hooks after it, the
 * fixture's stop and data-dir removal among them. What `fn` could not delete is reported here and
 * reaped by the fixture (its QEMUs killed by pid, the data dir removed).
 */
import { afterAll } from "bun:test";

export function beforeServiceTeardown(fn: () => Promise<unknown>, timeoutMs = 60_000): void {
  afterAll(async () => {
    try {
      await fn();
    } catch (err) {
      console.warn(`cleanup before the service's teardown: ${err instanceof Error ? err.message : err}`);
    }
  }, timeoutMs);
}
