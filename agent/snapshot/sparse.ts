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
