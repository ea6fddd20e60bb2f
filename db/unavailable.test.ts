import { expect, test } from "bun:test";
import { isDbUnavailable } from "./unavailable.ts";

const withCode = (code: string) => Object.assign(new Error(code), { code });

test("connection failures anywhere in the cause chain count; query errors do not", () => {
  expect(isDbUnavailable(withCode("ECONNREFUSED"))).toBe(true);
  expect(isDbUnavailable(new Error("Failed query", { cause: withCode("CONNECTION_CLOSED") }))).toBe(true);
  expect(isDbUnavailable(new Error("wrapped", { cause: withCode("57P01") }))).toBe(true);
  expect(isDbUnavailable(withCode("08006"))).toBe(true);
  expect(isDbUnavailable(new AggregateError([withCode("ECONNREFUSED")]))).toBe(true);
  expect(isDbUnavailable(withCode("23505"))).toBe(false); // unique violation
  expect(isDbUnavailable(withCode("42P01"))).toBe(false); // undefined table
  expect(isDbUnavailable(new Error("plain"))).toBe(false);
  expect(isDbUnavailable(undefined)).toBe(false);
});
