/**
 * The API-key middleware (docs/keys-and-auth.md "Rules of authentication"): `Authorization: Bearer <key>` resolved to the key's principal
 * (tenant, key id, tier, API), which handlers read with `c.get("principal")`. A missing or
 * malformed header and a key that does not verify (unknown, wrong secret, revoked, another tier)
 * are both 401 `unauthorized`, thrown so that the one error mapping (gateway/errors.ts) answers;
 * the message tells the two apart but never says why a key was refused.
 *
 * A WebSocket upgrade without `Authorization` may carry the key as a subprotocol instead
 * (`WS_PROTOCOL`, then `WS_KEY_PROTOCOL_PREFIX + key`): browsers cannot set headers on a
 * WebSocket. The marker must come first because every runtime adapter answers with the first
 * offered protocol (Bun's `server.upgrade`, the `ws` package's default), so the 101 answer names
 * the marker and never the key.
 */

import { createMiddleware } from "hono/factory";
import { presentedKey } from "../../contracts/api/api-key.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { currentScope } from "../../contracts/trace.ts";
import type { HonoEnv } from "../deps.ts";
import type { VerifiedKeys } from "./key-cache.ts";

/** Keys resolve through `keys` (auth/key-cache.ts): a verified key skips its row for a second. */
export function bearerKey(keys: VerifiedKeys) {
  return createMiddleware<HonoEnv>(async (c, next) => {
    const key = presentedKey((name) => c.req.header(name));
    if (key === undefined)
      throw new SandboxdError("unauthorized", "missing API key: send Authorization: Bearer <key>");
    const principal = await keys.verify(key);
    if (!principal) throw new SandboxdError("unauthorized", "invalid API key");
    c.set("principal", principal);
    // The request's log lines from here on name its tenant (contracts/trace.ts).
    const scope = currentScope();
    if (scope) scope.tenant = principal.tenantId;
    await next();
  });
}
