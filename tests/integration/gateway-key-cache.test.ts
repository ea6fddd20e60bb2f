/**
 * The key cache kept true by NOTIFY (gateway/auth/key-cache.ts, migration 0008), on PGlite and on
 * a real PostgreSQL:
 * - through `startGateway` (the real LISTEN) with the short TTL set to ten minutes, so that only a
 *   notification can end an entry within the bound: a key revoked by a direct SQL UPDATE from
 *   another connection is refused within NOTIFY_BOUND_MS; a key created by another connection
 *   works on its first request even after it was refused as unknown; on PostgreSQL a key revoked
 *   through a second gateway (what the operator socket's `key revoke` does there) is refused by
 *   the first within the bound;
 * - `VerifiedKeys` over the real database with its LISTEN state set by the test and a clock it
 *   drives: before the LISTEN is confirmed, while it is lost, and for an entry read before it was
 *   last confirmed, the short TTL holds exactly (trusted just before it, read again just after);
 *   while it holds, only a notification or the long TTL ends an entry; a read that a notification
 *   of its key overtook keeps nothing.
 */
import { afterAll, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { eq } from "drizzle-orm";
import { type Db, type DbHandle, openDb } from "../../db/client.ts";
import { apiKeys } from "../../db/schema/api-keys.ts";
import { KEY_CACHE_NOTIFIED_TTL_MS, KEY_CACHE_TTL_MS, VerifiedKeys } from "../../gateway/auth/key-cache.ts";
import { createKey, ensureTenant, hashKey, revokeKey } from "../../gateway/auth/keys.ts";
import { type RunningGateway, startGateway } from "../../gateway/server.ts";
import { MemoryAgent } from "../support/memory-agent.ts";
import { databaseCases } from "../support/postgres-suite.ts";
import { until } from "../support/until.ts";

/**
 * How long another process's revocation may take to show. A notification is delivered within
 * milliseconds of the commit (the time seen is printed); the bound is far above that, for a
 * loaded 2-core host, and far below LONG_TTL_MS, so only a notification can meet it.
 */
const NOTIFY_BOUND_MS = 5_000;
/** The short TTL the gateways here run with: far past the bound, so only a notification helps. */
const LONG_TTL_MS = 600_000;
/** How long a fresh gateway may take to confirm its LISTEN on a loaded host. */
const LISTEN_UP_MS = 10_000;

const PEPPER = "key-cache-pepper-0123456789";
const dirs: string[] = [];
const gateways: RunningGateway[] = [];
afterAll(async () => {
  for (const g of gateways) await g.stop().catch(() => {});
  for (const d of dirs) rmSync(d, { recursive: true, force: true });
}, 30_000); // closing a pool waits up to 5 s for its connections
// After the gateways' hook: the server stops once their pools are closed.
const { cases: DATABASES, havePostgres: HAVE_PG, postgresUrl: pgUrl } = databaseCases();

async function gateway(url: string | undefined): Promise<RunningGateway> {
  const dir = mkdtempSync(join(tmpdir(), "sandboxd-keycache-"));
  dirs.push(dir);
  const gw = await startGateway({
    port: 0,
    ...(url ? { databaseUrl: url } : { dataDir: dir }),
    agent: new MemoryAgent(),
    config: {
      keyPepper: PEPPER,
      connectSecret: "key-cache-connect-0123456789",
      uploadDir: join(dir, "uploads"),
    },
    reaper: false,
    keyCacheTtlMs: LONG_TTL_MS,
    log: () => {},
  });
  gateways.push(gw);
  return gw;
}

/**
 * The status of a list with `key`. Never 429: the polls here (tests/support/until.ts) stay far
 * under the key's rate limit, and a 429 would make a refusal look like anything but a 401.
 */
const list = async (gw: RunningGateway, key: string) => {
  const status = (await fetch(`${gw.url}/v1/sandboxes`, { headers: { authorization: `Bearer ${key}` } }))
    .status;
  expect(status).not.toBe(429);
  return status;
};

/** Once the gateway's LISTEN holds: the key is verified, and its next request is from memory. */
async function cachedUnderListen(gw: RunningGateway, key: string): Promise<void> {
  await until(() => gw.keys.notified, LISTEN_UP_MS);
  // Until a request reads no row: a read that the key's own INSERT notification overtook (it
  // reaches another gateway a moment after the commit) keeps nothing.
  await until(async () => {
    expect(await list(gw, key)).toBe(200);
    const reads = gw.keys.dbReads;
    expect(await list(gw, key)).toBe(200);
    return gw.keys.dbReads === reads;
  }, LISTEN_UP_MS);
}

/** Another writer: a second pool on PostgreSQL; on PGlite (one opener) the gateway's own handle. */
async function elsewhere<T>(
  gw: RunningGateway,
  url: string | undefined,
  fn: (db: Db) => Promise<T>,
): Promise<T> {
  if (url === undefined) return gw.withDb(fn);
  const other = await openDb({ url });
  try {
    return await fn(other.db);
  } finally {
    await other.close();
  }
}

for (const dbCase of DATABASES) {
  describe(`${dbCase.name}: through the gateway's LISTEN`, () => {
    test(`a key revoked by a direct SQL UPDATE is refused within ${NOTIFY_BOUND_MS} ms`, async () => {
      const url = dbCase.url ? await dbCase.url() : undefined;
      const gw = await gateway(url);
      const k = await gw.withDb((db) => createKey(db, PEPPER, { tenant: "acme", tier: "pro" }));
      const other = await gw.withDb((db) => createKey(db, PEPPER, { tenant: "acme", tier: "pro" }));
      await cachedUnderListen(gw, k.key);
      await cachedUnderListen(gw, other.key);
      // Not through keys.ts, and not through this gateway: only the trigger can tell it.
      await elsewhere(gw, url, (db) =>
        db.update(apiKeys).set({ revokedAt: new Date() }).where(eq(apiKeys.id, k.keyId)),
      );
      const ms = await until(async () => (await list(gw, k.key)) === 401, NOTIFY_BOUND_MS);
      console.log(JSON.stringify({ test: "key-cache", db: dbCase.name, revoke_seen_ms: Math.round(ms) }));
      // The tenant's other key stays in memory: the notification named the one key.
      const reads = gw.keys.dbReads;
      expect(await list(gw, other.key)).toBe(200);
      expect(gw.keys.dbReads).toBe(reads);
    }, 60_000);

    test("a key created by another connection works on its first request, though refused before", async () => {
      const url = dbCase.url ? await dbCase.url() : undefined;
      const gw = await gateway(url);
      await until(() => gw.keys.notified, LISTEN_UP_MS);
      // A well-formed key whose row does not exist yet: refused, and the refusal is not kept.
      const key = `svc_pro_${"k".repeat(12)}_${"S".repeat(40)}`;
      expect(await list(gw, key)).toBe(401);
      const tenantId = await gw.withDb((db) => ensureTenant(db, "acme"));
      await elsewhere(gw, url, (db) =>
        db.insert(apiKeys).values({
          id: "k".repeat(12),
          tenantId,
          tier: "pro",
          prefix: `svc_pro_${"k".repeat(12)}`,
          name: "",
          hash: hashKey(PEPPER, key),
        }),
      );
      expect(await list(gw, key)).toBe(200);
    }, 60_000);
  });
}

describe.skipIf(!HAVE_PG)("PostgreSQL: two gateways", () => {
  test(`a key revoked through another gateway is refused here within ${NOTIFY_BOUND_MS} ms`, async () => {
    const url = await pgUrl();
    const gwA = await gateway(url);
    const gwB = await gateway(url);
    const k = await gwA.withDb((db) => createKey(db, PEPPER, { tenant: "acme", tier: "pro" }));
    await cachedUnderListen(gwA, k.key);
    await cachedUnderListen(gwB, k.key);
    // What B's operator socket does for `sandboxd key revoke` (cli/operator-ops.ts).
    expect(await gwB.withDb((db) => revokeKey(db, k.keyId))).toBe(true);
    gwB.keyRevoked(k.keyId);
    expect(await list(gwB, k.key)).toBe(401);
    await until(async () => (await list(gwA, k.key)) === 401, NOTIFY_BOUND_MS);
  }, 60_000);
});

// ---- VerifiedKeys with the LISTEN state and the clock set by the test ----

for (const dbCase of DATABASES) {
  describe(`${dbCase.name}: the TTLs`, () => {
    let handle: DbHandle | undefined;
    afterAll(async () => {
      await handle?.close();
    });
    async function setup() {
      const url = dbCase.url ? await dbCase.url() : undefined;
      if (handle === undefined) {
        const dir = mkdtempSync(join(tmpdir(), "sandboxd-keycache-ttl-"));
        dirs.push(dir);
        handle = await openDb(url ? { url } : { dataDir: dir });
      }
      const db = handle.db;
      let now = 1_000_000;
      const keys = new VerifiedKeys({ db, pepper: PEPPER, now: () => now });
      const k = await createKey(db, PEPPER, { tenant: "acme", tier: "pro" });
      return {
        db,
        keys,
        k,
        advance: (ms: number) => {
          now += ms;
        },
        /** Verifies the key; whether that read its row. */
        verifyReads: async (): Promise<{ ok: boolean; read: boolean }> => {
          const before = keys.dbReads;
          const p = await keys.verify(k.key);
          return { ok: p !== null, read: keys.dbReads > before };
        },
      };
    }

    test("before the LISTEN is confirmed, and while it is lost, an entry lasts KEY_CACHE_TTL_MS", async () => {
      const { keys, advance, verifyReads, db, k } = await setup();
      expect(await verifyReads()).toEqual({ ok: true, read: true });
      advance(KEY_CACHE_TTL_MS - 1);
      expect(await verifyReads()).toEqual({ ok: true, read: false });
      advance(2);
      expect(await verifyReads()).toEqual({ ok: true, read: true });
      // The LISTEN comes: the entry read before it stays on the short TTL (changes before the
      // LISTEN took effect were never notified).
      keys.events.up();
      advance(KEY_CACHE_TTL_MS + 1);
      expect(await verifyReads()).toEqual({ ok: true, read: true });
      // Read under the LISTEN: trusted past the short TTL.
      advance(KEY_CACHE_TTL_MS + 1);
      expect(await verifyReads()).toEqual({ ok: true, read: false });
      // Read again, then the LISTEN is lost: the short TTL again, counted from that read.
      advance(KEY_CACHE_NOTIFIED_TTL_MS);
      expect(await verifyReads()).toEqual({ ok: true, read: true });
      advance(KEY_CACHE_TTL_MS - 1);
      keys.events.down();
      expect(await verifyReads()).toEqual({ ok: true, read: false });
      // A revocation no notification tells of (none comes while the LISTEN is down).
      expect(await revokeKey(db, k.keyId)).toBe(true);
      expect(await verifyReads()).toEqual({ ok: true, read: false });
      advance(2);
      expect(await verifyReads()).toEqual({ ok: false, read: true });
    });

    test("while the LISTEN holds only a notification or the long TTL ends an entry", async () => {
      const { keys, advance, verifyReads, db, k } = await setup();
      keys.events.up();
      expect(await verifyReads()).toEqual({ ok: true, read: true });
      advance(KEY_CACHE_NOTIFIED_TTL_MS - 1);
      expect(await verifyReads()).toEqual({ ok: true, read: false });
      advance(2);
      expect(await verifyReads()).toEqual({ ok: true, read: true });
      // The notification (here by hand: the LISTEN of this cache is the test's) drops the entry.
      expect(await revokeKey(db, k.keyId)).toBe(true);
      expect(await verifyReads()).toEqual({ ok: true, read: false }); // not notified yet
      keys.events.notify(hashKey(PEPPER, k.key));
      expect(await verifyReads()).toEqual({ ok: false, read: true });
    });

    test("a read that a notification of its key overtook keeps nothing", async () => {
      const { keys, advance, verifyReads, k } = await setup();
      keys.events.up();
      const p = keys.verify(k.key); // in flight: its row read has begun
      keys.events.notify(hashKey(PEPPER, k.key));
      expect(await p).not.toBeNull(); // it answers what it read
      advance(1);
      expect(await verifyReads()).toEqual({ ok: true, read: true }); // but did not keep it
      expect(await verifyReads()).toEqual({ ok: true, read: false });
    });
  });
}
