/**
 * The one place where errors become HTTP. Every handler throws `SandboxdError`
 * (contracts/errors.ts, which draws the whole tree) and this table turns its code into a status
 * and the `{code, message}` envelope (docs/api.md "Rules every route shares"); the agent's own codes are translated to
 * public ones first (PUBLIC_OF_AGENT_CODE). Every other code and foreign errors become 500
 * `internal` and their message is logged, not sent. The public 5xx codes whose message is written
 * from what a host said (a QEMU's stderr in a failed restore, an agent's address in a tunnel that
 * did not open) are sent with a fixed text and an error id; the log line carries the same id and
 * the whole text.
 */
import { randomBytes } from "node:crypto";
import type { Context } from "hono";
import type { ContentfulStatusCode } from "hono/utils/http-status";
import { STATUS_OF_CODE } from "../contracts/api/error-status.ts";
import {
  type AgentErrorCode,
  describeError,
  type ErrorCode,
  type PublicErrorCode,
  SandboxdError,
} from "../contracts/errors.ts";
import { isDbUnavailable } from "../db/unavailable.ts";

/**
 * `Retry-After` of a 503 `db_unavailable`, seconds: a restarting PostgreSQL is back within
 * seconds, and a client retrying every 5 s adds little load to one that is not.
 */
export const DB_RETRY_AFTER_S = 5;

/** The error a call answers while the database cannot be reached. */
export function dbUnavailable(cause: unknown): SandboxdError {
  return new SandboxdError("db_unavailable", "the database is unreachable; retry shortly", {
    cause,
    details: { retryAfterSeconds: DB_RETRY_AFTER_S },
  });
}

function isPublicCode(code: ErrorCode): code is PublicErrorCode {
  return Object.hasOwn(STATUS_OF_CODE, code);
}

export interface MappedError {
  status: ContentfulStatusCode;
  body: { code: PublicErrorCode; message: string; details?: Record<string, unknown> };
  headers: Record<string, string>;
  /** Names the full text in the log when the body's message is a fixed one. */
  errorId?: string;
}

/** Public codes whose message quotes a host: what the client reads instead. */
const FIXED_MESSAGE: Partial<Record<PublicErrorCode, string>> = {
  spawn_failed: "the VM did not start",
  bringup_timeout: "the VM did not answer in time",
  agent_unavailable: "the sandbox's host agent did not answer; retry with backoff",
  // Its message may quote a host path (an ENOSPC from a write) or a VM id.
  insufficient_storage: "the host has no disk space for this; retry once space is freed",
};

/** The agent's codes that are not public ones, each with what it means for a client. */
const PUBLIC_OF_AGENT_CODE: Readonly<Record<Exclude<AgentErrorCode, PublicErrorCode>, PublicErrorCode>> = {
  unsupported: "not_implemented",
};

function isAgentOnlyCode(code: ErrorCode): code is keyof typeof PUBLIC_OF_AGENT_CODE {
  return Object.hasOwn(PUBLIC_OF_AGENT_CODE, code);
}

/** The codes whose `details` go to the client in the envelope (docs/api.md "Rules every route shares"). */
const PUBLIC_DETAILS: ReadonlySet<string> = new Set(["size_unavailable"]);

export function mapError(err: unknown): MappedError {
  if ((!(err instanceof SandboxdError) || err.code === "internal") && isDbUnavailable(err)) {
    err = dbUnavailable(err);
  }
  if (err instanceof SandboxdError && isAgentOnlyCode(err.code)) {
    err = new SandboxdError(PUBLIC_OF_AGENT_CODE[err.code], err.message, {
      cause: err,
      details: err.details,
    });
  }
  if (err instanceof SandboxdError && isPublicCode(err.code) && err.code !== "internal") {
    const headers: Record<string, string> = {};
    const retry = err.details?.retryAfterSeconds;
    if (typeof retry === "number") headers["Retry-After"] = String(Math.max(1, Math.ceil(retry)));
    const fixed = FIXED_MESSAGE[err.code];
    if (fixed) {
      const errorId = `err-${randomBytes(6).toString("hex")}`;
      const message = `${fixed} (error id ${errorId})`;
      return { status: STATUS_OF_CODE[err.code], body: { code: err.code, message }, headers, errorId };
    }
    const body: MappedError["body"] = { code: err.code, message: err.message };
    // Only codes whose details are documented for clients carry them (contracts/api/common.ts
    // ErrorEnvelope); others' details are internal (agent ids, retry hints sent as headers).
    if (PUBLIC_DETAILS.has(err.code) && err.details) body.details = err.details;
    return { status: STATUS_OF_CODE[err.code], body, headers };
  }
  return { status: 500, body: { code: "internal", message: "internal error" }, headers: {} };
}

/** Hono `onError` handler. */
export function errorResponse(err: unknown, c: Context, log: (line: string) => void): Response {
  const mapped = mapError(err);
  const id = mapped.errorId ? ` [${mapped.errorId}]` : "";
  if (mapped.status >= 500) log(`${c.req.method} ${c.req.path}${id}: ${describeError(err)}`);
  return c.json(mapped.body, mapped.status, mapped.headers);
}

/** Shorthands used by handlers. */
export const notFound = (what: string) => new SandboxdError("not_found", `${what} not found`);
export const badRequest = (message: string) => new SandboxdError("bad_request", message);
