/**
 * Connect-url tokens (docs/connect.md "Rules of connect URLs"; docs/sandboxes.md "Rules of the sandboxes API"): a JWT (HS256, jose) scoped to one tenant, sandbox, guest
 * port and protocol, with an expiry (`ttl_seconds`, clamped to 3600 by the route). The token
 * names its tenant, so the connect endpoint needs no key; every claim must match the request, so
 * a token is useless for any other sandbox, port, protocol or tenant. Deleting the sandbox revokes
 * its tokens: the connect route then refuses them (only a live sandbox record is accepted). The
 * token also names the API key that minted it (`kid`), and revoking that key revokes the token:
 * the connect route accepts a token only while its key is live (`keyIsLive`, gateway/auth/keys.ts).
 *
 * The signing key is derived from the server's connect secret (HMAC-SHA256 with a fixed label),
 * so the key is always 256 bits (RFC 7518 3.2) and never equals a key used for anything else.
 */
import { jwtVerify, SignJWT } from "jose";
import { CONNECT_REGION_CLAIM } from "../../contracts/api/connect-region.ts";
import type { TunnelProtocol } from "../../contracts/api/sandboxes-api.ts";
import { derivedKey } from "./derived-key.ts";

/** `aud` of every connect token: not accepted anywhere else (agent tokens use their own). */
export const CONNECT_AUDIENCE = "sandboxd-connect";

export interface ConnectScope {
  tenantId: string;
  /**
   * The API key that minted the token (claim `kid`): a connect by token counts against that
   * key's rate limit, and is refused once that key is revoked.
   */
  keyId: string;
  sandboxId: string;
  port: number;
  protocol: TunnelProtocol;
}

const keyOf = (secret: string) => derivedKey(secret, "sandboxd connect-token v1");

/**
 * Signs a connect token. `region`, the tenant's home region when it has one, goes into the claim
 * `reg`: a routing hint an edge reads without the secret (contracts/api/connect-region.ts); the
 * gateway never reads it, and it cannot be changed without breaking the signature.
 */
export function signConnectToken(
  secret: string,
  s: ConnectScope & { nowSecs: number; expSecs: number; region?: string | null },
): Promise<string> {
  return new SignJWT({
    tid: s.tenantId,
    port: s.port,
    proto: s.protocol,
    kid: s.keyId,
    ...(s.region ? { [CONNECT_REGION_CLAIM]: s.region } : {}),
  })
    .setProtectedHeader({ alg: "HS256", typ: "JWT" })
    .setAudience(CONNECT_AUDIENCE)
    .setSubject(s.sandboxId)
    .setIssuedAt(s.nowSecs)
    .setExpirationTime(s.expSecs)
    .sign(keyOf(secret));
}

/**
 * The tenant the token was minted for, when the token is genuine, unexpired and scoped to this
 * sandbox, port and protocol; otherwise undefined (the caller answers 401 without saying why).
 */
export async function verifyConnectToken(
  secret: string,
  token: string,
  want: { sandboxId: string; port: number; protocol: TunnelProtocol; nowMs: number },
): Promise<string | undefined> {
  return (await verifyConnectTokenClaims(secret, token, want))?.tenantId;
}

/** As `verifyConnectToken`, with the id of the minting key (its rate limit, its revocation). */
export async function verifyConnectTokenClaims(
  secret: string,
  token: string,
  want: { sandboxId: string; port: number; protocol: TunnelProtocol; nowMs: number },
): Promise<{ tenantId: string; keyId: string } | undefined> {
  try {
    const { payload } = await jwtVerify(token, keyOf(secret), {
      algorithms: ["HS256"],
      audience: CONNECT_AUDIENCE,
      subject: want.sandboxId,
      requiredClaims: ["exp", "sub", "tid", "kid"],
      currentDate: new Date(want.nowMs),
      clockTolerance: 0,
    });
    const { tid, port, proto, kid } = payload as {
      tid?: unknown;
      port?: unknown;
      proto?: unknown;
      kid?: unknown;
    };
    if (typeof tid !== "string" || typeof kid !== "string") return undefined;
    if (port !== want.port || proto !== want.protocol) return undefined;
    return { tenantId: tid, keyId: kid };
  } catch {
    return undefined;
  }
}
