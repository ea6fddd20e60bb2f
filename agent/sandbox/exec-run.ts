/**
 * Runs one planned command of an exec (exec.ts `planExec` decides what; the manager's loop decides
 * when) in the guest, with what is left of the action's deadline, and shapes its outcome: output
 * capped (`capOutput`), the exit code as a shell reports it (`exitCodeOf`). A streamed exec hands
 * its output to the sink instead, uncapped. Writes the plan's files first (`writeFiles`).
 */
import { fileBytes } from "../../contracts/api/common.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { type GuestClient, GuestError } from "../guest/client.ts";
import { resolveUser } from "../image/config.ts";
import { ImageError } from "../image/errors.ts";
import {
  capOutput,
  type ExecPlan,
  type ExecUser,
  exitCodeOf,
  type PlannedCommand,
  TIMEOUT_EXIT_CODE,
} from "./exec.ts";

export interface RunOutcome {
  stdout: string;
  stderr: string;
  exitCode: number;
  seedAck: boolean;
  timedOut?: boolean;
  /** stdout+stderr were cut at EXEC_OUTPUT_MAX (capOutput). */
  truncated?: boolean;
}

/**
 * Where a streamed exec's output goes, chunk by chunk, as the guest sends it. `write` answers
 * false when its consumer is behind: the guest's frames are then not read (`pauseReading`) until
 * `drained` resolves, which is the back-pressure from the HTTP client to the guest's process.
 */
export interface OutputSink {
  write(stream: "stdout" | "stderr", chunk: Buffer): boolean;
  drained(): Promise<void>;
  /** The guest has started the command (its cwd and user accepted), before any output. */
  started?(): void;
}

/**
 * Stdin larger than this goes to the guest as STDIN frames after the request instead of inside
 * it: the request is one guest frame (1 MiB) that also carries the argv and env.
 */
const INLINE_STDIN_MAX = 64 * 1024;

/** One planned command with what is left of the action's time; none left is a timeout. */
export async function runOne(
  guest: GuestClient,
  plan: ExecPlan,
  cmd: PlannedCommand,
  deadline: number,
  signal: AbortSignal,
  sink?: OutputSink,
): Promise<RunOutcome> {
  const left = Math.floor(deadline - performance.now());
  if (left <= 0)
    return { stdout: "", stderr: "timed out\n", exitCode: TIMEOUT_EXIT_CODE, seedAck: false, timedOut: true };
  const stdin = cmd.stdin;
  const big =
    stdin !== undefined &&
    (typeof stdin === "string" ? Buffer.byteLength(stdin) : stdin.length) > INLINE_STDIN_MAX;
  let r: Awaited<ReturnType<GuestClient["exec"]>>;
  let paused = false;
  const out = (stream: "stdout" | "stderr", b: Buffer) => {
    if (!sink || sink.write(stream, b) || paused) return;
    paused = true;
    guest.pauseReading();
    void sink.drained().then(() => {
      if (!paused) return;
      paused = false;
      guest.resumeReading();
    });
  };
  try {
    r = await guest.exec({
      argv: cmd.argv,
      env: plan.env,
      cwd: plan.cwd,
      uid: plan.uid,
      gid: plan.gid,
      timeoutMs: left,
      ...(stdin !== undefined ? { stdin: big ? oneChunk(stdin) : stdin } : {}),
      ...(cmd.seed !== undefined ? { seed: cmd.seed } : {}),
      ...(sink
        ? {
            onStdout: (b: Buffer) => out("stdout", b),
            onStderr: (b: Buffer) => out("stderr", b),
            collect: false,
            ...(sink.started ? { onStarted: () => sink.started?.() } : {}),
          }
        : {}),
      signal,
    });
  } catch (err) {
    throw cwdError(err, plan.cwd) ?? err;
  } finally {
    // Never leave the channel paused past the command: the next call needs its answers.
    if (paused) {
      paused = false;
      guest.resumeReading();
    }
  }
  if (sink) {
    return { stdout: "", stderr: "", exitCode: exitCodeOf(r), seedAck: r.seedAck, timedOut: r.timedOut };
  }
  const capped = capOutput(r);
  return {
    stdout: capped.stdout.toString("utf8"),
    stderr: capped.stderr.toString("utf8"),
    exitCode: exitCodeOf(r),
    seedAck: r.seedAck,
    timedOut: r.timedOut,
    truncated: capped.truncated,
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

async function* oneChunk(b: string | Uint8Array): AsyncIterable<Uint8Array | string> {
  yield b;
}

/**
 * The guest refuses an exec whose working directory is missing or not a directory before anything
 * runs (guest/exec.c): that is the request's fault, a 400 naming the path.
 */
export function cwdError(err: unknown, cwd: string): SandboxdError | undefined {
  if (!(err instanceof GuestError) || err.code !== "guest_error" || !err.message.startsWith("exec: cwd"))
    return undefined;
  return new SandboxdError(
    "bad_request",
    `cwd ${JSON.stringify(cwd)} cannot be used in the sandbox: ${err.message}`,
    {
      details: { cwd },
    },
  );
}

/**
 * The uid, gid and home of a request's `user`, from the guest's own /etc/passwd and /etc/group
 * as they are now (a user an earlier exec added counts), with the image's rules (`resolveUser`):
 * a name must exist, a decimal uid need not. An unknown name is the request's fault (400).
 */
export async function resolveExecUser(guest: GuestClient, spec: string): Promise<ExecUser> {
  const read = async (path: string) => {
    try {
      return (await guest.readFile(path, { maxBytes: PASSWD_MAX_BYTES })).data.toString("utf8");
    } catch (err) {
      if (err instanceof GuestError && err.code === "guest_error") return ""; // no such file: no names
      throw err;
    }
  };
  try {
    return resolveUser(spec, await read("/etc/passwd"), await read("/etc/group"));
  } catch (err) {
    if (err instanceof ImageError && err.code === "image_user_unknown") {
      throw new SandboxdError(
        "bad_request",
        `user ${JSON.stringify(spec)}: no such user in the sandbox's /etc/passwd`,
        {
          details: { user: spec },
        },
      );
    }
    throw err;
  }
}

/** /etc/passwd and /etc/group are read up to 1 MiB each: tens of thousands of entries. */
const PASSWD_MAX_BYTES = 1024 * 1024;
