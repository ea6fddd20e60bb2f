/**
 * QMP building blocks of save / restore: guarded commands (a QMP timeout kills the VM, a dead
 * QEMU is `vm_died`), migration capabilities and waiting for a migration status. Moving the state
 * between QEMU and a file is stream.ts.
 */

import { describeError } from "../../contracts/errors.ts";
import type { VmProcess } from "../qemu/launch.ts";
import { QmpCommandError, QmpDisconnectedError, QmpTimeoutError } from "../qemu/qmp/errors.ts";
import type { QmpEvent } from "../qemu/qmp/framing.ts";
import { SnapshotError } from "./errors.ts";

/**
 * Deadline of one QMP command in the snapshot paths. Every command here answers in milliseconds
 * (QEMU runs them under its big lock; `migrate` only starts a thread); 10 s means a wedged QEMU,
 * which we kill: QEMU runs in-band commands one at a time, so a timed-out command blocks every
 * command behind it and a retry would only queue behind it too.
 */
export const SNAPSHOT_QMP_TIMEOUT_MS = 10_000;

/** How often query-migrate is polled besides the MIGRATION events (a lost event never hangs us). */
const MIGRATION_POLL_MS = 25;

type Vm = Pick<VmProcess, "qmp" | "kill" | "isAlive" | "exited" | "stderrTail" | "pid">;

/** Maps a QMP failure to the engine's error; a timeout or a dead QEMU kills the VM first. */
export async function qmpFailure(vm: Vm, command: string, err: unknown): Promise<SnapshotError> {
  if (err instanceof SnapshotError) return err;
  if (err instanceof QmpTimeoutError) {
    await vm.kill();
    return new SnapshotError("vm_unresponsive", `QEMU did not answer ${command} in time; the VM was killed`, {
      cause: err,
    });
  }
  if (err instanceof QmpDisconnectedError || !vm.isAlive()) {
    // The QMP socket closes a moment before the exit status arrives: wait briefly for it.
    const exit = await Promise.race([vm.exited, Bun.sleep(500).then(() => undefined)]);
    await vm.kill();
    return new SnapshotError(
      "vm_died",
      `QEMU ${exit ? `exited (${exit.signal ?? `code ${exit.code}`})` : "closed QMP"} during ${command}`,
      { cause: err, details: { stderr: vm.stderrTail().slice(-2000) } },
    );
  }
  if (err instanceof QmpCommandError)
    return new SnapshotError("migration_failed", `QMP ${command} failed: ${err.desc}`, { cause: err });
  return new SnapshotError("migration_failed", `QMP ${command} failed: ${String(err)}`, { cause: err });
}

export async function qmp<T = unknown>(
  vm: Vm,
  command: string,
  args?: Record<string, unknown>,
  timeoutMs = SNAPSHOT_QMP_TIMEOUT_MS,
): Promise<T> {
  try {
    return await vm.qmp.execute<T>(command, args, { timeoutMs });
  } catch (err) {
    throw await qmpFailure(vm, command, err);
  }
}

export async function setCapabilities(vm: Vm, caps: Record<string, boolean>): Promise<void> {
  await qmp(vm, "migrate-set-capabilities", {
    capabilities: Object.entries(caps).map(([capability, state]) => ({ capability, state })),
  });
}

/**
 * Migration bandwidth cap where the stream's sink is local (the agent's socket, copied to a file
 * or tmpfs): effectively none, 32 GiB/s. QEMU's default (128 MiB/s in 7.2) paces a network link
 * shared with other traffic; here it only stretches the save: a suspend or a stop-and-copy fork
 * keeps the guest stopped meanwhile, and a live precopy would take seconds.
 */
export const LOCAL_MIGRATION_MAX_BANDWIDTH = 32 * 1024 ** 3;

/**
 * Migration parameters the snapshot paths set before `migrate`. They stay set in that QEMU for
 * its later migrations, so each path sets all it relies on rather than inheriting them.
 */
export interface MigrationParameters {
  /** Bytes per second; LOCAL_MIGRATION_MAX_BANDWIDTH for every save the agent makes. */
  maxBandwidth: number;
  /** Largest switchover stall QEMU plans for (ms); QEMU's own (300 ms) when absent. */
  downtimeLimitMs?: number;
}

export async function setMigrationParameters(vm: Vm, p: MigrationParameters): Promise<void> {
  await qmp(vm, "migrate-set-parameters", {
    "max-bandwidth": p.maxBandwidth,
    ...(p.downtimeLimitMs === undefined ? {} : { "downtime-limit": p.downtimeLimitMs }),
  });
}

export interface MigrateInfo {
  status: string;
  "error-desc"?: string;
  /** `normal` and `duplicate` (zero) count the pages sent, so far. */
  ram?: {
    transferred?: number;
    total?: number;
    normal?: number;
    duplicate?: number;
    "dirty-pages-rate"?: number;
  };
  "total-time"?: number;
  downtime?: number;
}

/**
 * Waits until the migration reaches one of `until` (e.g. "completed", "pre-switchover"). A
 * "failed"/"cancelled" status is `migration_failed` with QEMU's reason; past `timeoutMs` the
 * migration is cancelled and the wait fails (the caller decides whether the VM survives).
 */
export async function waitMigration(vm: Vm, until: string[], timeoutMs: number): Promise<MigrateInfo> {
  const deadline = performance.now() + timeoutMs;
  let wake: (() => void) | undefined;
  const off = vm.qmp.on("MIGRATION", (ev: QmpEvent) => {
    const s = (ev.data as { status?: string } | undefined)?.status;
    if (s && (until.includes(s) || s === "failed" || s === "cancelled")) wake?.();
  });
  try {
    for (;;) {
      const info = await qmp<MigrateInfo>(vm, "query-migrate");
      if (until.includes(info.status)) return info;
      if (info.status === "failed" || info.status === "cancelled")
        throw new SnapshotError(
          "migration_failed",
          `migration ${info.status}: ${info["error-desc"] ?? "no reason given"}`,
          {
            details: { info },
          },
        );
      if (performance.now() > deadline) {
        // A cancel that fails too is said in the error, next to the timeout it follows.
        const cancelFailed = await vm.qmp.execute("migrate_cancel", undefined, { timeoutMs: 1000 }).then(
          () => undefined,
          (err: unknown) => describeError(err),
        );
        throw new SnapshotError(
          "migration_failed",
          `migration did not reach ${until.join("/")} within ${timeoutMs} ms (status ${info.status})`,
          cancelFailed === undefined ? undefined : { details: { cancelFailed } },
        );
      }
      await new Promise<void>((resolve) => {
        const t = setTimeout(resolve, MIGRATION_POLL_MS);
        wake = () => {
          clearTimeout(t);
          resolve();
        };
      });
      wake = undefined;
    }
  } finally {
    off();
  }
}

/** QEMU event timestamps ({seconds, microseconds}) in ms. */
export function eventTimeMs(ev: QmpEvent): number {
  return ev.timestamp.seconds * 1000 + ev.timestamp.microseconds / 1000;
}
