import { describe, expect, test } from "bun:test";
import fc from "fast-check";
import { Hono } from "hono";
import type { HonoEnv } from "../deps.ts";
import { errorResponse } from "../errors.ts";
import { keyRateLimit, RateLimiter } from "./rate-limit.ts";

test("100 at once are allowed, the 101st waits until the oldest leaves the window", () => {
  let now = 5_000;
  const rl = new RateLimiter(100, 1000, () => now);
  for (let i = 0; i < 100; i++) expect(rl.take("k")).toBe(0);
  expect(rl.take("k")).toBeCloseTo(1, 5);
  now += 600;
  expect(rl.take("k")).toBeCloseTo(0.4, 5);
  expect(rl.take("other")).toBe(0); // keys are independent
  now += 400; // the first 100 all leave the window together: a full allowance again
  for (let i = 0; i < 100; i++) expect(rl.take("k")).toBe(0);
  expect(rl.take("k")).toBeCloseTo(1, 5);
});

test("property: no one-second interval ever holds more than the limit of allowed requests", () => {
  fc.assert(
    fc.property(
      fc.integer({ min: 1, max: 20 }),
      fc.array(fc.integer({ min: 0, max: 300 }), { minLength: 1, maxLength: 400 }),
      (limit, gaps) => {
        let now = 0;
        const rl = new RateLimiter(limit, 1000, () => now);
        const allowed: number[] = [];
        for (const gap of gaps) {
          now += gap;
          if (rl.take("k") === 0) allowed.push(now);
        }
        // allowed is sorted: any window of 1000 ms starting at an allowed request holds <= limit.
        for (let i = 0; i + limit < allowed.length; i++) {
          if (allowed[i + limit]! - allowed[i]! < 1000) return false;
        }
        return true;
      },
    ),
  );
});

describe("keyRateLimit middleware", () => {
  /** The limit after a stand-in for the key middleware: the key id is the `x-key` header. */
  function limitedApp(perSecond: number) {
    const now = { ms: 1_000_000 };
    const limit = keyRateLimit(perSecond, () => now.ms);
    const app = new Hono<HonoEnv>();
    app.onError((err, c) => errorResponse(err, c, () => {}));
    app.use("*", async (c, next) => {
      c.set("principal", { tenantId: "t", keyId: c.req.header("x-key") ?? "k", tier: "live", family: "a" });
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
    for (let i = 0; i < 3; i++) expect((await get("k1")).status).toBe(200);
    const over = await get("k1");
    expect(over.status).toBe(429);
    expect(handled.n).toBe(3); // a refused request never reaches the handler
    expect(over.headers.get("retry-after")).toBe("1");
    expect(await over.json()).toEqual({ code: "rate_limited", message: "more than 3 requests per second" });
    expect(limit.refused("k1")).toBe(1);

    expect((await get("k2")).status).toBe(200); // keys are independent
    expect(limit.refused("k2")).toBe(0);

    now.ms += 999; // still inside the window of the first three
    expect((await get("k1")).status).toBe(429);
    expect(limit.refused("k1")).toBe(2);
    now.ms += 1; // the first three leave the window together
    for (let i = 0; i < 3; i++) expect((await get("k1")).status).toBe(200);
    expect((await get("k1")).status).toBe(429);
  });

  test("Retry-After is whole seconds, at least 1, however close the next slot is", async () => {
    const { now, get } = limitedApp(1);
    expect((await get("k")).status).toBe(200);
    now.ms += 990;
    const over = await get("k");
    expect(over.status).toBe(429);
    expect(over.headers.get("retry-after")).toBe("1");
  });
});
