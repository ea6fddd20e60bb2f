/**
 * The shared per-key limit over a real PGlite db (the SQL function of migration 0005 decides),
 * with a controlled clock: the sliding window, leases and their longer count, two limiters (two
 * gateway processes' worth) sharing one key's limit, the local fast path's round trips, and the
 * middleware's 429 with Retry-After. tests/e2e/rate-limit-replicas.test.ts runs two real gateways on
 * PostgreSQL.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import fc from "fast-check";
import { Hono } from "hono";
import { type DbHandle, openDb } from "../../db/client.ts";
import type { HonoEnv } from "../deps.ts";
import { errorResponse } from "../errors.ts";
import { keyRateLimit, LEASE_MS, LocalRateLimiter, SharedRateLimiter } from "./rate-limit.ts";

let dir: string;
let handle: DbHandle;
let keyNo = 0;
/** A key no other test has used (all tests share the db's rate_windows). */
const freshKey = () => `key-${++keyNo}`;

beforeAll(async () => {
  dir = mkdtempSync(join(tmpdir(), "sandboxd-rate-"));
  handle = await openDb({ dataDir: dir });
});
afterAll(async () => {
  await handle.close();
  rmSync(dir, { recursive: true, force: true });
});

function limiter(limit: number, now: { ms: number }, leaseMs?: number) {
  return new SharedRateLimiter({
    db: handle.db,
    limit,
    clock: () => now.ms,
    ...(leaseMs !== undefined ? { leaseMs } : {}),
  });
}

test("100 one after another are allowed, the 101st waits until the oldest leaves the window", async () => {
  const now = { ms: 5_000_000 };
  const rl = limiter(100, now, 0); // no leases: every grant is one request, counted one second
  const k = freshKey();
  for (let i = 0; i < 100; i++) expect(await rl.take(k)).toBe(0);
  expect(await rl.take(k)).toBeCloseTo(1, 5);
  now.ms += 600;
  expect(await rl.take(k)).toBeCloseTo(0.4, 5);
  expect(await rl.take(freshKey())).toBe(0); // keys are independent
  now.ms += 400; // the first 100 all leave the window together: a full allowance again
  for (let i = 0; i < 100; i++) expect(await rl.take(k)).toBe(0);
  expect(await rl.take(k)).toBeCloseTo(1, 5);
});

test("a burst is leased in blocks, and a lease counts one second plus LEASE_MS", async () => {
  const now = { ms: 6_000_000 };
  const rl = limiter(100, now);
  const k = freshKey();
  const waits = await Promise.all(Array.from({ length: 300 }, () => rl.take(k)));
  expect(waits.filter((w) => w === 0)).toHaveLength(100);
  // 100 granted in leases of at most 10, then one refusal remembered for the other 199.
  expect(rl.dbCalls).toBeLessThanOrEqual(100 / 10 + 2);
  now.ms += 999;
  expect(await rl.take(k)).toBeGreaterThan(0);
  // All 100 are free again only once the leases' longer count has passed.
  now.ms += 1 + LEASE_MS;
  const again = await Promise.all(Array.from({ length: 101 }, () => rl.take(k)));
  expect(again.filter((w) => w === 0)).toHaveLength(100);
});

test("property: no one-second interval holds more than the limit, over two limiters on one db", async () => {
  await fc.assert(
    fc.asyncProperty(
      fc.integer({ min: 1, max: 4 }),
      fc.array(
        fc.tuple(
          // Gaps near the lease and the window's edges, where a late-spent lease would show.
          fc.oneof(fc.integer({ min: 0, max: 120 }), fc.constantFrom(LEASE_MS - 1, 950, 960, 999, 1000)),
          fc.integer({ min: 1, max: 6 }),
          fc.boolean(),
        ),
        { minLength: 1, maxLength: 60 },
      ),
      async (limit, steps) => {
        const now = { ms: 7_000_000 };
        const a = limiter(limit, now);
        const b = limiter(limit, now);
        const k = freshKey();
        // Each allowed request is spent at the time it was allowed (leases: inside LEASE_MS).
        const allowed: number[] = [];
        for (const [gap, burst, onA] of steps) {
          now.ms += gap;
          const waits = await Promise.all(Array.from({ length: burst }, () => (onA ? a : b).take(k)));
          for (const w of waits) if (w === 0) allowed.push(now.ms);
        }
        for (let i = 0; i + limit < allowed.length; i++) {
          if (allowed[i + limit]! - allowed[i]! < 1000) return false;
        }
        return true;
      },
    ),
    { numRuns: 400 },
  );
}, 60_000);

test("at a steady 100 requests a second most requests ask the database nothing", async () => {
  const now = { ms: 8_000_000 };
  const rl = limiter(100, now);
  const k = freshKey();
  let ok = 0;
  const n = 400; // four seconds at one request every 10 ms
  for (let i = 0; i < n; i++) {
    if ((await rl.take(k)) === 0) ok++;
    now.ms += 10;
  }
  // Leases are counted 1.05 s: at least 100/1.05 per second get through, never more than 100.
  expect(ok).toBeGreaterThanOrEqual(Math.floor((n / 100) * (100 / 1.05)) - 10);
  expect(ok).toBeLessThanOrEqual(n);
  expect(rl.dbCalls).toBeLessThan(n / 2);
});

describe("keyRateLimit middleware", () => {
  /** The limit after a stand-in for the key middleware: the key id is the `x-key` header. */
  function limitedApp(perSecond: number) {
    const now = { ms: 9_000_000 + keyNo * 10_000 };
    const limit = keyRateLimit(perSecond, () => now.ms, handle.db);
    const app = new Hono<HonoEnv>();
    app.onError((err, c) => errorResponse(err, c, () => {}));
    app.use("*", async (c, next) => {
      c.set("principal", {
        tenantId: "t",
        keyId: c.req.header("x-key") ?? "k",
        tier: "live",
        api: "sessions",
      });
      await next();
    });
    app.use("*", limit.middleware);
    const handled = { n: 0 };
    app.get("/", (c) => {
      handled.n++;
      return c.text("ok");
    });
    const get = (key: string) => Promise.resolve(app.request("/", { headers: { "x-key": key } }));
    return { now, limit, get, handled };
  }

  test("the N+1st request of a key in one second is 429 rate_limited with Retry-After", async () => {
    const { now, limit, get, handled } = limitedApp(3);
    const k1 = freshKey();
    const k2 = freshKey();
    for (let i = 0; i < 3; i++) expect((await get(k1)).status).toBe(200);
    const over = await get(k1);
    expect(over.status).toBe(429);
    expect(handled.n).toBe(3); // a refused request never reaches the handler
    expect(over.headers.get("retry-after")).toBe("1");
    expect(await over.json()).toEqual({ code: "rate_limited", message: "more than 3 requests per second" });
    expect(limit.refused(k1)).toBe(1);

    expect((await get(k2)).status).toBe(200); // keys are independent
    expect(limit.refused(k2)).toBe(0);

    now.ms += 999; // still inside the window of the first three
    expect((await get(k1)).status).toBe(429);
    expect(limit.refused(k1)).toBe(2);
    now.ms += 1 + LEASE_MS; // the first three leave the window together (leased: 1 s + LEASE_MS)
    for (let i = 0; i < 3; i++) expect((await get(k1)).status).toBe(200);
    expect((await get(k1)).status).toBe(429);
  });

  test("Retry-After is whole seconds, at least 1, however close the next slot is", async () => {
    const { now, get } = limitedApp(1);
    const k = freshKey();
    expect((await get(k)).status).toBe(200);
    now.ms += 990;
    const over = await get(k);
    expect(over.status).toBe(429);
    expect(over.headers.get("retry-after")).toBe("1");
  });
});

describe("LocalRateLimiter (a database only this process opens)", () => {
  test("no second holds more than the limit; the next grant is due when the oldest leaves", async () => {
    let now = 10_000;
    const l = new LocalRateLimiter({ limit: 3, clock: () => now });
    for (let i = 0; i < 3; i++) expect(await l.take("k")).toBe(0);
    expect(await l.take("k")).toBe(1); // all three at t: a whole second to wait
    expect(await l.take("other")).toBe(0); // keys are apart
    now += 400;
    expect(await l.take("k")).toBeCloseTo(0.6, 5);
    now += 600; // the first three leave the window
    expect(await l.take("k")).toBe(0);
    expect(await l.take("k")).toBe(0);
    expect(await l.take("k")).toBe(0);
    expect(await l.take("k")).toBe(1);
  });

  test("the same property as the shared limiter: any one-second interval holds at most `limit`", async () => {
    await fc.assert(
      fc.asyncProperty(
        fc.array(fc.integer({ min: 0, max: 40 }), { minLength: 1, maxLength: 300 }),
        async (gaps) => {
          let now = 0;
          const limit = 7;
          const l = new LocalRateLimiter({ limit, clock: () => now });
          const granted: number[] = [];
          for (const g of gaps) {
            now += g;
            if ((await l.take("k")) === 0) granted.push(now);
          }
          for (let i = limit; i < granted.length; i++)
            expect(granted[i]! - granted[i - limit]!).toBeGreaterThanOrEqual(1000);
        },
      ),
    );
  });
});
