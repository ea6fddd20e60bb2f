/**
 * The in-memory fast path of the key middleware: a key verified against its row is trusted for
 * `KEY_CACHE_TTL_MS` without reading the row again, so an authenticated request costs one HMAC
 * and a map lookup instead of a database round trip. Entries are keyed by the key's HMAC (the
 * same keyed hash the database stores), never by the key itself.
 *
 * Revocation: a key revoked through this process (`forget`, called by the operator socket's
 * `key revoke`) is refused on the next request, as before; a key revoked by another process on
 * the same database (another gateway replica, a direct write) is refused within
 * `KEY_CACHE_TTL_MS`, when the entry ends and the row is read again. Refusals are not cached: an
 * unknown key always reads the database, so a flood of bad keys cannot fill the cache.
 */
import type { Db } from "../../db/client.ts";
import { hashKey, type Principal, verifyKeyHashed } from "./keys.ts";

/**
 * How long a verified key is trusted without its row: the bound on a revocation made by another
 * process. One second keeps the row reads of a busy key to one a second while a revoked key
 * stops within the time a client takes to notice a revocation at all.
 */
export const KEY_CACHE_TTL_MS = 1000;
/**
 * Keys held at most: each entry is ~200 bytes, so 10,000 keys cost ~2 MB; past it the oldest entry
 * goes (that key reads its row on its next request).
 */
export const KEY_CACHE_MAX = 10_000;

interface Entry {
  principal: Principal;
  /** performance.now() after which the row is read again. */
  until: number;
}

export class VerifiedKeys {
  private readonly entries = new Map<string, Entry>();
  /** Verifications in flight, so concurrent requests with one key read its row once. */
  private readonly pending = new Map<string, Promise<Principal | null>>();
  /** Rows read (tests and measurements: a busy key should read about one a second). */
  dbReads = 0;

  constructor(
    private readonly opts: {
      db: Db;
      pepper: string;
      ttlMs?: number;
      max?: number;
      /** Monotonic milliseconds: the TTL is real time, whatever clock the app's logic runs on. */
      now?: () => number;
    },
  ) {}

  async verify(presented: string): Promise<Principal | null> {
    const hash = hashKey(this.opts.pepper, presented);
    // Called through `performance`: Node and Deno refuse performance.now without its receiver.
    const now = this.opts.now ? this.opts.now() : performance.now();
    const hit = this.entries.get(hash);
    if (hit !== undefined && now < hit.until) return hit.principal;
    let p = this.pending.get(hash);
    if (p === undefined) {
      p = this.read(presented, hash, now);
      this.pending.set(hash, p);
    }
    return p;
  }

  /** Drops the key's entries at once: its next request reads the (revoked) row. */
  forget(keyId: string): void {
    for (const [hash, e] of this.entries) if (e.principal.keyId === keyId) this.entries.delete(hash);
  }

  private async read(presented: string, hash: string, now: number): Promise<Principal | null> {
    try {
      this.dbReads++;
      const principal = await verifyKeyHashed(this.opts.db, presented, hash);
      this.entries.delete(hash);
      if (principal) {
        if (this.entries.size >= (this.opts.max ?? KEY_CACHE_MAX)) {
          // Maps iterate in insertion order: the first is the oldest.
          const oldest = this.entries.keys().next().value;
          if (oldest !== undefined) this.entries.delete(oldest);
        }
        this.entries.set(hash, { principal, until: now + (this.opts.ttlMs ?? KEY_CACHE_TTL_MS) });
      }
      return principal;
    } finally {
      this.pending.delete(hash);
    }
  }
}
