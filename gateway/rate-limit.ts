/**
 * Per-key token bucket (spec 8: 100 requests per second per key, 429 beyond). Each key's bucket
 * holds `burst` tokens and refills at `perSecond`; a request takes one. State is per gateway
 * process: with N replicas behind a balancer a key can reach N times the rate (decisions.md).
 */
import type { Clock } from "./deps.ts";

interface Bucket {
  tokens: number;
  at: number;
}

export class RateLimiter {
  private readonly buckets = new Map<string, Bucket>();
  constructor(
    private readonly perSecond: number,
    private readonly burst: number,
    private readonly clock: Clock,
  ) {}

  /** Takes a token; returns 0 when allowed, else the seconds to wait before retrying. */
  take(key: string): number {
    const now = this.clock();
    const b = this.buckets.get(key) ?? { tokens: this.burst, at: now };
    b.tokens = Math.min(this.burst, b.tokens + ((now - b.at) / 1000) * this.perSecond);
    b.at = now;
    this.buckets.set(key, b);
    if (b.tokens >= 1) {
      b.tokens -= 1;
      return 0;
    }
    if (this.buckets.size > 100_000) this.sweep(now);
    return (1 - b.tokens) / this.perSecond;
  }

  /** Drops full buckets so the map does not grow with every key ever seen. */
  private sweep(now: number): void {
    for (const [k, b] of this.buckets) {
      if (b.tokens + ((now - b.at) / 1000) * this.perSecond >= this.burst) this.buckets.delete(k);
    }
  }
}
