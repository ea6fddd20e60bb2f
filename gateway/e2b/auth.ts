/**
 * The E2B control plane's key check and error form (docs/e2b.md "Control plane").
 *
 * Key: `X-API-KEY` as E2B's SDK sends it (or `Authorization: Bearer`), a sandboxd key native or
 * in E2B form (contracts/e2b/ids.ts `nativeKeyOf`), verified as the `/v1` key middleware does
 * (auth/key-cache.ts) and counted against the same per-key rate limit. Only sandboxes API keys:
 * E2B's surface is a sandboxes API.
 *
 * Errors: E2B's body `{code: <HTTP status>, message}`, the status being the one `/v1` answers for
 * the same SandboxdError code (gateway/errors.ts `mapError`, contracts/api/error-status.ts: one
 * table for both surfaces, so the SDK's `handleApiError` sees 401 as AuthenticationError, 429 as
 * RateLimitError, 404 as SandboxNotFoundError where it checks for it). Ids in messages are said as
 * E2B says them (`sbx_abc` as `abc`).
 */
import type { Context, MiddlewareHandler } from "hono";
import { createMiddleware } from "hono/factory";
import { nativeKeyOf } from "../../contracts/e2b/ids.ts";
import { describeError, SandboxdError } from "../../contracts/errors.ts";
import type { LogFn } from "../../contracts/log.ts";
import { currentScope } from "../../contracts/trace.ts";
import type { HonoEnv } from "../deps.ts";
import { mapError } from "../errors.ts";
import type { E2bMountDeps } from "./mount.ts";

/** The header E2B's SDK puts its key in. */
export const E2B_KEY_HEADER = "x-api-key";

/** The key a request presents: `X-API-KEY`, else a Bearer token; undefined when neither. */
function presented(c: Context): string | undefined {
  const x = c.req.header(E2B_KEY_HEADER);
  if (x !== undefined && x !== "") return x.trim();
  const auth = c.req.header("authorization");
  const m = auth !== undefined ? /^Bearer\s+(\S+)\s*$/i.exec(auth) : null;
  return m?.[1];
}

/** Sets `principal` for the core functions; refuses as E2B does (401), or 403 for a sessions API key. */
export function e2bKey(m: E2bMountDeps): MiddlewareHandler<HonoEnv> {
  return createMiddleware<HonoEnv>(async (c, next) => {
    const given = presented(c);
    if (given === undefined) {
      throw new SandboxdError("unauthorized", "missing API key: send X-API-KEY with a sandboxd key");
    }
    const key = nativeKeyOf(given);
    const principal = key !== undefined ? await m.keys.verify(key) : null;
    if (!principal) throw new SandboxdError("unauthorized", "invalid API key");
    if (principal.api !== "sandboxes") {
      throw new SandboxdError(
        "forbidden",
        `E2B's API needs a sandboxes API key (demo, pro or enterprise); this is a ${principal.tier} key of the sessions API`,
      );
    }
    c.set("principal", principal);
    const scope = currentScope();
    if (scope) scope.tenant = principal.tenantId;
    await m.rateLimit.take(principal.keyId);
    await next();
  });
}

/** `sbx_<x>` said as E2B says it, in a message written with our ids. */
function inE2bTerms(message: string): string {
  return message.replace(/\bsbx_([a-z0-9]+)\b/g, "$1");
}

/** The sub-app's `onError`: any error in E2B's form, with the status `/v1` gives its code. */
export function e2bErrorResponse(err: unknown, c: Context, log: LogFn): Response {
  const mapped = mapError(err);
  const id = mapped.errorId ? ` [${mapped.errorId}]` : "";
  if (mapped.status >= 500) log(`${c.req.method} ${c.req.path}${id}: ${describeError(err)}`);
  return c.json(
    { code: mapped.status, message: inE2bTerms(mapped.body.message) },
    mapped.status,
    mapped.headers,
  );
}

/** Something E2B's API has and sandboxd's E2B surface does not serve: 501 saying so. */
export function notServed(what: string, instead?: string): SandboxdError {
  return new SandboxdError(
    "not_implemented",
    `${what} is not served by sandboxd's E2B API${instead !== undefined ? `; ${instead}` : ""} (docs/e2b.md "Control plane")`,
  );
}

/** A request field sandboxd cannot honour: 400 saying which and why, nothing done. */
export function unsupportedField(field: string, why: string): SandboxdError {
  return new SandboxdError("bad_request", `${field} is not supported by sandboxd: ${why}`);
}
