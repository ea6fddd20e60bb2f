/**
 * The `envdAccessToken` the E2B control plane hands out with a sandbox (docs/e2b.md "Data plane
 * authentication"): the SDK sends it as `X-Access-Token` on every data-plane call, which carries
 * no API key. A JWT (HS256, jose) scoped to one tenant and sandbox and naming the key that minted
 * it (`kid`) and that key's tier: the data plane acts with that key's principal, counts against
 * its rate limit, and refuses the token once the key is revoked (`keyIsLive`) or the sandbox is
 * gone (the caller looks the sandbox up under the token's tenant). No expiry: E2B's tokens live
 * as long as their sandbox, and a client that reconnects gets a new one.
 *
 * The signing key is derived from the connect secret with its own label, so it is never the key
 * of connect tokens (gateway/auth/connect-token.ts) or of anything else.
 */
import { jwtVerify, SignJWT } from "jose";
import { CONNECT_REGION_CLAIM } from "../../contracts/api/connect-region.ts";
import type { KeyApi, Tier } from "../../contracts/api/tiers.ts";
import { derivedKey } from "../auth/derived-key.ts";
import type { Principal } from "../auth/keys.ts";

/** `aud` of every envd token: accepted nowhere else. */
export const ENVD_AUDIENCE = "sandboxd-e2b-envd";

const keyOf = (secret: string) => derivedKey(secret, "sandboxd e2b-envd-token v1");

/**
 * Signs a sandbox's token. `region`, the tenant's home region when it has one, goes into the claim
 * `reg`, as in connect tokens: a routing hint an edge reads without the secret
 * (contracts/api/connect-region.ts), since a data-plane call carries the token and no key.
 */
export function signEnvdToken(
  secret: string,
  p: Principal,
  sandboxId: string,
  nowSecs: number,
  region?: string | null,
): Promise<string> {
  return new SignJWT({
    tid: p.tenantId,
    kid: p.keyId,
    tier: p.tier,
    api: p.api,
    ...(region ? { [CONNECT_REGION_CLAIM]: region } : {}),
  })
    .setProtectedHeader({ alg: "HS256", typ: "JWT" })
    .setAudience(ENVD_AUDIENCE)
    .setSubject(sandboxId)
    .setIssuedAt(nowSecs)
    .sign(keyOf(secret));
}

/**
 * The principal of a genuine token for `sandboxId`, else undefined (the caller answers 401
 * without saying why). The key's liveness is the caller's check.
 */
export async function verifyEnvdToken(
  secret: string,
  token: string,
  sandboxId: string,
): Promise<Principal | undefined> {
  // A JWT of ours is a few hundred bytes; anything much longer is not one (and is not parsed).
  if (token.length > 4096) return undefined;
  try {
    const { payload } = await jwtVerify(token, keyOf(secret), {
      audience: ENVD_AUDIENCE,
      algorithms: ["HS256"],
    });
    if (payload.sub !== sandboxId) return undefined;
    const { tid, kid, tier, api } = payload as Record<string, unknown>;
    if (
      typeof tid !== "string" ||
      typeof kid !== "string" ||
      typeof tier !== "string" ||
      typeof api !== "string"
    )
      return undefined;
    return { tenantId: tid, keyId: kid, tier: tier as Tier, api: api as KeyApi };
  } catch {
    // Any verification failure (signature, audience, malformed) is the same refusal.
    return undefined;
  }
}
