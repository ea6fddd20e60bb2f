/**
 * Per-key request limit (docs/limits.md "Public API limits": 100 requests per second per key, 429 beyond), one limit for all
 * gateway replicas: the grants live in the database (table `rate_windows`, decided by the SQL
 * function `sandboxd_rate_take`, migration 0005_rate_limit.sql), so two gateways on one
 * PostgreSQL let a key through at the API's rate, not twice it. On PGlite (one gateway) the same
 * code runs in-process.
 *
 * The window slides: a request is allowed when fewer than `limit` requests of the key were
 * granted inside the last second, so no one-second interval holds more than `limit` (a token
 * bucket refilling during a burst let ~2x through in one second).
 *
 * The local fast path: a gateway asks the database for a lease of several requests at once, sized
 * to the key's recent rate at this gateway (and to the requests waiting here), and spends it
 * without a round trip for `LEASE_MS`; a lease is counted for one second plus `LEASE_MS` so that
 * spending it late cannot push a second over the limit, and what is left of it when it ends is
 * given back with the gateway's next question for the key. A refusal is remembered until the time
 * the database said a grant ends, so a flood of refused requests costs no round trips either.
 * One request per key at a time asks the database; the others wait for its answer.
 *
 * On PGlite the database belongs to this one process (db/lock.ts refuses a second), so there are
 * no other gateways to share the limit with: `LocalRateLimiter` keeps the same sliding window in
 * memory, exact, without a database call per lease.
 */

import { sql } from "drizzle-orm";
import type { MiddlewareHandler } from "hono";
import { createMiddleware } from "hono/factory";
import { SandboxdError } from "../../contracts/errors.ts";
import type { Db } from "../../db/client.ts";
import type { Clock, HonoEnv } from "../deps.ts";

/**
 * How long a lease may be spent. 50 ms: a lease is then counted for 1.05 s, so a key spread over
 * gateways still gets 100/1.05 = 95 requests per second at least (within the 10% the limit may
 * be off), and at the full rate one gateway asks the database ~20 times a second instead of 100.
 */
export const LEASE_MS = 50;
/**
 * The largest lease: a tenth of the default limit, so a burst takes ten round trips per second
 * and the permits one gateway holds unspent when traffic moves to another stay small.
 */
const MAX_LEASE = 10;
/** Keys tracked before idle ones are swept: bounds memory under a flood of distinct keys. */
const SWEEP_AT_KEYS = 100_000;

interface KeyState {
  /** Leased requests not yet spent, valid before `leaseEnd` (this gateway's clock). */
  permits: number;
  leaseEnd: number;
  /** The lease's end in the database (its `until_ms`): what unspent permits are returned to. */
  grantUntil: number;
  /** The database refused until then: refuse here without asking. */
  deniedUntil: number;
  /** The one question to the database in flight for this key, and how many wait for it. */
  pending: Promise<void> | undefined;
  waiters: number;
  /** Requests that arrived since the last question, and when that was: the key's local rate. */
  arrivals: number;
  since: number;
}

export interface SharedLimiterOptions {
  db: Db;
  limit: number;
  clock: Clock;
  /** 0 turns the local fast path off: every request asks the database (measurements only). */
  leaseMs?: number;
}

/** The shared limiter of one gateway process. */
export class SharedRateLimiter {
  private readonly keys = new Map<string, KeyState>();
  private readonly windowMs: number;
  private readonly leaseMs: number;
  /** Questions asked of the database (tests and measurements: most requests should ask none). */
  dbCalls = 0;

  constructor(private readonly opts: SharedLimiterOptions) {
    // The API's second (docs/limits.md "Public API limits").
    this.windowMs = 1000;
    this.leaseMs = opts.leaseMs ?? LEASE_MS;
  }

  /** Counts a request; resolves 0 when allowed, else the seconds until one would be. */
  async take(key: string): Promise<number> {
    const s = this.state(key);
    s.arrivals++;
    for (;;) {
      const now = this.opts.clock();
      if (s.permits > 0 && now < s.leaseEnd) {
        s.permits--;
        return 0;
      }
      if (now < s.deniedUntil) return (s.deniedUntil - now) / 1000;
      if (s.pending) {
        s.waiters++;
        await s.pending;
        s.waiters--;
        continue;
      }
      const asked = this.ask(key, s, now);
      // What waiters wait for: settles either way (the asker alone reports a failure).
      const settled = () => {
        s.pending = undefined;
      };
      s.pending = asked.then(settled, settled);
      // The asker spends the first request of its grant itself: it asked at `now`.
      if ((await asked) > 0) return 0;
    }
  }

  /** Asks the database for a lease; the asker's own request is taken out of it. */
  private async ask(key: string, s: KeyState, now: number): Promise<number> {
    // The lease: what this gateway expects to spend in the next leaseMs at its recent rate, at
    // least everyone waiting here now.
    const rate = s.arrivals / Math.max(now - s.since, 1);
    const want = Math.max(1, Math.min(MAX_LEASE, Math.max(1 + s.waiters, Math.round(rate * this.leaseMs))));
    s.arrivals = 0;
    s.since = now;
    // A lease that ended unspent gives its rest back in the same call: a prediction that was
    // too high costs the key nothing.
    const returned = s.permits;
    s.permits = 0;
    this.dbCalls++;
    const [row] = await this.opts.db
      .select({
        granted: sql<number>`granted`.mapWith(Number),
        retryMs: sql<number>`retry_ms`.mapWith(Number),
        untilMs: sql<number>`until_ms`.mapWith(Number),
      })
      .from(
        sql`sandboxd_rate_take(${key}, ${this.leaseMs > 0 ? want : 1}::integer, ${this.opts.limit}::integer,
          ${now}::double precision, ${this.windowMs}::double precision, ${this.leaseMs}::double precision,
          ${s.grantUntil}::double precision, ${returned}::integer)`,
      );
    const granted = row?.granted ?? 0;
    if (granted > 0) {
      // Counted by the database from `now`: spent before now + leaseMs, or returned.
      s.permits = granted - 1;
      s.leaseEnd = now + Math.max(this.leaseMs, 1);
      s.grantUntil = row?.untilMs ?? 0;
    } else {
      s.permits = 0;
      // At least a millisecond: a refusal is never retried in a loop without time passing.
      s.deniedUntil = now + Math.max(row?.retryMs ?? this.windowMs, 1);
    }
    return granted;
  }

  private state(key: string): KeyState {
    let s = this.keys.get(key);
    if (!s) {
      if (this.keys.size >= SWEEP_AT_KEYS) this.sweep(this.opts.clock());
      s = {
        permits: 0,
        leaseEnd: 0,
        grantUntil: 0,
        deniedUntil: 0,
        pending: undefined,
        waiters: 0,
        arrivals: 0,
        // As if idle for a window: a key's first request asks for itself alone.
        since: this.opts.clock() - this.windowMs,
      };
      this.keys.set(key, s);
    }
    return s;
  }

  /** Drops keys with nothing in flight and no request for a window: their state is spent. */
  private sweep(now: number): void {
    for (const [k, s] of this.keys) {
      if (!s.pending && now - s.since >= this.windowMs && now >= s.leaseEnd && now >= s.deniedUntil) {
        this.keys.delete(k);
      }
    }
  }
}

/** What `keyRateLimit` asks: 0 to allow one request of `key`, else the seconds until one would be. */
export interface RateLimiter {
  take(key: string): Promise<number>;
}

/**
 * The same sliding window kept in this process: the times of the key's grants in the last second
 * (at most `limit` of them); a request is allowed while fewer than `limit` are younger than a
 * second. For a database only this process opens (PGlite), where it is the whole truth.
 */
export class LocalRateLimiter implements RateLimiter {
  /** Per key, its grants' times in order: a ring of `limit` slots, oldest at `next`. */
  private readonly keys = new Map<string, { times: Float64Array; next: number; last: number }>();
  private readonly windowMs = 1000; // the API's second

  constructor(private readonly opts: { limit: number; clock: Clock }) {}

  async take(key: string): Promise<number> {
    const now = this.opts.clock();
    let s = this.keys.get(key);
    if (!s) {
      if (this.keys.size >= SWEEP_AT_KEYS) this.sweep(now);
      // -Infinity: a slot never granted lies outside every window.
      s = { times: new Float64Array(this.opts.limit).fill(Number.NEGATIVE_INFINITY), next: 0, last: now };
      this.keys.set(key, s);
    }
    // The oldest of the last `limit` grants: a `limit + 1`st inside its second is refused.
    const oldest = s.times[s.next]!;
    if (now - oldest < this.windowMs) return Math.max(oldest + this.windowMs - now, 1) / 1000;
    s.times[s.next] = now;
    s.next = (s.next + 1) % s.times.length;
    s.last = now;
    return 0;
  }

  /** Drops keys with no grant for a window: their state is spent. */
  private sweep(now: number): void {
    for (const [k, s] of this.keys) if (now - s.last >= this.windowMs) this.keys.delete(k);
  }
}

export interface KeyRateLimit {
  /**
   * Runs after `bearerKey` (it reads the principal): over the limit it throws 429
   * `rate_limited` with `retryAfterSeconds`, which the error mapping sends as `Retry-After`.
   */
  middleware: MiddlewareHandler<HonoEnv>;
  /**
   * Counts one request of `keyId` against the same window, throwing the same 429: for requests
   * authorised without the key middleware (a connect by token counts against the key that
   * minted the token).
   */
  take(keyId: string): Promise<void>;
  /** Requests of this key refused by this gateway process (`/v1/metrics`). */
  refused(keyId: string): number;
  /** The limiter, for measurements and tests. */
  limiter: RateLimiter;
}

/**
 * At most `perSecond` requests of one key in any one second, across every gateway on `db`;
 * `local` when no other process can open `db` (PGlite): the window is then kept in memory.
 */
export function keyRateLimit(
  perSecond: number,
  clock: Clock,
  db: Db,
  opts: { leaseMs?: number; local?: boolean } = {},
): KeyRateLimit {
  const limiter: RateLimiter = opts.local
    ? new LocalRateLimiter({ limit: perSecond, clock })
    : new SharedRateLimiter({
        db,
        limit: perSecond,
        clock,
        ...(opts.leaseMs !== undefined ? { leaseMs: opts.leaseMs } : {}),
      });
  const refused = new Map<string, number>();
  const take = async (keyId: string) => {
    const wait = await limiter.take(keyId);
    if (wait > 0) {
      refused.set(keyId, (refused.get(keyId) ?? 0) + 1);
      throw new SandboxdError("rate_limited", `more than ${perSecond} requests per second`, {
        details: { retryAfterSeconds: wait },
      });
    }
  };
  return {
    middleware: createMiddleware<HonoEnv>(async (c, next) => {
      await take(c.get("principal").keyId);
      await next();
    }),
    take,
    refused: (keyId) => refused.get(keyId) ?? 0,
    limiter,
  };
}
