/**
 * API keys (docs/keys-and-auth.md "Rules of authentication"): issue, list, revoke, verify. A new key is returned once and never again:
 * the db keeps only HMAC-SHA256(pepper, key), compared in constant time. Tenants are created on
 * demand when their first key is issued.
 */
import { createHmac, timingSafeEqual } from "node:crypto";
import { and, asc, eq, isNull } from "drizzle-orm";
import {
  apiKeyPrefix,
  KEY_ID_CHARS,
  KEY_SECRET_CHARS,
  keyIdOfPrefix,
  parseApiKey,
} from "../../contracts/api/api-key.ts";
import { API_OF_TIER, type KeyApi, type Tier } from "../../contracts/api/tiers.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import type { Db } from "../../db/client.ts";
import { apiKeys } from "../../db/schema/api-keys.ts";
import { tenants } from "../../db/schema/tenants.ts";
import { base36, base62, newTenantId } from "../ids.ts";

export function hashKey(pepper: string, key: string): string {
  return createHmac("sha256", pepper).update(key).digest("hex");
}

/**
 * Returns the tenant's id, creating the tenant if it does not exist yet, at home in `region`
 * (docs/regions.md "Rules of regions"). A home region is fixed at creation: naming another one for
 * an existing tenant is a 409 `conflict`. A tenant without one (made before regions, or with none
 * named) takes the first one named; until then the serving gateway's `--region` serves it.
 */
export async function ensureTenant(db: Db, name: string, region?: string): Promise<string> {
  return (await ensureTenantIn(db, name, region)).id;
}

/** `ensureTenant`, with the tenant's home region (null: none yet). */
async function ensureTenantIn(
  db: Db,
  name: string,
  region?: string,
): Promise<{ id: string; region: string | null }> {
  await db
    .insert(tenants)
    .values({ id: newTenantId(), name, region: region ?? null })
    .onConflictDoNothing({ target: tenants.name });
  const [row] = await db
    .select({ id: tenants.id, region: tenants.region })
    .from(tenants)
    .where(eq(tenants.name, name));
  if (!row) throw new SandboxdError("internal", `tenant ${name} vanished after insert`);
  if (region === undefined || row.region === region) return row;
  if (row.region === null) {
    const set = await db
      .update(tenants)
      .set({ region })
      .where(and(eq(tenants.id, row.id), isNull(tenants.region)))
      .returning({ id: tenants.id });
    // Another creation named a region first: that one is the home, checked again below.
    if (set.length === 1) return { id: row.id, region };
    return ensureTenantIn(db, name, region);
  }
  throw new SandboxdError(
    "conflict",
    `tenant ${name} is at home in region ${row.region}, not ${region}; a home region is fixed when the tenant is created`,
    { details: { tenant: name, region: row.region } },
  );
}

export interface IssuedKey {
  /** The full key. Shown to the operator once; not recoverable. */
  key: string;
  keyId: string;
  prefix: string;
  tenantId: string;
  tier: Tier;
  /** The tenant's home region; null: none yet (served in the serving gateway's `--region`). */
  region: string | null;
}

export async function createKey(
  db: Db,
  pepper: string,
  opts: { tenant: string; tier: Tier; name?: string; region?: string },
): Promise<IssuedKey> {
  const tenant = await ensureTenantIn(db, opts.tenant, opts.region);
  const tenantId = tenant.id;
  const keyId = base36(KEY_ID_CHARS);
  // A tenant at home in a region gets keys that name it: an edge routes them there without a
  // database (docs/keys-and-auth.md "API keys"). Hashed whole, so the region cannot be changed.
  const prefix = apiKeyPrefix({ tier: opts.tier, region: tenant.region, keyId });
  const key = `${prefix}_${base62(KEY_SECRET_CHARS)}`;
  await db.insert(apiKeys).values({
    id: keyId,
    tenantId,
    tier: opts.tier,
    prefix,
    name: opts.name ?? "",
    hash: hashKey(pepper, key),
  });
  return { key, keyId, prefix, tenantId, tier: opts.tier, region: tenant.region };
}

export interface KeyListing {
  keyId: string;
  prefix: string;
  name: string;
  tier: Tier;
  tenant: string;
  createdAt: Date;
  revokedAt: Date | null;
}

export async function listKeys(db: Db, opts: { tenant?: string } = {}): Promise<KeyListing[]> {
  const rows = await db
    .select({
      keyId: apiKeys.id,
      prefix: apiKeys.prefix,
      name: apiKeys.name,
      tier: apiKeys.tier,
      tenant: tenants.name,
      createdAt: apiKeys.createdAt,
      revokedAt: apiKeys.revokedAt,
    })
    .from(apiKeys)
    .innerJoin(tenants, eq(tenants.id, apiKeys.tenantId))
    .where(opts.tenant === undefined ? undefined : eq(tenants.name, opts.tenant))
    .orderBy(asc(apiKeys.createdAt), asc(apiKeys.id));
  return rows;
}

/**
 * The key id a key id, a `svc_<tier>[_<region>]_<id>` prefix or a whole key names. A prefix never
 * reads as a whole key: its last segment, an id of 12, is shorter than any secret (16 or more).
 */
export function keyIdOf(idOrPrefix: string): string {
  if (!idOrPrefix.startsWith("svc_")) return idOrPrefix;
  return parseApiKey(idOrPrefix)?.keyId ?? keyIdOfPrefix(idOrPrefix);
}

/** Revokes by key id (or the `svc_<tier>[_<region>]_<id>` prefix). Returns false when no live key matched. */
export async function revokeKey(db: Db, idOrPrefix: string, now: Date = new Date()): Promise<boolean> {
  const keyId = keyIdOf(idOrPrefix);
  const rows = await db
    .update(apiKeys)
    .set({ revokedAt: now })
    .where(and(eq(apiKeys.id, keyId), isNull(apiKeys.revokedAt)))
    .returning({ id: apiKeys.id });
  return rows.length > 0;
}

/**
 * Whether the key with this id exists and is not revoked: a connect token minted by a key is
 * accepted only while this holds (auth/connect-token.ts). Read on every use, so a revocation by
 * any process on the database applies to the next connect.
 */
export async function keyIsLive(db: Db, keyId: string): Promise<boolean> {
  const [row] = await db.select({ revokedAt: apiKeys.revokedAt }).from(apiKeys).where(eq(apiKeys.id, keyId));
  return row !== undefined && row.revokedAt === null;
}

export interface Principal {
  tenantId: string;
  keyId: string;
  tier: Tier;
  api: KeyApi;
}

/** Resolves a presented key to its principal, or null (unknown, malformed, revoked, wrong). */
export function verifyKey(db: Db, pepper: string, presented: string): Promise<Principal | null> {
  return verifyKeyHashed(db, presented, hashKey(pepper, presented));
}

/** `verifyKey` with the key's HMAC already computed (`hashKey`), as the key cache has it. */
export async function verifyKeyHashed(db: Db, presented: string, hash: string): Promise<Principal | null> {
  const parsed = parseApiKey(presented);
  // Hash even when the key is malformed or its id unknown (the caller did), so the response time
  // does not reveal which ids exist.
  if (!parsed) return null;
  const [row] = await db
    .select({
      tenantId: apiKeys.tenantId,
      tier: apiKeys.tier,
      hash: apiKeys.hash,
      revokedAt: apiKeys.revokedAt,
    })
    .from(apiKeys)
    .where(eq(apiKeys.id, parsed.keyId));
  const presentedHash = Buffer.from(hash, "hex");
  const storedHash = row ? Buffer.from(row.hash, "hex") : Buffer.alloc(presentedHash.length);
  const match = storedHash.length === presentedHash.length && timingSafeEqual(storedHash, presentedHash);
  if (!row || !match || row.revokedAt !== null || row.tier !== parsed.tier) return null;
  return { tenantId: row.tenantId, keyId: parsed.keyId, tier: row.tier, api: API_OF_TIER[row.tier] };
}
