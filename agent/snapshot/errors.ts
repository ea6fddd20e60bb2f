import { isNoSpace } from "../../contracts/disk-space.ts";
import { SandboxdError, type SnapshotOwnErrorCode } from "../../contracts/errors.ts";

/**
 * The snapshot engine's errors: callers branch on `code`, never on text (the tree: contracts/errors.ts).
 *
 * | code                   | meaning                                                            |
 * |------------------------|--------------------------------------------------------------------|
 * | `template_build_failed`| the template VM did not come up, or saving it failed               |
 * | `template_ready_failed`| the ready command exited non-zero or timed out (details: output)   |
 * | `template_not_found`   | no such template in the data dir                                   |
 * | `template_not_ready`   | the template exists but is building or failed                      |
 * | `spawn_failed`         | a restore (spawn, fork child, resume) did not produce a VM         |
 * | `bringup_timeout`      | the restored guest did not answer in time                          |
 * | `fork_failed`          | the parent could not be forked (it keeps running when it can)      |
 * | `suspend_failed`       | saving the VM failed (the VM keeps running when it can)            |
 * | `invalid_state`        | the operation is not allowed in the VM's current state (409)        |
 * | `vm_died`              | QEMU exited under us (killed, crashed); the VM is gone             |
 * | `vm_unresponsive`      | QMP did not answer in time; the VM was killed                       |
 * | `migration_failed`     | QEMU reported a failed migration (save or restore)                  |
 * | `bad_request`          | invalid arguments (counts, ids, sizes)                              |
 * | `vm_record_invalid`    | a VM's saved record is torn, foreign or of another version          |
 * | `insufficient_storage` | the disk lacks room for a state file or template (nothing written)  |
 * | `template_incompatible`| a copied template was frozen under another kernel, accel or QEMU     |
 */
export type SnapshotErrorCode =
  | SnapshotOwnErrorCode
  | "template_not_ready"
  | "spawn_failed"
  | "bringup_timeout"
  | "bad_request"
  | "insufficient_storage";

export class SnapshotError extends SandboxdError {
  declare readonly code: SnapshotErrorCode;
  constructor(
    code: SnapshotErrorCode,
    message: string,
    opts?: { cause?: unknown; details?: Record<string, unknown> },
  ) {
    super(code, message, opts);
    this.name = "SnapshotError";
  }
}

/**
 * Every public operation of the engine answers a Result: failures are values, never throws (the
 * rule, and why this layer alone returns them: contracts/errors.ts, "Result<T> or throw").
 */
export type Result<T> = { ok: true; value: T } | { ok: false; error: SnapshotError };

export const ok = <T>(value: T): Result<T> => ({ ok: true, value });
export const fail = <T>(error: SnapshotError): Result<T> => ({ ok: false, error });

/**
 * Wraps anything thrown into a SnapshotError of `code` (keeping a SnapshotError as it is). A full
 * disk (ENOSPC, or a free-space check's refusal) is `insufficient_storage` whatever `code` says:
 * the caller may retry once space returns, and the public API answers it as 507.
 */
export function asSnapshotError(err: unknown, code: SnapshotErrorCode, message: string): SnapshotError {
  if (err instanceof SnapshotError) return err;
  const why = err instanceof Error ? err.message : String(err);
  const full = (err instanceof SandboxdError && err.code === "insufficient_storage") || isNoSpace(err);
  return new SnapshotError(full ? "insufficient_storage" : code, `${message}: ${why}`, { cause: err });
}

/** For callers (tests, the CLI) that want the value or a throw. */
export function unwrap<T>(r: Result<T>): T {
  if (!r.ok) throw r.error;
  return r.value;
}
