/**
 * Undoing a fork whose copy of the parent failed: the parent runs on (on its new overlay if
 * QEMU took it), or, when its QEMU is gone or wedged, it is ended.
 */

import { rm } from "node:fs/promises";
import { bestEffort } from "../../../contracts/best-effort.ts";
import { fail, type Result, SnapshotError } from "../errors.ts";
import { qmp, setCapabilities } from "../migrate.ts";
import { blockedInUserfault } from "../populate.ts";
import { adoptNewTop } from "./chain.ts";
import type { ForkRun } from "./copy.ts";

/** Rolls back `run` after its copy failed with `e`; the result is always that failure. */
export async function rollBackFork(run: ForkRun, e: SnapshotError): Promise<Result<never>> {
  const { parent, proc, forkId, newTop, newNode, staged, log } = run;
  /** The new overlay, never registered, goes with its staging link. */
  const dropNewTop = () => Promise.all([rm(staged, { force: true }), rm(newTop, { force: true })]);
  /**
   * For a parent that runs on (the only caller): the new overlay joins its chain if QEMU took it.
   * A parent that is ended never adopts it (dropNewTop): its QEMU's exit may already have
   * released the parent's files, and an overlay registered after that would outlive the VM.
   */
  const keepOrDropNewTop = async () => {
    if (run.switched)
      await bestEffort(
        log,
        `fork ${forkId}: keeping the parent's new overlay`,
        adoptNewTop(parent, newTop, newNode),
      );
    else await dropNewTop();
  };
  await run.save?.abort();
  await rm(run.statePath, { force: true });
  await rm(run.memPath, { force: true });
  if (proc.isAlive()) {
    /**
     * The first step that found QEMU gone or wedged (`qmp` kills a QEMU that misses its deadline):
     * the reason the parent is ended, if it is. Other failures are logged and the rollback goes on.
     */
    let ended: SnapshotError | undefined;
    const step = (what: string, act: () => Promise<unknown>) =>
      bestEffort(log, `fork ${forkId}: ${what}`, async () => {
        try {
          await act();
        } catch (err) {
          if (err instanceof SnapshotError && (err.code === "vm_died" || err.code === "vm_unresponsive"))
            ended ??= err;
          throw err;
        }
      });
    await step("migrate_cancel", () => qmp(proc, "migrate_cancel"));
    // A cancelled background snapshot may still be ending (its thread resumes the guest as it
    // unwinds); wait for it so the capability can be cleared and `cont` is not refused.
    await waitMigrationIdle(proc);
    await step("resuming the parent", () => qmp(proc, "cont"));
    await step("clearing background-snapshot", () => setCapabilities(proc, { "background-snapshot": false }));
    // A background snapshot that failed on QEMU's side (cancelled, a QEMU error) can leave a
    // vCPU blocked for good in a write fault (QEMU 7.2): the parent would look running and
    // never answer. It is ended instead, and the error says why; its record follows its exit.
    if (run.method === "snapshot" && run.switched && (await blockedInUserfault(proc.pid))) {
      log(`fork ${forkId}: the parent's vCPU stays blocked in a userfaultfd fault; ending the parent`);
      await parent.destroy();
      await dropNewTop();
      return fail(
        new SnapshotError(
          "vm_died",
          `forking VM ${parent.id} failed (${e.message}) and left its guest blocked in a memory write fault; the VM was ended`,
          { cause: e },
        ),
      );
    }
    // QEMU can die while the cancel unwinds (a wedged one is killed by a QMP timeout, or it
    // exits on its own): its record already says dead, and the error says the VM is gone.
    if (parent.state === "dead" || !proc.isAlive()) {
      await parent.destroy();
      await dropNewTop();
      return fail(parentEnded(parent.id, e, ended));
    }
    await keepOrDropNewTop();
    parent.enter("running");
    return fail(e);
  }
  // QEMU is gone (killed at a QMP deadline, or died): its new overlay goes with it too.
  await dropNewTop();
  await parent.destroy();
  return fail(parentEnded(parent.id, e));
}

/**
 * The fork's failure `e` when the parent's QEMU is gone too: a caller branching on the code must
 * learn that the VM went, not only that a migration failed (it would retry the fork on a dead VM).
 * An error that already says so (vm_died, vm_unresponsive) is kept; else the rollback step that
 * found QEMU gone or killed it (`ended`) gives the code, or vm_died when QEMU simply exited.
 */
function parentEnded(parentId: string, e: SnapshotError, ended?: SnapshotError): SnapshotError {
  if (e.code === "vm_died" || e.code === "vm_unresponsive") return e;
  const why = ended ? `, then ${ended.message}` : " and its QEMU exited meanwhile";
  return new SnapshotError(
    ended?.code ?? "vm_died",
    `forking VM ${parentId} failed (${e.message})${why}; the VM was ended`,
    {
      cause: e,
    },
  );
}

/** Cancelled migration's end: query-migrate polls, 5 ms apart (a cancel ends in a few ms). */
const CANCEL_POLLS = 400;

/** Waits (bounded, ~2 s) until no migration is running on `proc`; errors are left to the caller. */
async function waitMigrationIdle(proc: Parameters<typeof qmp>[0]): Promise<void> {
  for (let i = 0; i < CANCEL_POLLS; i++) {
    // A failed poll ends the wait like an idle answer: the caller's next command reports QEMU's state.
    const info = await proc.qmp.execute<{ status?: string }>("query-migrate").catch(() => undefined);
    const st = info?.status;
    if (!st || st === "completed" || st === "failed" || st === "cancelled" || st === "none") return;
    await Bun.sleep(5);
  }
}
