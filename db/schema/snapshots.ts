import { sql } from "drizzle-orm";
import { bigint, index, integer, jsonb, pgTable, text, timestamp } from "drizzle-orm/pg-core";
import { tenants } from "./tenants.ts";

/**
 * Snapshots a tenant keeps (docs/snapshots.md): the memory and disk of one of its sandboxes at
 * one instant, kept on the agent that took it (`agent_id`; a sandbox made from it starts there).
 * `template_pk`/`template_id` are the source sandbox's template: its disk is the base of the
 * snapshot's chain. A deleted snapshot keeps its row (`deleted_at`, state `deleted`) for the
 * sandboxes that name it in `sandboxes.snapshot_id`; the agent frees its files when the last VM
 * on them ends. `deleted_at` is where its metered interval ends: its delete, or for a `lost` one
 * (its host was lost, gateway/core/host-loss.ts) that host's last heartbeat; `state` says which,
 * and is what hides a deleted one from the API.
 */
export const snapshots = pgTable(
  "snapshots",
  {
    id: text("id").primaryKey(), // snap_<random>
    tenantId: text("tenant_id")
      .notNull()
      .references(() => tenants.id),
    sourceSandboxId: text("source_sandbox_id").notNull(),
    agentId: text("agent_id").notNull(),
    templatePk: text("template_pk").notNull(),
    templateId: text("template_id").notNull(),
    state: text("state", { enum: ["creating", "ready", "failed", "lost", "deleted"] }).notNull(),
    name: text("name"),
    labels: jsonb("labels").$type<Record<string, string>>().notNull().default(sql`'{}'::jsonb`),
    sizeBytes: bigint("size_bytes", { mode: "number" }),
    vcpus: integer("vcpus"),
    memMib: integer("mem_mib"),
    diskBytes: bigint("disk_bytes", { mode: "number" }),
    error: text("error"),
    createdAt: timestamp("created_at", { withTimezone: true, mode: "date" }).notNull().defaultNow(),
    readyAt: timestamp("ready_at", { withTimezone: true, mode: "date" }),
    deletedAt: timestamp("deleted_at", { withTimezone: true, mode: "date" }),
  },
  (t) => [index("snapshots_tenant_list_idx").on(t.tenantId, t.createdAt, t.id)],
);
