/**
 * The home region a connect URL's token names (docs/connect.md; docs/edge.md "Routing"): the
 * gateway that mints a connect URL for a tenant at home in a region puts the region in the
 * token's claim `reg` (gateway/auth/connect-token.ts). An edge reads it here without the signing
 * secret, as a routing hint only: the gateway that serves the connect checks the whole token, and a
 * changed claim breaks its signature. Imports nothing at run time (an edge isolate bundles it).
 */
import { REGION_NAME_PATTERN } from "./api-key.ts";

export const CONNECT_REGION_CLAIM = "reg";

/**
 * The longest token read: our tokens are about 300 characters (five short claims, HS256). The
 * bound keeps a hostile `t` from costing the edge more than a small decode.
 */
export const MAX_CONNECT_TOKEN_CHARS = 2048;

/**
 * The region claim of a connect token (a JWT), unverified; undefined when there is none or it is
 * not one. An E2B sandbox's access token carries the same claim (gateway/e2b/envd-token.ts), and
 * the edge reads it here too.
 */
export function connectTokenRegion(token: string): string | undefined {
  if (token.length > MAX_CONNECT_TOKEN_CHARS) return undefined;
  const parts = token.split(".");
  if (parts.length !== 3) return undefined;
  let claims: unknown;
  try {
    const b64 = parts[1]!.replace(/-/g, "+").replace(/_/g, "/");
    claims = JSON.parse(atob(b64.padEnd(b64.length + ((4 - (b64.length % 4)) % 4), "=")));
  } catch {
    return undefined; // not base64url JSON: no claim to route by (the gateway refuses the token)
  }
  if (typeof claims !== "object" || claims === null) return undefined;
  const region = (claims as Record<string, unknown>)[CONNECT_REGION_CLAIM];
  return typeof region === "string" && REGION_NAME_PATTERN.test(region) ? region : undefined;
}
