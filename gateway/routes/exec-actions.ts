/**
 * Exec requests of both APIs as the typed action the agent runs (`ExecAction`): which
 * program, which files, what deadline. Pure: no db, no agent, so a handler's parse step ends here.
 */

import type { ExecAction, RunAction } from "../../contracts/agent/api.ts";
import type * as B from "../../contracts/api/sandboxes-api.ts";
import type * as A from "../../contracts/api/sessions-api.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import type { Deps } from "../deps.ts";

/** `timeout_seconds` (default from the limits) in ms; over the maximum is 400. */
export function timeoutMs(deps: Deps, seconds: number | undefined): number {
  const s = seconds ?? deps.config.limits.defaultExecTimeoutS;
  const max = deps.config.limits.maxExecTimeoutS;
  if (s > max) throw new SandboxdError("bad_request", `timeout_seconds ${s} is over the maximum of ${max}`);
  return s * 1000;
}

/** A one-shot of the sessions API (`/v1/exec`, each item of `/v1/exec/batch`): code only, no files. */
export function oneShotAction(deps: Deps, req: A.ExecRequestA): ExecAction {
  return {
    files: [],
    run: { kind: "code", code: req.code },
    timeoutMs: timeoutMs(deps, req.timeout_seconds),
  };
}

/**
 * What the exec requests of both APIs share: files, argv `commands`, `timeout_seconds`, and
 * the per-exec options `env`, `cwd`, `user`, `stdin`/`stdin_b64`. The
 * API's own single form (`code` or `command`) wins over `commands`; with neither, nothing runs
 * after the files are written.
 */
function execAction(
  deps: Deps,
  req: A.SessionExecRequest | B.ExecRequestB,
  single: RunAction | undefined,
): ExecAction {
  const action: ExecAction = {
    files: req.files ?? [],
    run: single ?? (req.commands !== undefined ? { kind: "argv", commands: req.commands } : { kind: "none" }),
    timeoutMs: timeoutMs(deps, req.timeout_seconds),
  };
  // The per-exec options: the agent applies them (agent/sandbox/exec.ts planExec).
  if (req.env !== undefined) action.env = req.env;
  if (req.cwd !== undefined) action.cwd = req.cwd;
  if (req.user !== undefined) action.user = req.user;
  if (req.stdin !== undefined) action.stdinB64 = Buffer.from(req.stdin, "utf8").toString("base64");
  else if (req.stdin_b64 !== undefined) action.stdinB64 = req.stdin_b64;
  return action;
}

/** The sessions API `POST /v1/sessions/{id}/exec`: code or argv commands, with files. */
export function sessionExecAction(deps: Deps, req: A.SessionExecRequest): ExecAction {
  return execAction(deps, req, req.code !== undefined ? { kind: "code", code: req.code } : undefined);
}

/** The sandboxes API `POST /v1/sandboxes/{id}/exec`: a shell command or argv commands, files, a seed. */
export function sandboxExecAction(deps: Deps, req: B.ExecRequestB): ExecAction {
  const single: RunAction | undefined =
    req.command !== undefined ? { kind: "shell", command: req.command } : undefined;
  const action = execAction(deps, req, single);
  if (req.seed !== undefined) action.seed = req.seed;
  return action;
}
