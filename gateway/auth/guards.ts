/** Tier and API checks (docs/keys-and-auth.md "Rules of authentication"). */

import type { MiddlewareHandler } from "hono";
import { type KeyApi, type Tier, tierAtLeast } from "../../contracts/api/tiers.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import type { HonoEnv } from "../deps.ts";
import type { Principal } from "./keys.ts";

const KEYS_OF_API: Record<KeyApi, string> = {
  sessions: "a live or scale key",
  sandboxes: "a demo, pro or enterprise key",
};

export function requireApi(p: Principal, api: KeyApi): void {
  if (p.api !== api) {
    throw new SandboxdError("forbidden", `this endpoint needs ${KEYS_OF_API[api]}; this is a ${p.tier} key`);
  }
}

/**
 * `requireApi` as a route's first middleware, after the key middleware has set the principal. It
 * is given to each route of a sub-app rather than to `use("*")`, so that a path or method no route
 * serves stays a 404 for every key.
 */
export function requireApiMw(api: KeyApi): MiddlewareHandler<HonoEnv> {
  return async (c, next) => {
    requireApi(c.get("principal"), api);
    await next();
  };
}

/** Template admin in the sessions API needs `scale`: 403 `forbidden`. */
export function requireScale(p: Principal): void {
  requireApi(p, "sessions");
  if (!tierAtLeast(p.tier, "scale")) {
    throw new SandboxdError("forbidden", "registering or deleting templates needs a scale key");
  }
}

/** Pro features of the sandboxes API: 403 `demo_tier_limit` for demo keys (docs/keys-and-auth.md "Rules of authentication"; docs/api.md "Rules every route shares"). */
export function requirePro(p: Principal, feature: string): void {
  requireApi(p, "sandboxes");
  if (!tierAtLeast(p.tier, "pro")) {
    throw new SandboxdError("demo_tier_limit", `${feature} needs a pro or enterprise key`);
  }
}

export type { Tier };
