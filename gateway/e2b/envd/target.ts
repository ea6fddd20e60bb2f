/**
 * What every part of E2B's data plane shares (docs/e2b.md "Data plane"): the target a request
 * resolved to, how a Connect handler reads it, and how errors become the Connect errors the SDK
 * maps to its own.
 */
import {
  Code,
  ConnectError,
  type ContextKey,
  createContextKey,
  type HandlerContext,
} from "@connectrpc/connect";
import type { Principal } from "../../auth/keys.ts";
import type { SandboxRow } from "../../core/sandboxes.ts";
import type { HonoEnv } from "../../deps.ts";
import { mapError } from "../../errors.ts";

/** The sandbox and caller a data-plane request acts for, resolved before any handler runs. */
export interface EnvdTarget {
  principal: Principal;
  /** sandboxd's id (`sbx_...`). */
  sandboxId: string;
  /** The port the request named: envd's (49983) or a guest TCP port. */
  port: number;
  /** The sandbox's record as it was read when the request was authenticated. */
  row: SandboxRow;
  /** The guest user `Authorization: Basic` names; undefined: the image's default user. */
  user?: string;
}

export type EnvdEnv = HonoEnv & { Variables: HonoEnv["Variables"] & { envd: EnvdTarget } };

/** Where `envdRoutes` puts the target for the Connect handlers. */
export const targetKey: ContextKey<EnvdTarget | undefined> = createContextKey<EnvdTarget | undefined>(
  undefined,
  {
    description: "the E2B data-plane target",
  },
);

/** The request's target inside a Connect handler (set by `envdRoutes` for every call). */
export function targetOf(ctx: HandlerContext): EnvdTarget {
  const t = ctx.values.get(targetKey);
  if (!t) throw new ConnectError("no sandbox resolved for this call", Code.Internal);
  return t;
}

/** An unknown, gone or stopped sandbox, answered as E2B's proxy does: 502, which the SDK maps to its timeout / not-running errors. */
export class SandboxUnreachable extends Error {
  constructor(readonly e2bId: string) {
    super(`The sandbox ${e2bId} was not found`);
  }
}

/** SandboxdError codes as Connect codes (what the SDK's `handleRpcError` turns into its errors). */
function connectCodeOf(code: string): Code {
  switch (code) {
    case "unauthorized":
      return Code.Unauthenticated;
    case "forbidden":
    case "demo_tier_limit":
      return Code.PermissionDenied;
    case "not_found":
      return Code.NotFound;
    case "bad_request":
    case "payload_too_large":
    case "invalid_file":
    case "size_unavailable":
      return Code.InvalidArgument;
    case "rate_limited":
    case "quota_exceeded":
      return Code.ResourceExhausted;
    case "busy":
    case "conflict":
    case "port_not_exposed":
    case "template_not_ready":
      return Code.FailedPrecondition;
    case "gone":
    case "agent_unavailable":
    case "db_unavailable":
    case "at_capacity":
    case "port_unreachable":
      return Code.Unavailable;
    case "not_implemented":
      return Code.Unimplemented;
    case "bringup_timeout":
      return Code.DeadlineExceeded;
    default:
      return Code.Internal;
  }
}

/**
 * A server stream the handler ends because `ctx` was aborted: when the client's deadline
 * (`Connect-Timeout-Ms`) passed here first, the stream ends with it (deadline_exceeded, a
 * TimeoutError to E2B's SDK, as envd's Go server ends it), not as a stream that ran out without
 * an end. A client that went away gets nothing either way.
 */
export function endOfAbortedStream(ctx: HandlerContext): void {
  const reason: unknown = ctx.signal.reason;
  if (ctx.signal.aborted && reason instanceof ConnectError) throw reason;
}

/** Any error as the ConnectError the handlers throw (a SandboxdError keeps its public message). */
export function toConnectError(err: unknown): ConnectError {
  if (err instanceof ConnectError) return err;
  if (err instanceof SandboxUnreachable) return new ConnectError(err.message, Code.Unavailable);
  const mapped = mapError(err);
  return new ConnectError(mapped.body.message, connectCodeOf(mapped.body.code));
}

/**
 * An error of a plain HTTP route of the data plane (`/files`, guest ports) as envd answers it:
 * `{code: <status>, message}` with the status `/v1` gives the same error (gateway/errors.ts).
 */
export function envdHttpError(err: unknown): Response {
  const mapped = mapError(err);
  return Response.json(
    { code: mapped.status, message: mapped.body.message },
    { status: mapped.status, headers: mapped.headers },
  );
}
