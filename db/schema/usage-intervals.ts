import { sql } from "drizzle-orm";
import {
  bigint,
  bigserial,
  index,
  integer,
  pgTable,
  text,
  timestamp,
  uniqueIndex,
} from "drizzle-orm/pg-core";
import { sandboxes } from "./sandboxes.ts";
import { tenants } from "./tenants.ts";

/**
 * Metering: one row per stretch of time a sandbox spent in one billable state with one size.
 * A state change closes the open row (ended_at) and opens the next; at most one row per sandbox
 * is open. Usage over a window is computed in SQL from the overlap (gateway/core/usage.ts).
 * - running: vCPUs, memory and disk are billed.
 * - paused (a session between calls: no scheduled CPU): memory and disk.
 * - suspended: only the on-disk snapshot (memory image + disk), as `disk_bytes`.
 */
export const usageIntervals = pgTable(
  "usage_intervals",
  {
    id: bigserial("id", { mode: "number" }).primaryKey(),
    sandboxId: text("sandbox_id")
      .notNull()
      .references(() => sandboxes.id),
    tenantId: text("tenant_id")
      .notNull()
      .references(() => tenants.id),
    state: text("state", { enum: ["running", "paused", "suspended"] }).notNull(),
    vcpus: integer("vcpus").notNull(),
    memMib: integer("mem_mib").notNull(),
    diskBytes: bigint("disk_bytes", { mode: "number" }).notNull(),
    startedAt: timestamp("started_at", { withTimezone: true, mode: "date" }).notNull(),
    endedAt: timestamp("ended_at", { withTimezone: true, mode: "date" }),
  },
  (t) => [
    index("usage_tenant_time_idx").on(t.tenantId, t.startedAt),
    uniqueIndex("usage_one_open_per_sandbox").on(t.sandboxId).where(sql`${t.endedAt} is null`),
  ],
);
