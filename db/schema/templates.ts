import { sql } from "drizzle-orm";
import { bigint, index, integer, jsonb, pgTable, text, timestamp, uniqueIndex } from "drizzle-orm/pg-core";
import { tenants } from "./tenants.ts";

/**
 * Templates: the public catalog (`tenant_id` null) and each tenant's own. A tenant sees its own
 * and the public ones; ids are unique per owner among live rows (public ones under the owner ''),
 * and the gateway refuses a private id that shadows a public one. A deleted template keeps its row
 * (`deleted_at`) while sandbox rows still reference it, and its id becomes free again. `agent_ref` is the key the host
 * agent knows the template by.
 */
export const templates = pgTable(
  "templates",
  {
    pk: text("pk").primaryKey(), // tpl_<random>
    id: text("id").notNull(),
    tenantId: text("tenant_id").references(() => tenants.id),
    api: text("api", { enum: ["sessions", "sandboxes"] }).notNull(),
    agentRef: text("agent_ref").notNull().unique(),
    name: text("name").notNull(),
    description: text("description").notNull().default(""),
    tier: text("tier"),
    /** The sandboxes API OCI reference; null for uploaded images. */
    image: text("image"),
    /** Build request as given (sizing, ready spec, width), to check idempotent retries. */
    spec: jsonb("spec").$type<Record<string, unknown>>().notNull().default(sql`'{}'::jsonb`),
    status: text("status", { enum: ["building", "ready", "failed"] }).notNull(),
    phase: text("phase").notNull().default("Pending"),
    error: text("error"),
    exposedPorts: jsonb("exposed_ports").$type<number[]>().notNull().default(sql`'[]'::jsonb`),
    memMib: integer("mem_mib"),
    vcpuCount: integer("vcpu_count"),
    uploadBytes: bigint("upload_bytes", { mode: "number" }),
    createdAt: timestamp("created_at", { withTimezone: true, mode: "date" }).notNull().defaultNow(),
    readyAt: timestamp("ready_at", { withTimezone: true, mode: "date" }),
    deletedAt: timestamp("deleted_at", { withTimezone: true, mode: "date" }),
  },
  (t) => [
    uniqueIndex("templates_owner_id_uq")
      .on(sql`coalesce(${t.tenantId}, '')`, t.id)
      .where(sql`${t.deletedAt} is null`),
    index("templates_id_idx").on(t.id),
  ],
);
