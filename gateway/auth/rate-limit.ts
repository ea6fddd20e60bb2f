/**
 * Per-key sliding-window limit (spec 8: 100 requests per second per key, 429 beyond): a request
 * is allowed when fewer than `limit` requests of the same key were allowed in the last
 * `windowMs`. Unlike a token bucket refilling while a burst runs (which let up to ~2x the rate
 * through inside one second), no one-second interval ever holds more than `limit` allowed
 * requests. Each key keeps a ring of its last `limit` allowed request times. State is per gateway
 * process: with N replicas behind a balancer a key can reach N times the rate (decisions.md).
 */

import type { MiddlewareHandler } from "hono";
import { createMiddleware } from "hono/factory";
import { SandboxdError } from "../../contracts/errors.ts";
import type { Clock, HonoEnv } from "../deps.ts";

interface Window {
  /** Times (ms) of the last `limit` allowed requests, oldest at `next`. */
  times: Float64Array;
  next: number;
}

/** Keys tracked before idle ones are swept: bounds memory under a flood of distinct keys. */
const SWEEP_AT_KEYS = 100_000;

export class RateLimiter {
  private readonly windows = new Map<string, Window>();
  constructor(
    private readonly limit: number,
    private readonly windowMs: number,
    private readonly clock: Clock,
  ) {}

  /** Counts a request; returns 0 when allowed, else the seconds until one would be. */
  take(key: string): number {
    const now = this.clock();
    let w = this.windows.get(key);
    if (!w) {
      if (this.windows.size >= SWEEP_AT_KEYS) this.sweep(now);
      // -Infinity: "allowed long ago", outside any window.
      w = { times: new Float64Array(this.limit).fill(Number.NEGATIVE_INFINITY), next: 0 };
      this.windows.set(key, w);
    }
    const oldest = w.times[w.next]!;
    if (now - oldest < this.windowMs) return (oldest + this.windowMs - now) / 1000;
    w.times[w.next] = now;
    w.next = (w.next + 1) % this.limit;
    return 0;
  }

  /** Drops keys with no request inside the window (their newest time is old). */
  private sweep(now: number): void {
    for (const [k, w] of this.windows) {
      const newest = w.times[(w.next + this.limit - 1) % this.limit]!;
      if (now - newest >= this.windowMs) this.windows.delete(k);
    }
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
  take(keyId: string): void;
  /** Requests of this key refused by this gateway process (`/v1/metrics`). */
  refused(keyId: string): number;
}

/** At most `perSecond` requests of one key in any one second. */
export function keyRateLimit(perSecond: number, clock: Clock): KeyRateLimit {
  const limiter = new RateLimiter(perSecond, 1000, clock);
  const refused = new Map<string, number>();
  const take = (keyId: string) => {
    const wait = limiter.take(keyId);
    if (wait > 0) {
      refused.set(keyId, (refused.get(keyId) ?? 0) + 1);
      throw new SandboxdError("rate_limited", `more than ${perSecond} requests per second`, {
        details: { retryAfterSeconds: wait },
      });
    }
  };
  return {
    middleware: createMiddleware<HonoEnv>(async (c, next) => {
      take(c.get("principal").keyId);
      await next();
    }),
    take,
    refused: (keyId) => refused.get(keyId) ?? 0,
  };
}
