/**
 * Gateway -> agent authentication: every request carries `Authorization: Bearer <JWT>`, a token
 * the gateway signs with the secret it shares with its agents (HS256), for audience
 * `sandboxd-agent`, living at most 60 s. Short-lived tokens mean a leaked one is useless within a
 * minute, and the agent keeps no session state. The client signs a fresh token per request.
 */
import { errors as joseErrors, jwtVerify, SignJWT } from "jose";
import { SandboxdError } from "../errors.ts";

export const AGENT_AUDIENCE = "sandboxd-agent";
export const GATEWAY_ISSUER = "sandboxd-gateway";
/** The longest life a token may have (exp - iat), seconds. */
export const MAX_TOKEN_LIFETIME_S = 60;
/** Lifetime of the tokens our client signs: well inside the limit, long enough for a slow hop. */
export const CLIENT_TOKEN_LIFETIME_S = 30;
/** Clock skew tolerated between gateway and agent hosts (both NTP-synced): 5 s. */
const CLOCK_TOLERANCE_S = 5;
/** HS256 wants a key at least as long as its output (RFC 7518 3.2). */
export const MIN_SECRET_BYTES = 32;

export function secretKey(secret: string | Uint8Array): Uint8Array {
  const key = typeof secret === "string" ? new TextEncoder().encode(secret) : secret;
  if (key.length < MIN_SECRET_BYTES)
    throw new Error(`the agent secret must be at least ${MIN_SECRET_BYTES} bytes`);
  return key;
}

export async function signAgentToken(key: Uint8Array, lifetimeS = CLIENT_TOKEN_LIFETIME_S): Promise<string> {
  return new SignJWT({})
    .setProtectedHeader({ alg: "HS256", typ: "JWT" })
    .setIssuer(GATEWAY_ISSUER)
    .setAudience(AGENT_AUDIENCE)
    .setIssuedAt()
    .setExpirationTime(`${lifetimeS}s`)
    .sign(key);
}

/** Checks a bearer header; the failure is a value (`unauthorized`), with the reason in words. */
export async function verifyAgentToken(
  key: Uint8Array,
  header: string | undefined,
): Promise<{ ok: true } | { ok: false; error: SandboxdError }> {
  const fail = (why: string, cause?: unknown) => ({
    ok: false as const,
    error: new SandboxdError("unauthorized", `agent token rejected: ${why}`, { cause }),
  });
  const m = /^Bearer ([A-Za-z0-9_.-]+)$/.exec(header ?? "");
  if (!m) return fail("missing bearer token");
  try {
    const { payload } = await jwtVerify(m[1]!, key, {
      algorithms: ["HS256"],
      audience: AGENT_AUDIENCE,
      issuer: GATEWAY_ISSUER,
      requiredClaims: ["exp", "iat"],
      clockTolerance: CLOCK_TOLERANCE_S,
    });
    const { exp, iat } = payload as { exp: number; iat: number };
    if (exp - iat > MAX_TOKEN_LIFETIME_S)
      return fail(`lifetime ${exp - iat} s exceeds ${MAX_TOKEN_LIFETIME_S} s`);
    // An iat in the future would stretch the effective lifetime past the limit.
    if (iat > Date.now() / 1000 + CLOCK_TOLERANCE_S) return fail("issued in the future");
    return { ok: true };
  } catch (err) {
    const why = err instanceof joseErrors.JOSEError ? err.code : "invalid token";
    return fail(why, err);
  }
}
