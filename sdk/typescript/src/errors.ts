/**
 * The one error every SDK call throws for a failure the service (or the wire) reported: the
 * service's stable `code` (branch on it, never on `message`), the HTTP `status` (0 when no HTTP
 * answer came: a refused connection, a timeout, a stream cut off), and `retryAfterSeconds` when the
 * service said when to come back (`Retry-After`).
 */
import type { PublicErrorCode } from "../../../contracts/errors.ts";

/** The service's public codes (contracts/errors.ts), plus the SDK's own for failures on the wire. */
export type ErrorCode = (typeof PublicErrorCode)[number] | ClientErrorCode;

/**
 * Failures no service answer describes: `network` (no HTTP answer: refused, reset, DNS),
 * `timeout` (the SDK's own deadline passed), `protocol` (an answer the SDK cannot read: not the
 * JSON or event stream the contract promises), `aborted` (the caller's signal), `template_failed`
 * (a bake or build the SDK waited on ended Failed; the message has the service's reason).
 */
export type ClientErrorCode = "network" | "timeout" | "protocol" | "aborted" | "template_failed";

export interface SandboxdErrorInit {
  code: ErrorCode | string;
  status: number;
  message: string;
  retryAfterSeconds?: number | undefined;
  /** Machine-readable facts, for the codes that document them (`size_unavailable`: `sizes`). */
  details?: Record<string, unknown> | undefined;
  cause?: unknown;
}

export class SandboxdError extends Error {
  override readonly name = "SandboxdError";
  /** The service's code (`not_found`, `busy`, `rate_limited`, ...) or the SDK's (`network`, ...). */
  readonly code: ErrorCode | string;
  /** HTTP status of the answer; 0 when there was none. */
  readonly status: number;
  /** Seconds the service asked the client to wait before trying again, when it said. */
  readonly retryAfterSeconds: number | undefined;
  /** The answer's `details`, for the codes that document them (`size_unavailable`: `sizes`). */
  readonly details: Record<string, unknown> | undefined;

  constructor(init: SandboxdErrorInit) {
    super(init.message, init.cause === undefined ? undefined : { cause: init.cause });
    this.code = init.code;
    this.status = init.status;
    this.retryAfterSeconds = init.retryAfterSeconds;
    this.details = init.details;
  }
}

/**
 * `Retry-After` as seconds: a delay in seconds, or an HTTP date (RFC 9110 10.2.3) converted to the
 * seconds from `now`; undefined when absent or unreadable.
 */
export function parseRetryAfter(value: string | null, now = Date.now()): number | undefined {
  if (value === null || value.trim() === "") return undefined;
  const v = value.trim();
  if (/^\d+$/.test(v)) return Number(v);
  const at = Date.parse(v);
  if (Number.isNaN(at)) return undefined;
  return Math.max(0, Math.ceil((at - now) / 1000));
}

/**
 * The error for a non-2xx answer: the service's `{code, message}` envelope when the body is one,
 * else a code derived from the status (a proxy's HTML page, an empty body).
 */
export function errorFromAnswer(status: number, headers: Headers, text: string): SandboxdError {
  const retryAfterSeconds = parseRetryAfter(headers.get("retry-after"));
  let body: unknown;
  try {
    body = JSON.parse(text);
  } catch {
    body = undefined;
  }
  const env = body as { code?: unknown; message?: unknown; details?: unknown } | undefined;
  if (env && typeof env.code === "string" && typeof env.message === "string") {
    const details =
      env.details !== null && typeof env.details === "object" && !Array.isArray(env.details)
        ? (env.details as Record<string, unknown>)
        : undefined;
    return new SandboxdError({ code: env.code, status, message: env.message, retryAfterSeconds, details });
  }
  const snippet = text.trim().slice(0, 200);
  return new SandboxdError({
    code: codeOfStatus(status),
    status,
    message: `HTTP ${status}${snippet ? `: ${snippet}` : ""}`,
    retryAfterSeconds,
  });
}

/** The public code a status stands for when the body does not say (gateway/errors.ts's table). */
function codeOfStatus(status: number): ErrorCode {
  const table: Record<number, ErrorCode> = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    409: "conflict",
    410: "gone",
    413: "payload_too_large",
    429: "rate_limited",
    501: "not_implemented",
    503: "agent_unavailable",
    507: "insufficient_storage",
  };
  return table[status] ?? (status >= 500 ? "internal" : "protocol");
}
