/**
 * One error hierarchy for the whole service. Callers branch on `code`, never on message text
 * (style.md habit 3). Public codes are the spec's (section 7); internal codes name the layer
 * that failed and are mapped to public ones in one place (gateway/errors.ts, later issues).
 */
export const PublicErrorCode = [
  "bad_request",
  "unauthorized",
  "forbidden",
  "demo_tier_limit",
  "not_found",
  "gone",
  "busy",
  "template_in_use",
  "template_not_ready",
  "conflict",
  "port_not_exposed",
  "payload_too_large",
  "rate_limited",
  "quota_exceeded",
  "at_capacity",
  "agent_unavailable",
  "not_implemented",
  "spawn_failed",
  "bringup_timeout",
  "internal",
] as const;
export type PublicErrorCode = (typeof PublicErrorCode)[number];

export class SandboxdError extends Error {
  readonly code: string;
  readonly details: Record<string, unknown> | undefined;
  constructor(code: string, message: string, opts?: { cause?: unknown; details?: Record<string, unknown> }) {
    super(message, opts?.cause === undefined ? undefined : { cause: opts.cause });
    this.name = "SandboxdError";
    this.code = code;
    this.details = opts?.details;
  }
}

/** The readable chain of causes, for logs and CLI output. */
export function describeError(err: unknown): string {
  const parts: string[] = [];
  let cur: unknown = err;
  for (let depth = 0; cur !== undefined && cur !== null && depth < 5; depth++) {
    if (cur instanceof Error) {
      const code = (cur as { code?: unknown }).code;
      parts.push(typeof code === "string" ? `${cur.message} [${code}]` : cur.message);
      cur = cur.cause;
    } else {
      parts.push(String(cur));
      break;
    }
  }
  return parts.join(": caused by: ");
}
