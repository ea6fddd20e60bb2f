import { integer, pgTable, text, timestamp } from "drizzle-orm/pg-core";

/** Host agents the gateway can place VMs on: the gateway decides where a sandbox runs, the agent how. */
export const agents = pgTable("agents", {
  id: text("id").primaryKey(),
  region: text("region").notNull(),
  url: text("url").notNull(),
  slotsTotal: integer("slots_total").notNull().default(0),
  slotsFree: integer("slots_free").notNull().default(0),
  vcpusFree: integer("vcpus_free").notNull().default(0),
  memMibFree: integer("mem_mib_free").notNull().default(0),
  lastHeartbeatAt: timestamp("last_heartbeat_at", { withTimezone: true, mode: "date" }),
  createdAt: timestamp("created_at", { withTimezone: true, mode: "date" }).notNull().defaultNow(),
});
