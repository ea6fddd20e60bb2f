/**
 * RAM files (a template's, a fork point's) should hold only the pages a guest wrote: on tmpfs
 * every allocated page is host memory, paid once per file for as long as it lives. Two things
 * allocate pages that are all zeros:
 *
 * - The guest kernel zeroes pages it hands out (Debian's kernel defaults to `init_on_alloc=1`)
 *   while the template boots with the file mapped shared.
 * - Any full-RAM migration of a VM that maps the file private (a suspend, a stop-and-copy fork)
 *   reads every guest page through that mapping, and a read fault on a hole of a tmpfs file
 *   allocates a zeroed page IN THE FILE (shmem has no shared zero page for it). One suspend of
 *   one child filled a 256 MiB template's file from ~88 MiB to 256 MiB (measured).
 *
 * `fallocate --dig-holes` (util-linux) punches every all-zero block back into a hole. Safe while
 * children map the file private: a punched page's content was zeros, so a child that maps it
 * refaults and reads zeros again, and pages a child wrote are its own copy-on-write copies, which
 * a punch leaves alone. It must not run while a QEMU maps the file shared and may write it (the
 * template or fork point being frozen): callers dig only once that QEMU is gone.
 */
import { spawn } from "node:child_process";
import { stat } from "node:fs/promises";
import { SandboxdError } from "../../contracts/errors.ts";

/**
 * Bound on one dig: it reads the file once (~0.1 s per 64 MiB measured on a loaded 2-core host),
 * so 60 s means a hung process, which is killed; the file is merely left fuller.
 */
const DIG_TIMEOUT_MS = 60_000;

/** Allocated bytes of `path` (what it costs on tmpfs). */
export async function allocatedBytes(path: string): Promise<number> {
  return (await stat(path)).blocks * 512;
}

/**
 * Punches the all-zero blocks of `path` into holes. Never throws: a failure leaves the file as
 * it was (correct, only fuller) and is logged. Returns the allocated bytes before and after.
 */
export async function digZeroHoles(
  path: string,
  log: (m: string) => void = () => {},
): Promise<{ before: number; after: number } | undefined> {
  try {
    const before = await allocatedBytes(path);
    await new Promise<void>((ok, fail) => {
      const child = spawn("fallocate", ["--dig-holes", path], { stdio: ["ignore", "ignore", "pipe"] });
      let err = "";
      child.stderr.on("data", (b: Buffer) => {
        err = (err + b.toString()).slice(-500);
      });
      const timer = setTimeout(() => child.kill("SIGKILL"), DIG_TIMEOUT_MS);
      child.once("error", fail);
      child.once("close", (code, signal) => {
        clearTimeout(timer);
        if (code === 0) ok();
        else
          fail(
            new SandboxdError("internal", `fallocate --dig-holes exited ${code ?? signal}: ${err.trim()}`),
          );
      });
    });
    return { before, after: await allocatedBytes(path) };
  } catch (err) {
    log(`RAM file ${path} left as it is: ${err instanceof Error ? err.message : String(err)}`);
    return undefined;
  }
}

/**
 * How long a RAM file stays as a suspend or resume left it before it is dug. Every suspend of a
 * VM reads all of its guest pages, and each hole of its RAM file costs a page allocation then:
 * ~150 ms of a 256 MiB guest's suspend under TCG here (~250 ms against ~100 ms on a file already
 * full). Dug after every suspend, every suspend paid it; dug at most once per this delay, the
 * suspends that follow within it (idle sandboxes of one template suspended together) find the
 * file full and cost ~100 ms. The price: the file holds the zero pages (up to the guest's RAM)
 * for up to this long.
 */
export const DIG_DELAY_MS = 30_000;

/** Digs scheduled by digLater, by path: one per file at a time. */
const scheduled = new Map<string, { timer: ReturnType<typeof setTimeout>; log: (m: string) => void }>();

/**
 * Digs `path` DIG_DELAY_MS from now, unless a dig of it is already scheduled. Never throws; a
 * file gone by then (its last VM ended) is skipped. The timer does not keep the process alive: an
 * agent that exits first leaves the file fuller, which is correct.
 */
export function digLater(path: string, log: (m: string) => void = () => {}): void {
  if (scheduled.has(path)) return;
  const timer = setTimeout(() => {
    scheduled.delete(path);
    void digIfThere(path, log);
  }, DIG_DELAY_MS);
  timer.unref?.();
  scheduled.set(path, { timer, log });
}

/** Runs every scheduled dig now and waits for them (the benchmark, before it reads file sizes). */
export async function digScheduledNow(): Promise<void> {
  const due = [...scheduled.entries()];
  scheduled.clear();
  for (const [, s] of due) clearTimeout(s.timer);
  await Promise.all(due.map(([path, s]) => digIfThere(path, s.log)));
}

async function digIfThere(path: string, log: (m: string) => void): Promise<void> {
  // A file freed meanwhile (its last VM ended) has nothing to dig.
  if (
    await stat(path).then(
      () => true,
      () => false,
    )
  )
    await digZeroHoles(path, log);
}
