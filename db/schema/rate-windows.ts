import { doublePrecision, integer, pgTable, text } from "drizzle-orm/pg-core";

/**
 * The per-key request limit shared by every gateway replica (gateway/auth/rate-limit.ts). One row
 * per rate key (an API key's id) holding the grants still inside its window: `permits[i]`
 * requests granted, counted until `untilMs[i]` (ms since the epoch, the granting gateway's
 * clock). Read and written only by the SQL function `sandboxd_rate_take` (migration
 * 0005_rate_limit.sql), which decides one key's grants one at a time under the row's lock.
 */
export const rateWindows = pgTable("rate_windows", {
  key: text("key").primaryKey(),
  untilMs: doublePrecision("until_ms").array().notNull().default([]),
  permits: integer("permits").array().notNull().default([]),
});
