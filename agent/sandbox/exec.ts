/**
 * What an exec does, decided before anything touches the guest. After Firecracker's
 * `parse_put_snapshot_create` -> `VmmAction`: the request becomes a value first, then one loop
 * carries it out. `planExec` is pure: from the caller's request and the image's config it decides
 * each command's argv and stdin, the environment, working directory and user, the time budget,
 * and how the seed reaches the guest. The manager's `runExec` (manager.ts) writes the files and
 * runs the commands in order; `exitCodeOf` reads the guest's answer the way a shell would.
 *
 * The rules (docs/sessions.md "Rules of the sessions API"; docs/sandboxes.md "Rules of the sandboxes API"; docs/limits.md "Public API limits"):
 * - sessions API `code` goes on stdin to the image's own Entrypoint+Cmd (e.g. `python3`, `sh`), as
 *   Docker would start the image; an image with neither is refused (`image_no_command`).
 * - sandboxes API `command` is one line for `/bin/sh -c`; `commands` are argv arrays run in order
 *   without a shell, each seeing what the earlier ones left; the result is the last one's, and a
 *   command that runs out of time ends the action.
 * - Every file and command runs in the image's WorkingDir (else `/`) as the image's User, unless
 *   the request names its own `cwd` or `user` (looked up in the guest's /etc/passwd first).
 * - The environment is the image's Env, then the egress proxy (EGRESS_PROXY_ENV), then the
 *   request's own `env`; a later name wins.
 * - One budget for the whole action, 30 s unless the request says (the agent API bounds it).
 * - The seed is hex when it looks like hex, else UTF-8; it is mixed in by the first command, or
 *   alone into the entropy pool when nothing runs.
 */

import type { ExecAction, FileWriteAction } from "../../contracts/agent/api.ts";
import { EGRESS_PORT, EXEC_OUTPUT_MAX } from "../../contracts/guest-protocol.ts";
import { type ImageConfig, resolveCommand } from "../image/import.ts";

/** docs/limits.md "Public API limits": the default per-exec timeout is 30 seconds. */
export const DEFAULT_EXEC_TIMEOUT_MS = 30_000;
/** The guest's exit status for a command killed by its timeout, as GNU `timeout` reports it. */
export const TIMEOUT_EXIT_CODE = 124;

/** What a caller may ask of exec: the gateway's action plus extra env, timeout defaulted here. */
export interface ExecRequest extends Omit<ExecAction, "timeoutMs"> {
  timeoutMs?: number;
  /** Added to (and overriding) the image's Env. */
  env?: Record<string, string>;
}

/** What of an image decides how its programs run. */
export type ExecImage = Pick<ImageConfig, "env" | "workingDir" | "user" | "entrypoint" | "cmd">;

export interface PlannedCommand {
  argv: string[];
  stdin?: string | Uint8Array;
  /** The seed's bytes, on the first command only: the guest mixes it in once per action. */
  seed?: Uint8Array;
}

export interface ExecPlan {
  /** The whole action's budget, ms from its start; each command gets what is left of it. */
  timeoutMs: number;
  /** Working directory of every file write and command. */
  cwd: string;
  uid: number;
  gid: number;
  /** `NAME=value` entries, the whole environment of every command. */
  env: string[];
  /** Written (created or overwritten), in order, before anything runs. */
  files: FileWriteAction[];
  /** Run in order until one times out; the result is the last one run. Empty: nothing runs. */
  commands: PlannedCommand[];
  /** Nothing runs but a seed was given: these bytes go alone to the guest's entropy pool. */
  entropy?: Uint8Array;
  /** Whether the request carried a seed: the result then says whether the guest took it. */
  seeded: boolean;
}

/** The request's `user` as found in the guest's /etc/passwd (exec-run.ts `resolveExecUser`). */
export interface ExecUser {
  uid: number;
  gid: number;
  name: string;
  home: string;
}

export function planExec(req: ExecRequest, image: ExecImage, user?: ExecUser): ExecPlan {
  const seed = req.seed === undefined ? undefined : seedBytes(req.seed);
  // Another user gets its own HOME, USER and LOGNAME (as `su -` would); the request's env still wins.
  const userEnv = user ? { HOME: user.home, USER: user.name, LOGNAME: user.name } : undefined;
  const plan: ExecPlan = {
    timeoutMs: req.timeoutMs ?? DEFAULT_EXEC_TIMEOUT_MS,
    cwd: req.cwd ?? (image.workingDir || "/"),
    uid: user?.uid ?? image.user.uid,
    gid: user?.gid ?? image.user.gid,
    env: mergeEnv(mergeEnv(mergeEnv(image.env, EGRESS_PROXY_ENV), userEnv), req.env),
    files: req.files,
    commands: [],
    seeded: seed !== undefined,
  };
  const run = req.run;
  switch (run.kind) {
    case "none":
      if (seed) plan.entropy = seed;
      break;
    case "shell":
      plan.commands = [{ argv: ["/bin/sh", "-c", run.command] }];
      break;
    case "code":
      plan.commands = [{ argv: resolveCommand(image), stdin: run.code }];
      break;
    case "argv":
      plan.commands = run.commands.map((argv) => ({ argv }));
      break;
  }
  const first = plan.commands[0];
  if (first && seed) first.seed = seed;
  // The request's stdin goes to the first command (`code` already is its command's stdin: the
  // gateway refuses both together).
  if (first && req.stdinB64 !== undefined && first.stdin === undefined)
    first.stdin = Buffer.from(req.stdinB64, "base64");
  return plan;
}

/**
 * An exec's output as the API returns it: stdout+stderr together at most `EXEC_OUTPUT_MAX` bytes.
 * The guest already clamps its captures so (the smaller stream keeps up to half, the larger the
 * rest) and flags the cut; the same rule applied here bounds what a guest that ignores it can
 * make the host hold and encode. `truncated` is true when either side cut anything.
 */
export function capOutput(
  r: { stdout: Buffer; stderr: Buffer; stdoutTruncated: boolean; stderrTruncated: boolean },
  max = EXEC_OUTPUT_MAX,
): { stdout: Buffer; stderr: Buffer; truncated: boolean } {
  let o = r.stdout.length;
  let e = r.stderr.length;
  if (o + e > max) {
    const half = Math.floor(max / 2);
    if (o <= half) e = max - o;
    else if (e <= half) o = max - e;
    else [o, e] = [half, max - half];
  }
  return {
    stdout: o < r.stdout.length ? r.stdout.subarray(0, o) : r.stdout,
    stderr: e < r.stderr.length ? r.stderr.subarray(0, e) : r.stderr,
    truncated: r.stdoutTruncated || r.stderrTruncated || o < r.stdout.length || e < r.stderr.length,
  };
}

/** A finished command's exit status: 124 for a timeout, 128+N for a signal (the shell's way). */
export function exitCodeOf(r: { exitCode: number | null; signal: number | null; timedOut: boolean }): number {
  if (r.timedOut) return TIMEOUT_EXIT_CODE;
  return r.exitCode !== null ? r.exitCode : 128 + (r.signal ?? 0);
}

/**
 * Every exec's way out (docs/egress.md "Egress: choices"): the guest agent's proxy port on loopback.
 * Ours win over the image's (there is no other route); the request's own env can still override.
 * Local addresses stay direct: a program talking to a server inside its own VM must not be sent
 * to the host.
 */
const EGRESS_PROXY_URL = `http://127.0.0.1:${EGRESS_PORT}`;
export const EGRESS_PROXY_ENV: Readonly<Record<string, string>> = {
  http_proxy: EGRESS_PROXY_URL,
  https_proxy: EGRESS_PROXY_URL,
  HTTP_PROXY: EGRESS_PROXY_URL,
  HTTPS_PROXY: EGRESS_PROXY_URL,
  ALL_PROXY: EGRESS_PROXY_URL,
  no_proxy: "localhost,127.0.0.1,::1",
  NO_PROXY: "localhost,127.0.0.1,::1",
};

/** The image's Env with `extra` added; a name in both takes the value from `extra`. */
export function mergeEnv(base: string[], extra: Readonly<Record<string, string>> | undefined): string[] {
  if (!extra) return [...base];
  const out = base.filter((kv) => {
    const name = kv.slice(0, Math.max(0, kv.indexOf("=")));
    return !Object.hasOwn(extra, name);
  });
  for (const [k, v] of Object.entries(extra)) out.push(`${k}=${v}`);
  return out;
}

/** The seed's bytes: hex when it is hex (docs/sandboxes.md "Rules of the sandboxes API" "hex-like"), else its UTF-8. */
export function seedBytes(seed: string): Uint8Array {
  if (seed.length > 0 && seed.length % 2 === 0 && /^[0-9a-fA-F]+$/.test(seed))
    return Buffer.from(seed, "hex");
  return Buffer.from(seed, "utf8");
}

/**
 * How a terminal's shell runs (manager `openPty`): as the image's user, or the request's `user`
 * (found in the guest's /etc/passwd, as for exec); in the request's `cwd`, else the image's
 * working directory when it names one (as `docker exec -it` does), else the user's HOME (the
 * guest's choice, as a login does; a directory that does not exist falls back to `/` there);
 * with the image's Env, the egress proxy and TERM, then the request's `env` over them. The guest
 * adds the login variables missing (PATH, HOME, USER, LOGNAME, SHELL) from the user's passwd
 * entry; another user gets its own HOME, USER and LOGNAME as with planExec.
 */
export function planPty(
  image: ExecImage,
  req: { env?: Record<string, string> | undefined; cwd?: string | undefined } = {},
  user?: ExecUser,
): { env: string[]; uid: number; gid: number; cwd?: string } {
  const base = mergeEnv(mergeEnv(image.env, EGRESS_PROXY_ENV), { TERM: "xterm-256color" });
  // Another user gets its own HOME, USER and LOGNAME (as planExec gives them); `env` still wins.
  const userEnv = user ? { HOME: user.home, USER: user.name, LOGNAME: user.name } : undefined;
  const out: { env: string[]; uid: number; gid: number; cwd?: string } = {
    env: mergeEnv(mergeEnv(base, userEnv), req.env),
    uid: user?.uid ?? image.user.uid,
    gid: user?.gid ?? image.user.gid,
  };
  const cwd = req.cwd ?? image.workingDir;
  if (cwd) out.cwd = cwd;
  return out;
}
