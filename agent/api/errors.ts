/**
 * The one place where the agent's errors become HTTP. The codes of its wire (`AgentErrorCode`,
 * contracts/errors.ts) keep their code and get their status here; the layers' own codes
 * (`InternalErrorCode`: guest_*, qmp_*, vm_launch_failed, image_*, ...) are failures of this agent
 * and become `internal` with the readable chain as message: this API is internal, and the gateway
 * never forwards the message of an `internal` to its clients (gateway/errors.ts).
 */
import type { ContentfulStatusCode } from "hono/utils/http-status";
import type { ErrorBody } from "../../contracts/agent/schemas.ts";
import { type AgentErrorCode, describeError, type ErrorCode, SandboxdError } from "../../contracts/errors.ts";

export const AGENT_STATUS_OF_CODE: Readonly<Record<AgentErrorCode, ContentfulStatusCode>> = {
  bad_request: 400,
  unauthorized: 401,
  not_found: 404,
  gone: 410,
  busy: 409,
  conflict: 409,
  template_in_use: 409,
  template_not_ready: 409,
  port_not_exposed: 409,
  port_unreachable: 502,
  invalid_file: 400,
  payload_too_large: 413,
  unsupported: 501,
  at_capacity: 503,
  insufficient_storage: 507,
  spawn_failed: 503,
  bringup_timeout: 504,
  internal: 500,
};

function onTheWire(code: ErrorCode): code is AgentErrorCode {
  return Object.hasOwn(AGENT_STATUS_OF_CODE, code);
}

/**
 * The status, body and headers of an error answer. A `retryAfterSeconds` in the error's details
 * (at_capacity says when a slot may be free) goes out as `Retry-After`, which the gateway's client
 * reads back (contracts/agent/schemas.ts errorFromAgentAnswer) so the public answer carries it too.
 */
export function mapAgentError(err: unknown): {
  status: ContentfulStatusCode;
  body: ErrorBody;
  headers: Record<string, string>;
} {
  if (err instanceof SandboxdError && onTheWire(err.code)) {
    const headers: Record<string, string> = {};
    const retry = err.details?.retryAfterSeconds;
    if (typeof retry === "number") headers["Retry-After"] = String(Math.max(1, Math.ceil(retry)));
    return {
      status: AGENT_STATUS_OF_CODE[err.code],
      body: { code: err.code, message: err.message },
      headers,
    };
  }
  return { status: 500, body: { code: "internal", message: describeError(err) }, headers: {} };
}
