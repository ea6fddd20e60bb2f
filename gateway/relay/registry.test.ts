import { expect, test } from "bun:test";
import { RelayRegistry } from "./registry.ts";

test("reserve: a tenant takes at most `max` slots; a release frees one, once", () => {
  const r = new RelayRegistry();
  const held = [r.reserve("t1", 2), r.reserve("t1", 2)];
  expect(held.every((x) => x !== undefined)).toBe(true);
  expect(r.reserve("t1", 2)).toBeUndefined();
  // Another tenant is not affected.
  expect(r.reserve("t2", 2)).toBeDefined();
  held[0]!();
  held[0]!(); // idempotent: does not free a second slot
  expect(r.held("t1")).toBe(1);
  expect(r.reserve("t1", 2)).toBeDefined();
  expect(r.reserve("t1", 2)).toBeUndefined();
});
