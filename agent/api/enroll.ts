/**
 * The agent's side of enrollment (contracts/agent/enroll.ts): with a one-time token it asks the
 * gateway once for its own key and keeps it in `<state dir>/credentials.json` (0600); later
 * starts read that file and need no token. The key signs this agent's heartbeats and checks the
 * gateway's calls to it (agent/api/app.ts), so it is as private as the host itself.
 */
import { chmod, readFile, rename, stat, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { ENROLL_PATH, EnrollResponse } from "../../contracts/agent/enroll.ts";
import type { AgentCredentials } from "../../contracts/agent/token.ts";
import { type ErrorCode, SandboxdError } from "../../contracts/errors.ts";

export const CREDENTIALS_FILE = "credentials.json";

/** How long the gateway may take to answer an enrollment (one small transaction). */
const ENROLL_TIMEOUT_MS = 15_000;

export interface StoredCredentials {
  id: string;
  key: string;
}

export async function readCredentials(stateDir: string): Promise<StoredCredentials | undefined> {
  const path = join(stateDir, CREDENTIALS_FILE);
  let text: string;
  try {
    text = await readFile(path, "utf8");
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === "ENOENT") return undefined;
    throw err;
  }
  // A key others on the host can read speaks for this agent in their hands: refuse to use it.
  if (((await stat(path)).mode & 0o077) !== 0) {
    throw new SandboxdError("forbidden", `${path} is readable by other users; chmod 600 it`);
  }
  const r = EnrollResponse.safeParse(JSON.parse(text));
  if (!r.success) throw new SandboxdError("internal", `${path} is not an agent credentials file`);
  return r.data;
}

async function writeCredentials(stateDir: string, c: StoredCredentials): Promise<void> {
  const path = join(stateDir, CREDENTIALS_FILE);
  const tmp = `${path}.${process.pid}.tmp`;
  await writeFile(tmp, `${JSON.stringify(c)}\n`, { mode: 0o600 });
  await chmod(tmp, 0o600); // the mode above is masked by the umask
  await rename(tmp, path);
}

const CODE_OF_STATUS: Record<number, ErrorCode> = {
  400: "bad_request",
  401: "unauthorized",
  403: "forbidden",
  409: "conflict",
};

/** Redeems `token` at the gateway for agent `id`; returns (and stores) the new credentials. */
export async function enroll(opts: {
  gatewayUrl: string;
  token: string;
  id: string;
  stateDir: string;
}): Promise<AgentCredentials> {
  const url = `${opts.gatewayUrl.replace(/\/+$/, "")}${ENROLL_PATH}`;
  let res: Response;
  try {
    res = await fetch(url, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ token: opts.token, id: opts.id }),
      signal: AbortSignal.timeout(ENROLL_TIMEOUT_MS),
    });
  } catch (err) {
    throw new SandboxdError("internal", `cannot reach the gateway at ${url} to enroll`, { cause: err });
  }
  const text = await res.text();
  if (!res.ok) {
    let message = text;
    try {
      message = (JSON.parse(text) as { message?: string }).message ?? text;
    } catch {
      // not JSON: the text as it came
    }
    throw new SandboxdError(CODE_OF_STATUS[res.status] ?? "internal", `enrollment refused: ${message}`);
  }
  const got = EnrollResponse.safeParse(JSON.parse(text));
  if (!got.success || got.data.id !== opts.id) {
    throw new SandboxdError("internal", "the gateway answered the enrollment with an unexpected body");
  }
  await writeCredentials(opts.stateDir, got.data);
  return got.data;
}

/**
 * This agent's credentials: enrolls when `token` is given (replacing what was stored), else the
 * stored ones, else enrolls with `firstStartToken` (SANDBOXD_ENROLL_TOKEN: the same token in every
 * pod of a DaemonSet, redeemed by a host once and ignored on its restarts). `id` is the id wanted;
 * a stored id that differs is an error, not a silent rename.
 */
export async function loadOrEnroll(opts: {
  gatewayUrl: string;
  stateDir: string;
  token?: string;
  /** Redeemed only when nothing is stored. */
  firstStartToken?: string;
  /** The id asked for (`--id`); the stored one when absent. */
  id?: string;
  /** Used for a first enrollment without `id`. */
  defaultId: string;
}): Promise<AgentCredentials> {
  const stored = await readCredentials(opts.stateDir);
  const token = opts.token ?? (stored ? undefined : opts.firstStartToken);
  if (token !== undefined) {
    const id = opts.id ?? stored?.id ?? opts.defaultId;
    return enroll({ gatewayUrl: opts.gatewayUrl, token, id, stateDir: opts.stateDir });
  }
  if (!stored) {
    throw new SandboxdError(
      "unauthorized",
      "this agent is not enrolled: start it once with --enroll TOKEN or SANDBOXD_ENROLL_TOKEN (made on the gateway by `sandboxd agent-token create`)",
    );
  }
  if (opts.id !== undefined && opts.id !== stored.id) {
    throw new SandboxdError(
      "bad_request",
      `this data dir is enrolled as agent ${stored.id}, not ${opts.id}; enroll again with --enroll TOKEN to change it`,
    );
  }
  return stored;
}
