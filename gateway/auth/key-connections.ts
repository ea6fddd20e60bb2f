/**
 * The long-lived connections this gateway process serves, by the API key that opened them
 * (docs/keys-and-auth.md "Revoking a key"): terminals, connect relays (tcp, cdp) and Server-Sent
 * Event streams (a streamed exec, a followed log). A connect by token counts under the key that
 * minted the token (its `kid`). Revoking a key ends every one of its connections; the others of
 * the tenant, under other keys, go on.
 *
 * How a revocation reaches a connection, whichever process made it:
 * - through this process (the operator socket's `key revoke`): `revoke` ends them at once;
 * - through any other (another gateway, the CLI on the database, SQL): migration 0008's trigger
 *   notifies `api_keys_changed`, the key cache passes every notification on (`VerifiedKeys.watch`)
 *   and `check` reads, in one query, which of the keys holding connections are still live;
 * - whatever the notifications do (before the LISTEN is confirmed, while it is lost, a write with
 *   triggers disabled): `check` also runs every `KEY_RECHECK_MS` while a connection is open. That
 *   is the bound, plus one database read.
 *
 * The same periodic check also answers the race of a connection that registers just after its
 * key was revoked (its key verified before the revocation, registered after `revoke` ran).
 */
import { and, inArray, isNull } from "drizzle-orm";
import { describeError } from "../../contracts/errors.ts";
import type { Db } from "../../db/client.ts";
import { apiKeys } from "../../db/schema/api-keys.ts";
import { KEY_CACHE_TTL_MS } from "./key-cache.ts";

/**
 * How often the keys holding connections are read again, ms: the bound on a revocation whose
 * notification never came. The key cache's own bound without notifications (`KEY_CACHE_TTL_MS`,
 * one second), so that a revoked key's open connections end no later than its next request is
 * refused; one primary-key read a second per gateway, and only while a connection is open.
 */
export const KEY_RECHECK_MS = KEY_CACHE_TTL_MS;

/**
 * WebSocket close code of a connection whose key was revoked: 1008 (RFC 6455 7.4.1, policy
 * violation), the code for a peer no longer allowed to be connected; the reason says which policy.
 */
export const KEY_REVOKED_CLOSE = 1008;
/** The close reason (and the `error` event's message) a revoked key's connections end with. */
export const KEY_REVOKED_REASON = "the API key was revoked";

/** A connection held under its key: a relay (gateway/relay/), an event stream (routes/exec-sse.ts). */
export interface KeyConnection {
  /** Ends it: a WebSocket closes with `code` and `reason`; a stream ends with an `error` event. */
  close(code: number, reason: string): void;
}

/** Keys read per query: a bounded IN list even with many keys connected at once. */
const CHECK_BATCH = 500;

export class KeyConnections {
  private readonly open = new Map<string, Set<KeyConnection>>();
  private timer: ReturnType<typeof setInterval> | undefined;
  /** The check in flight, if any; `again` asks for one more after it (a change came meanwhile). */
  private running: Promise<void> | undefined;
  private again = false;
  /** Checks run (tests: notifications and the timer both lead here). */
  checks = 0;

  constructor(
    private readonly opts: {
      db: Db;
      /** `KEY_RECHECK_MS` unless given. */
      recheckMs?: number;
      log?: (line: string) => void;
    },
  ) {}

  /** Registers a connection of `keyId`; returns its removal (idempotent). */
  add(keyId: string, conn: KeyConnection): () => void {
    let set = this.open.get(keyId);
    if (!set) {
      set = new Set();
      this.open.set(keyId, set);
    }
    set.add(conn);
    if (this.timer === undefined) {
      this.timer = setInterval(() => void this.check(), this.opts.recheckMs ?? KEY_RECHECK_MS);
      // An idle gateway's stop does not wait for this timer: it only serves open connections.
      this.timer.unref?.();
    }
    return () => {
      set.delete(conn);
      if (set.size === 0 && this.open.get(keyId) === set) this.open.delete(keyId);
      if (this.open.size === 0) this.stop();
    };
  }

  /** Ends every connection of the key (revoked through this process); returns how many. */
  revoke(keyId: string): number {
    const set = this.open.get(keyId);
    this.open.delete(keyId);
    if (this.open.size === 0) this.stop();
    for (const conn of set ?? []) conn.close(KEY_REVOKED_CLOSE, KEY_REVOKED_REASON);
    return set?.size ?? 0;
  }

  /**
   * Reads which keys holding connections are still live and ends the connections of the others
   * (revoked, or deleted). Concurrent calls share one read, and a call made while one is in
   * flight runs one more after it: that read may have begun before the change it was called for.
   */
  check(): Promise<void> {
    if (this.running) {
      this.again = true;
      return this.running;
    }
    this.running = (async () => {
      try {
        do {
          this.again = false;
          await this.checkOnce();
        } while (this.again);
      } finally {
        this.running = undefined;
      }
    })();
    return this.running;
  }

  private async checkOnce(): Promise<void> {
    const ids = [...this.open.keys()];
    if (ids.length === 0) return;
    this.checks++;
    const live = new Set<string>();
    try {
      for (let i = 0; i < ids.length; i += CHECK_BATCH) {
        const batch = ids.slice(i, i + CHECK_BATCH);
        const rows = await this.opts.db
          .select({ id: apiKeys.id })
          .from(apiKeys)
          .where(and(inArray(apiKeys.id, batch), isNull(apiKeys.revokedAt)));
        for (const r of rows) live.add(r.id);
      }
    } catch (err) {
      // The database is unreachable: connections stay (the next tick reads again), as a request
      // with a cached key is served while it is; ending them all would turn an outage into one.
      (this.opts.log ?? console.error)(`checking the keys of open connections failed: ${describeError(err)}`);
      return;
    }
    for (const id of ids) if (!live.has(id)) this.revoke(id);
  }

  /** Open connections of the key (or of all keys), for tests and metrics. */
  count(keyId?: string): number {
    if (keyId !== undefined) return this.open.get(keyId)?.size ?? 0;
    let n = 0;
    for (const set of this.open.values()) n += set.size;
    return n;
  }

  /** Stops the periodic check (the gateway stops; or nothing is open). */
  stop(): void {
    clearInterval(this.timer);
    this.timer = undefined;
  }
}
