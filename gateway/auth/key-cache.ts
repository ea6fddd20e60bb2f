/**
 * The in-memory fast path of the key middleware: a key verified against its row is trusted for a
 * while without reading the row again, so an authenticated request costs one HMAC and a map
 * lookup instead of a database round trip. Entries are keyed by the key's HMAC (the same keyed
 * hash the database stores), never by the key itself.
 *
 * How long: a trigger on `api_keys` (migration 0008) NOTIFYs `api_keys_changed` with the hash of
 * every key inserted, updated or deleted, by anyone, and each gateway LISTENs (db/client.ts
 * `listen`, the same connection as the row cache's) and drops that entry. While the LISTEN is in
 * effect, and was so since the entry's row was read, an entry is trusted for
 * `KEY_CACHE_NOTIFIED_TTL_MS`: a revocation by any process ends it when its notification comes.
 * Otherwise (before the LISTEN is confirmed, while it is lost, or for an entry read before it was
 * last confirmed) an entry is trusted for `KEY_CACHE_TTL_MS` only, when it ends and the row is read
 * again, as without notifications at all. The race with reads in flight is the row cache's, and so
 * is its answer (core/invalidations.ts): a read that began before a notification of its key does
 * not keep what it read.
 *
 * Revocation through this process (`forget`, called by the operator socket's `key revoke`) drops
 * the key's entries at once, as before, whatever the notifications do. Refusals are not cached: an
 * unknown key always reads the database, so a flood of bad keys cannot fill the cache, and a key
 * created anywhere works on its first request.
 */
import type { Db } from "../../db/client.ts";
import { Invalidations } from "../core/invalidations.ts";
import { hashKey, type Principal, verifyKeyHashed } from "./keys.ts";

/** The channel migration 0008's trigger notifies, payload: the key's hash (`api_keys.hash`). */
export const KEYS_CHANNEL = "api_keys_changed";

/**
 * How long a verified key is trusted without its row while notifications are not known to
 * arrive: the bound on a revocation by another process then. One second keeps the row reads of a
 * busy key to one a second while a revoked key stops within the time a client takes to notice a
 * revocation at all.
 */
export const KEY_CACHE_TTL_MS = 1000;
/**
 * How long a verified key is trusted while the LISTEN is in effect. Its notification is what ends
 * an entry then; this is only the safety net for a change no notification tells of although the
 * LISTEN holds (the trigger dropped by hand, a write with triggers disabled such as a restore
 * with `session_replication_role = replica`): such a revocation still applies within a minute.
 * A minute costs 800 busy keys ~13 row reads a second instead of 800.
 */
export const KEY_CACHE_NOTIFIED_TTL_MS = 60_000;
/**
 * Keys held at most: each entry is ~200 bytes, so 10,000 keys cost ~2 MB; past it the oldest entry
 * goes (that key reads its row on its next request).
 */
export const KEY_CACHE_MAX = 10_000;

interface Entry {
  principal: Principal;
  /** performance.now() when its row read began: the TTLs count from there. */
  at: number;
  /** The notification mark when its row read began (core/invalidations.ts). */
  mark: number;
}

export class VerifiedKeys {
  private readonly entries = new Map<string, Entry>();
  /** Verifications in flight, so concurrent requests with one key read its row once. */
  private readonly pending = new Map<string, Promise<Principal | null>>();
  /** The LISTEN's state and the hashes notified as changed. */
  private readonly changes = new Invalidations({
    invalidate: (hash) => {
      this.entries.delete(hash);
      this.tell();
    },
    // Nothing to empty: `covers` puts every entry read before this back on the short TTL. The
    // watchers hear of it: a change may have gone unnotified while the LISTEN was down.
    reset: () => this.tell(),
  });
  /** Called on every notified change of any key (`watch`). */
  private readonly watchers = new Set<() => void>();
  /** Rows read (tests and measurements: a busy key should read about one a second at most). */
  dbReads = 0;

  constructor(
    private readonly opts: {
      db: Db;
      pepper: string;
      /** `KEY_CACHE_TTL_MS` unless given. */
      ttlMs?: number;
      /** `KEY_CACHE_NOTIFIED_TTL_MS` unless given. */
      notifiedTtlMs?: number;
      max?: number;
      /** Monotonic milliseconds: the TTL is real time, whatever clock the app's logic runs on. */
      now?: () => number;
    },
  ) {}

  /** The `api_keys_changed` channel's events (db/client.ts `listen`). */
  get events(): Invalidations["events"] {
    return this.changes.events;
  }

  /** Whether entries are trusted past the short TTL now (the LISTEN is in effect). */
  get notified(): boolean {
    return this.changes.serving;
  }

  async verify(presented: string): Promise<Principal | null> {
    const hash = hashKey(this.opts.pepper, presented);
    // Called through `performance`: Node and Deno refuse performance.now without its receiver.
    const now = this.opts.now ? this.opts.now() : performance.now();
    const hit = this.entries.get(hash);
    if (hit !== undefined && now - hit.at < this.ttlOf(hit)) return hit.principal;
    let p = this.pending.get(hash);
    if (p === undefined) {
      p = this.read(presented, hash, now);
      this.pending.set(hash, p);
    }
    return p;
  }

  /**
   * Calls `fn` on every notified change of any key, and when the LISTEN comes or goes (changes
   * may have been missed): the open connections' check (auth/key-connections.ts). The payload is
   * the key's hash, which a connection opened by a connect token does not know, so `fn` is told
   * only that something changed. Returns the removal.
   */
  watch(fn: () => void): () => void {
    this.watchers.add(fn);
    return () => this.watchers.delete(fn);
  }

  private tell(): void {
    for (const fn of this.watchers) fn();
  }

  /** Drops the key's entries at once: its next request reads the (revoked) row. */
  forget(keyId: string): void {
    for (const [hash, e] of this.entries) if (e.principal.keyId === keyId) this.entries.delete(hash);
  }

  private ttlOf(e: Entry): number {
    return this.changes.covers(e.mark)
      ? (this.opts.notifiedTtlMs ?? KEY_CACHE_NOTIFIED_TTL_MS)
      : (this.opts.ttlMs ?? KEY_CACHE_TTL_MS);
  }

  private async read(presented: string, hash: string, now: number): Promise<Principal | null> {
    const mark = this.changes.begin();
    try {
      this.dbReads++;
      const principal = await verifyKeyHashed(this.opts.db, presented, hash);
      this.entries.delete(hash);
      // While notified, a read that a change of its key overtook keeps nothing (it may have read
      // the row before the change); without the LISTEN the short TTL bounds it, as it always did.
      const keep = principal !== null && (!this.changes.serving || this.changes.unchanged(hash, mark));
      if (keep) {
        if (this.entries.size >= (this.opts.max ?? KEY_CACHE_MAX)) {
          // Maps iterate in insertion order: the first is the oldest.
          const oldest = this.entries.keys().next().value;
          if (oldest !== undefined) this.entries.delete(oldest);
        }
        this.entries.set(hash, { principal, at: now, mark });
      }
      return principal;
    } finally {
      this.pending.delete(hash);
    }
  }
}
