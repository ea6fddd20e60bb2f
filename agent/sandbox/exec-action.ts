/**
 * One exec carried out from start to end (manager.ts `exec` serializes and meters it): the VM is
 * woken, the plan made (exec.ts), its files written and its commands run (exec-run.ts) against one
 * deadline, and a failure turned into the error the caller should see — `gone` with the reason
 * when the VM died under it.
 */
import type { ExecResult } from "../../contracts/agent/api.ts";
import { describeError, SandboxdError } from "../../contracts/errors.ts";
import { GuestError } from "../guest/client.ts";
import { type ExecRequest, planExec } from "./exec.ts";
import { type OutputSink, type RunOutcome, resolveExecUser, runOne, writeFiles } from "./exec-run.ts";
import type { Sandbox } from "./manager-types.ts";

/**
 * After the guest connection drops mid-exec, how long to wait for the QEMU exit to be reported
 * before treating the drop as a guest failure: the exit follows the hang-up within milliseconds.
 */
const DEATH_NOTICE_MS = 1_000;

/** What an exec needs of the manager: to wake the VM, and the error for a sandbox gone. */
export interface ExecHost {
  wake(sb: Sandbox): Promise<void>;
  goneError(sb: Sandbox): SandboxdError;
}

/**
 * Carries out one exec: the plan (exec.ts) is made once the VM is awake, then its files are
 * written and its commands run in order against one deadline. An image that cannot run the
 * request (no Entrypoint/Cmd for `code`) is refused before anything is written.
 */
export async function runExec(
  h: ExecHost,
  sb: Sandbox,
  req: ExecRequest,
  signal: AbortSignal,
  sink?: OutputSink,
): Promise<ExecResult> {
  const t0 = performance.now();
  try {
    await h.wake(sb);
    const vm = sb.vm;
    if (!vm) throw h.goneError(sb);
    const user = req.user === undefined ? undefined : await resolveExecUser(vm.guest, req.user);
    const plan = planExec(req, vm.image, user);
    const deadline = t0 + plan.timeoutMs;
    await writeFiles(vm.guest, plan);
    const tExec = performance.now();
    let out: RunOutcome = { stdout: "", stderr: "", exitCode: 0, seedAck: false };
    let ack = false;
    if (plan.entropy) {
      await vm.guest.entropy(plan.entropy);
      ack = true;
    }
    for (const [i, cmd] of plan.commands.entries()) {
      out = await runOne(vm.guest, plan, cmd, deadline, signal, sink);
      // The seed rides on the first command; its ack stands for the whole action.
      if (i === 0) ack = out.seedAck;
      if (out.timedOut) break;
    }
    if (signal.aborted) throw abortedError(sb);
    const end = performance.now();
    const result: ExecResult = {
      stdout: out.stdout,
      stderr: out.stderr,
      exitCode: out.exitCode,
      execTimeMs: end - tExec,
      totalTimeMs: end - t0,
    };
    if (plan.seeded) result.seedAck = ack ? "verified" : "unverified";
    if (out.truncated) result.truncated = true;
    return result;
  } catch (err) {
    throw await execFailure(sb, err, signal);
  }
}

/** Turns a failure during an exec into the error the caller should see. */
async function execFailure(sb: Sandbox, err: unknown, signal: AbortSignal): Promise<unknown> {
  if (err instanceof SandboxdError && !(err instanceof GuestError)) return err;
  if (signal.aborted) return abortedError(sb);
  if (err instanceof GuestError && err.code === "guest_disconnected" && !sb.died) {
    // The hang-up may reach us before QEMU's exit: wait a moment for the real reason. The
    // waiter leaves `onDied` either way: each failed exec on a VM whose channel is gone but
    // whose QEMU lives would otherwise leave one behind.
    await new Promise<void>((resolve) => {
      const onDied = () => {
        clearTimeout(t);
        resolve();
      };
      const t = setTimeout(() => {
        const i = sb.onDied.indexOf(onDied);
        if (i >= 0) sb.onDied.splice(i, 1);
        resolve();
      }, DEATH_NOTICE_MS);
      sb.onDied.push(onDied);
    });
  }
  if (sb.died) {
    return new SandboxdError("gone", `sandbox ${sb.id} failed during the exec: ${sb.died.reason}`, {
      cause: err,
      details: { id: sb.id, reason: sb.died.reason },
    });
  }
  return new SandboxdError("internal", `exec in sandbox ${sb.id} failed: ${describeError(err)}`, {
    cause: err,
  });
}

function abortedError(sb: Sandbox): SandboxdError {
  return new SandboxdError("gone", `sandbox ${sb.id} was destroyed (force) while the exec ran`, {
    details: { id: sb.id },
  });
}
