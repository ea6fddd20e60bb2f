/**
 * The API key format (docs/keys-and-auth.md "API keys"), the one parser the gateway and the edge
 * (edge/) both use. It imports nothing at run time, so an edge isolate bundles it without zod or
 * any node built-in.
 *
 *   svc_<tier>_<id>_<secret>            a tenant with no home region (and every key issued before regions)
 *   svc_<tier>_<region>_<id>_<secret>   a tenant at home in <region>
 *
 * A region name may itself contain `_` (docs/regions.md), the id and the secret never do, so a
 * key is read from both ends: `svc`, the tier, then the secret last, the id before it, and
 * whatever lies between (joined by `_`) is the region. The region is a routing hint only: the
 * stored hash covers the whole key, so a valid key's region cannot be changed.
 */
import type { Tier } from "./tiers.ts";

/** Our choice (docs/keys-and-auth.md "API keys"): 12 lowercase base36 characters; never contains `_`. */
export const KEY_ID_CHARS = 12;
/** Our choice: 40 base62 characters, about 238 bits of randomness; never contains `_`. */
export const KEY_SECRET_CHARS = 40;

/** Accepts a little more than we issue (8..32, 16..128), so lengths can change later. */
const KEY_ID = /^[a-z0-9]{8,32}$/;
const KEY_SECRET = /^[A-Za-z0-9]{16,128}$/;

/**
 * A region's name (a tenant's home, an agent's place): up to 64 letters, digits, `.`, `_`, `-`,
 * so that it reads safely in URLs, log lines, error messages and keys.
 */
export const REGION_NAME_PATTERN = /^[A-Za-z0-9._-]{1,64}$/;

const TIERS: ReadonlySet<string> = new Set<Tier>(["live", "scale", "demo", "pro", "enterprise"]);

/**
 * The longest key the parser reads: `svc`, the longest tier (`enterprise`), a 64-character region,
 * a 32-character id and a 128-character secret, with their four `_`. A longer string is no key,
 * refused before it is split (the edge reads keys from headers it does not otherwise bound).
 */
export const MAX_API_KEY_CHARS = 3 + 10 + 64 + 32 + 128 + 4;

export interface ParsedApiKey {
  tier: Tier;
  keyId: string;
  secret: string;
  /** The tenant's home region the key was issued with; absent on a key without one. */
  region?: string;
}

export function parseApiKey(key: string): ParsedApiKey | null {
  if (key.length > MAX_API_KEY_CHARS) return null;
  const parts = key.split("_");
  if (parts.length < 4 || parts[0] !== "svc") return null;
  const tier = parts[1]!;
  const secret = parts[parts.length - 1]!;
  const keyId = parts[parts.length - 2]!;
  if (!TIERS.has(tier) || !KEY_ID.test(keyId) || !KEY_SECRET.test(secret)) return null;
  if (parts.length === 4) return { tier: tier as Tier, keyId, secret };
  const region = parts.slice(2, -2).join("_");
  if (!REGION_NAME_PATTERN.test(region)) return null;
  return { tier: tier as Tier, keyId, secret, region };
}

/**
 * The part of a key that listings show and `key revoke` accepts: `svc_<tier>[_<region>]_<id>`,
 * the key without its secret.
 */
export function apiKeyPrefix(k: { tier: Tier; keyId: string; region?: string | null }): string {
  return k.region ? `svc_${k.tier}_${k.region}_${k.keyId}` : `svc_${k.tier}_${k.keyId}`;
}

/** The key id a prefix (`apiKeyPrefix`) names: its last segment. */
export function keyIdOfPrefix(prefix: string): string {
  return prefix.slice(prefix.lastIndexOf("_") + 1);
}

/**
 * A browser cannot set `Authorization` on a WebSocket, so a WebSocket upgrade may carry the key in
 * `Sec-WebSocket-Protocol` instead: the list must start with `WS_PROTOCOL` (the protocol the
 * server answers with, so the key is never echoed) followed by `WS_KEY_PROTOCOL_PREFIX + key`,
 * e.g. `new WebSocket(url, ["sandboxd", "sandboxd.key." + key])` (docs/console.md "The web console: choices").
 */
export const WS_PROTOCOL = "sandboxd";
export const WS_KEY_PROTOCOL_PREFIX = "sandboxd.key.";

/** The scheme is case-insensitive (RFC 9110 11.1); the key is one token, trailing blanks allowed. */
const BEARER = /^Bearer\s+(\S+)\s*$/i;

/** The key a WebSocket upgrade offers as its second subprotocol, after the marker; else undefined. */
export function keyFromWsProtocols(
  upgrade: string | undefined,
  protocols: string | undefined,
): string | undefined {
  if (upgrade?.toLowerCase() !== "websocket" || protocols === undefined) return undefined;
  const offered = protocols.split(",").map((p) => p.trim());
  if (offered.length !== 2 || offered[0] !== WS_PROTOCOL) return undefined;
  const second = offered[1]!;
  if (!second.startsWith(WS_KEY_PROTOCOL_PREFIX)) return undefined;
  const key = second.slice(WS_KEY_PROTOCOL_PREFIX.length);
  return key.length > 0 ? key : undefined;
}

/**
 * The key a request presents (docs/keys-and-auth.md "Rules of authentication"): `Authorization:
 * Bearer <key>`, or, on a WebSocket upgrade without `Authorization`, the key subprotocol. A
 * present but malformed `Authorization` presents no key (undefined), as does a request with none.
 */
export function presentedKey(header: (name: string) => string | undefined): string | undefined {
  const auth = header("authorization");
  if (auth !== undefined) return BEARER.exec(auth)?.[1];
  return keyFromWsProtocols(header("upgrade"), header("sec-websocket-protocol"));
}
