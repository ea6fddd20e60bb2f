import { expect, test } from "bun:test";
import fc from "fast-check";
import { RateLimiter } from "./rate-limit.ts";

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
