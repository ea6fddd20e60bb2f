/**
 * A step whose failure must not stop its caller (a cleanup on a path that is already failing),
 * logged instead of swallowed: a VM that could not be destroyed is a leak that someone has to be
 * able to find, and a bare `.catch(() => {})` leaves no trace of it.
 */
import { describeError } from "./errors.ts";

/**
 * Awaits `step` (a promise, or a function whose promise or throw it takes); on failure logs
 * `<what> failed: <error>` and resolves false. Resolves true when the step succeeded.
 */
export async function bestEffort(
  log: (message: string) => void,
  what: string,
  step: Promise<unknown> | (() => unknown),
): Promise<boolean> {
  try {
    await (typeof step === "function" ? step() : step);
    return true;
  } catch (err) {
    log(`${what} failed: ${describeError(err)}`);
    return false;
  }
}
