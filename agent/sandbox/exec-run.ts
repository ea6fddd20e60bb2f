/**
 * Runs one planned command of an exec (exec.ts `planExec` decides what; the manager's loop decides
 * when) in the guest, with what is left of the action's deadline, and shapes its outcome: output
 * capped (`capOutput`), the exit code as a shell reports it (`exitCodeOf`). Writes the plan's files
 * first (`writeFiles`).
 */
import { fileBytes } from "../../contracts/api/common.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { type GuestClient, GuestError } from "../guest/client.ts";
import { capOutput, type ExecPlan, exitCodeOf, type PlannedCommand, TIMEOUT_EXIT_CODE } from "./exec.ts";

export interface RunOutcome {
  stdout: string;
  stderr: string;
  exitCode: number;
  seedAck: boolean;
  timedOut?: boolean;
  /** stdout+stderr were cut at EXEC_OUTPUT_MAX (capOutput). */
  truncated?: boolean;
}

/** One planned command with what is left of the action's time; none left is a timeout. */
export async function runOne(
  guest: GuestClient,
  plan: ExecPlan,
  cmd: PlannedCommand,
  deadline: number,
  signal: AbortSignal,
): Promise<RunOutcome> {
  const left = Math.floor(deadline - performance.now());
  if (left <= 0)
    return { stdout: "", stderr: "timed out\n", exitCode: TIMEOUT_EXIT_CODE, seedAck: false, timedOut: true };
  const r = await guest.exec({
    argv: cmd.argv,
    env: plan.env,
    cwd: plan.cwd,
    uid: plan.uid,
    gid: plan.gid,
    timeoutMs: left,
    ...(cmd.stdin !== undefined ? { stdin: cmd.stdin } : {}),
    ...(cmd.seed !== undefined ? { seed: cmd.seed } : {}),
    signal,
  });
  const out = capOutput(r);
  return {
    stdout: out.stdout.toString("utf8"),
    stderr: out.stderr.toString("utf8"),
    exitCode: exitCodeOf(r),
    seedAck: r.seedAck,
    timedOut: r.timedOut,
    truncated: out.truncated,
  };
}

/**
 * Writes the plan's files in order, each decoded from its `encoding` and streamed to the guest
 * when it is larger than a frame (GuestClient.writeFile). A file the guest refuses (its errno:
 * a bad path, permission, its disk full, a symlink it will not follow) is `invalid_file` with the
 * guest's reason: the request's fault, not the service's. The files before it stay written; the
 * refused one leaves no partial file behind (the guest writes a temp file and renames it) and
 * nothing after it runs.
 */
export async function writeFiles(guest: GuestClient, plan: ExecPlan): Promise<void> {
  const { cwd, uid, gid } = plan;
  for (const [i, f] of plan.files.entries()) {
    try {
      await guest.writeFile(f.path, fileBytes(f), { cwd, uid, gid });
    } catch (err) {
      if (!(err instanceof GuestError) || err.code !== "guest_error") throw err;
      throw new SandboxdError(
        "invalid_file",
        `files[${i}] (${f.path}) was refused by the sandbox: ${err.message}`,
        {
          cause: err,
          details: { index: i, path: f.path, errno: err.errno },
        },
      );
    }
  }
}
