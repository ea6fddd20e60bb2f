/**
 * The tokens between the gateway and its agents: HS256 JWTs keyed by the one agent's own key
 * (issued at enrollment, enroll.ts), each with its own audience so that neither direction can pass
 * as the other, and each naming the agent so that one agent's key speaks for that agent only:
 *
 * - gateway -> agent: every agent API request carries `Authorization: Bearer <JWT>` for audience
 *   `sandboxd-agent:<agent id>`, living at most 60 s, signed with that agent's key. An agent
 *   accepts only its own audience, so a token minted for agent A is refused by agent B even if
 *   B somehow held A's key. Short-lived tokens mean a leaked one is useless within a minute, and
 *   the agent keeps no session state. The client signs a fresh token per request.
 * - agent -> gateway: every heartbeat (heartbeat.ts) carries a token for audience
 *   `sandboxd-gateway-heartbeat`, issued by `sandboxd-agent`, whose subject (and `kid` header) is
 *   the agent's id: the gateway looks that agent's key up by the `kid`, verifies with it, and
 *   accepts a heartbeat only for that same id. A dial-out connection (BYOC agents) opens with
 *   the same kind of token for audience `sandboxd-gateway-dial`: neither passes for the other.
 */
import { decodeProtectedHeader, errors as joseErrors, jwtVerify, SignJWT } from "jose";
import { SandboxdError } from "../errors.ts";

export const AGENT_AUDIENCE_PREFIX = "sandboxd-agent:";
export const GATEWAY_ISSUER = "sandboxd-gateway";
/** The longest life a token may have (exp - iat), seconds. */
export const MAX_TOKEN_LIFETIME_S = 60;
/** Lifetime of the tokens our client signs: well inside the limit, long enough for a slow hop. */
export const CLIENT_TOKEN_LIFETIME_S = 30;
/** Clock skew tolerated between gateway and agent hosts (both NTP-synced): 5 s. */
const CLOCK_TOLERANCE_S = 5;
/** HS256 wants a key at least as long as its output (RFC 7518 3.2). */
export const MIN_SECRET_BYTES = 32;

const HEARTBEAT_AUDIENCE = "sandboxd-gateway-heartbeat";
/** The audience of the token that opens an agent's dial-out connection (contracts/agent/dial-*.ts). */
const DIAL_AUDIENCE = "sandboxd-gateway-dial";
/** What an agent-issued token is for: a report (heartbeat, events) or a dial-out connection. */
export type AgentTokenPurpose = "report" | "dial";
const AUDIENCES: Record<AgentTokenPurpose, string> = { report: HEARTBEAT_AUDIENCE, dial: DIAL_AUDIENCE };
const AGENT_ISSUER = "sandboxd-agent";
/** Lifetime of a heartbeat token: one beat (heartbeat.ts) with room for a slow hop. */
const HEARTBEAT_TOKEN_LIFETIME_S = 30;

export type TokenCheck = { ok: true } | { ok: false; error: SandboxdError };

/** An agent's identity as both ends hold it: its id and its HS256 key. */
export interface AgentCredentials {
  id: string;
  key: string | Uint8Array;
}

/** The audience of gateway -> agent tokens meant for agent `agentId`. */
export function agentAudience(agentId: string): string {
  return `${AGENT_AUDIENCE_PREFIX}${agentId}`;
}

export function secretKey(secret: string | Uint8Array): Uint8Array {
  const key = typeof secret === "string" ? new TextEncoder().encode(secret) : secret;
  if (key.length < MIN_SECRET_BYTES)
    throw new SandboxdError(
      "bad_request",
      `an agent key or secret must be at least ${MIN_SECRET_BYTES} bytes`,
    );
  return key;
}

function bearerToken(header: string | undefined | null): string | undefined {
  return /^Bearer ([A-Za-z0-9_.-]+)$/.exec(header ?? "")?.[1];
}

function sign(
  key: Uint8Array,
  agentId: string,
  issuer: string,
  audience: string,
  lifetimeS: number,
): Promise<string> {
  return new SignJWT({})
    .setProtectedHeader({ alg: "HS256", typ: "JWT", kid: agentId })
    .setIssuer(issuer)
    .setSubject(agentId)
    .setAudience(audience)
    .setIssuedAt()
    .setExpirationTime(`${lifetimeS}s`)
    .sign(key);
}

/** A gateway -> agent token for agent `agentId`, signed with that agent's key. */
export function signAgentToken(
  key: Uint8Array,
  agentId: string,
  lifetimeS = CLIENT_TOKEN_LIFETIME_S,
): Promise<string> {
  return sign(key, agentId, GATEWAY_ISSUER, agentAudience(agentId), lifetimeS);
}

/** The audience of a gateway -> gateway relay token for agent `agentId` (never an agent's). */
export function relayAudience(agentId: string): string {
  return `sandboxd-gateway-relay:${agentId}`;
}

/**
 * A token one gateway shows another to relay calls to dial-out agent `agentId` through the
 * other's link (docs/regions.md "Gateways behind one address"): signed with that agent's key,
 * which only gateways (holding the agent secret) and the agent can derive, for an audience the
 * agent's own checks never accept.
 */
export function signRelayToken(key: Uint8Array, agentId: string): Promise<string> {
  return sign(key, agentId, GATEWAY_ISSUER, relayAudience(agentId), CLIENT_TOKEN_LIFETIME_S);
}

/** The linked gateway's check of a relay token (`signRelayToken`). */
export function verifyRelayToken(key: Uint8Array, agentId: string, header: string | undefined | null) {
  return verifyToken(key, relayAudience(agentId), header ?? undefined, "relay token");
}

/**
 * The agent's check of a bearer header: signed with its key, for its own id. The failure is a
 * value (`unauthorized`), with the reason in words.
 */
export function verifyAgentToken(
  key: Uint8Array,
  agentId: string,
  header: string | undefined,
): Promise<TokenCheck> {
  return verifyToken(key, agentAudience(agentId), header, "agent token");
}

/** A gateway-issued bearer token for `audience`, signed with `key`, short-lived. */
async function verifyToken(
  key: Uint8Array,
  audience: string,
  header: string | undefined,
  what: string,
): Promise<TokenCheck> {
  const fail = (why: string, cause?: unknown) => ({
    ok: false as const,
    error: new SandboxdError("unauthorized", `${what} rejected: ${why}`, { cause }),
  });
  const token = bearerToken(header);
  if (token === undefined) return fail("missing bearer token");
  try {
    const { payload } = await jwtVerify(token, key, {
      algorithms: ["HS256"],
      audience,
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

export function signHeartbeatToken(
  key: Uint8Array,
  agentId: string,
  purpose: AgentTokenPurpose = "report",
): Promise<string> {
  return sign(key, agentId, AGENT_ISSUER, AUDIENCES[purpose], HEARTBEAT_TOKEN_LIFETIME_S);
}

/**
 * The agent id a heartbeat's token claims (its `kid`), read before any check so the gateway
 * knows whose key to verify it with; `verifyHeartbeatToken` then proves the claim.
 */
export function heartbeatTokenAgent(header: string | null): string | undefined {
  const token = bearerToken(header);
  if (token === undefined) return undefined;
  try {
    const { kid } = decodeProtectedHeader(token);
    return typeof kid === "string" && kid.length > 0 ? kid : undefined;
  } catch {
    return undefined;
  }
}

/**
 * The gateway's check of a heartbeat's bearer header against agent `agentId`'s key; the subject
 * must be that agent. The failure is a value (`unauthorized`).
 */
export async function verifyHeartbeatToken(
  key: Uint8Array,
  agentId: string,
  header: string | null,
  purpose: AgentTokenPurpose = "report",
): Promise<TokenCheck> {
  const token = bearerToken(header);
  if (token === undefined) {
    return { ok: false, error: new SandboxdError("unauthorized", "missing bearer token") };
  }
  try {
    await jwtVerify(token, key, {
      algorithms: ["HS256"],
      audience: AUDIENCES[purpose],
      issuer: AGENT_ISSUER,
      subject: agentId,
      requiredClaims: ["exp", "iat"],
      clockTolerance: CLOCK_TOLERANCE_S,
    });
    return { ok: true };
  } catch (err) {
    return {
      ok: false,
      error: new SandboxdError("unauthorized", "heartbeat token rejected", { cause: err }),
    };
  }
}
