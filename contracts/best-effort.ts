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

/**
 * Resolves when `p` settles, either way. For a promise whose rejection its owner already
 * reports: the tail of a queue (each caller gets its own step's error), an in-flight launch a
 * stop waits out (the launch's caller got the error), a reader cancelled after its stream failed
 * (the cancel repeats the stream's own error). Names the one reason a rejection may go unread
 * here, where a bare `.catch(() => {})` says nothing.
 */
export async function settled(p: PromiseLike<unknown> | undefined): Promise<void> {
  try {
    await p;
  } catch {
    // The owner reports this rejection (see above); waiting for the settle is all this does.
  }
}

/**
 * Keeps a promise that is awaited later (a race, a connection started early) from counting as
 * an unhandled rejection while it waits: Node and Bun end the process on one. Its rejection is
 * not dropped: whoever awaits `p` gets it.
 */
export function awaitedLater(p: PromiseLike<unknown>): void {
  void settled(p);
}

/**
 * `p`'s value, or undefined when the path it reads does not exist (ENOENT, ENOTDIR): for files
 * that are optional by design (a claim file, a cache entry). Any other error (permissions, I/O)
 * is thrown, not mistaken for absence.
 */
export async function ifExists<T>(p: Promise<T>): Promise<T | undefined> {
  try {
    return await p;
  } catch (err) {
    const code = (err as { code?: unknown }).code;
    if (code === "ENOENT" || code === "ENOTDIR") return undefined;
    throw err;
  }
}
