import { sql } from "drizzle-orm";
import { boolean, integer, jsonb, pgTable, text, timestamp } from "drizzle-orm/pg-core";

/**
 * Host agents the gateway can place VMs on: the gateway decides where a sandbox runs, the agent how.
 * An agent's row is made when it enrolls (gateway/agents/enrollment.ts), with the region (and, if
 * pinned, the URL) its enrollment token named; its heartbeats keep capacity and an unpinned URL
 * current, never the region. `keyId` names the agent's current key: the key itself is derived
 * from it and the gateway's agent secret, so the table holds nothing an agent could sign with.
 * No `keyId` (never enrolled, or revoked): nothing from or to this agent is accepted.
 */
export const agents = pgTable("agents", {
  id: text("id").primaryKey(),
  region: text("region").notNull(),
  url: text("url").notNull(),
  slotsTotal: integer("slots_total").notNull().default(0),
  slotsFree: integer("slots_free").notNull().default(0),
  vcpusFree: integer("vcpus_free").notNull().default(0),
  memMibFree: integer("mem_mib_free").notNull().default(0),
  /** Free disk under the agent's state dir, MiB; null: not reported (no disk check). */
  diskMibFree: integer("disk_mib_free"),
  /** Agent refs of the templates ready on this agent, as last reported (placement prefers them). */
  templates: jsonb("templates").$type<string[]>().notNull().default(sql`'[]'::jsonb`),
  /**
   * Placed since the last heartbeat, by any gateway: a placement adds its VM here in the same
   * conditional UPDATE that checks the room left (reported free minus these), and each heartbeat,
   * which reports what the agent then holds, sets them back to 0 (gateway/agents/router.ts).
   */
  placedSlots: integer("placed_slots").notNull().default(0),
  placedVcpus: integer("placed_vcpus").notNull().default(0),
  placedMemMib: integer("placed_mem_mib").notNull().default(0),
  placedDiskMib: integer("placed_disk_mib").notNull().default(0),
  lastHeartbeatAt: timestamp("last_heartbeat_at", { withTimezone: true, mode: "date" }),
  createdAt: timestamp("created_at", { withTimezone: true, mode: "date" }).notNull().defaultNow(),
  keyId: text("key_id"),
  enrolledAt: timestamp("enrolled_at", { withTimezone: true, mode: "date" }),
  revokedAt: timestamp("revoked_at", { withTimezone: true, mode: "date" }),
  /**
   * Set by the one gateway that found the agent silent past the lost bound (gateway/core/host-loss.ts):
   * its sandboxes ended `host_lost`. Cleared by its next accepted heartbeat.
   */
  lostAt: timestamp("lost_at", { withTimezone: true, mode: "date" }),
  /** Cordoned (`sandboxd fleet cordon|drain`): no new VM is placed on it; null: placeable. */
  cordonedAt: timestamp("cordoned_at", { withTimezone: true, mode: "date" }),
  /** The URL is the one its enrollment token pinned: a heartbeat advertising another is refused. */
  urlPinned: boolean("url_pinned").notNull().default(false),
  /**
   * The one tenant this agent takes sandboxes of (a customer's own, BYOC host), fixed by its
   * enrollment token; null: an operator's agent, for every tenant without a pool of its own.
   */
  ownerTenant: text("owner_tenant"),
});

/**
 * Enrollment tokens (`sandboxd agent-token create`): only an HMAC of the token's secret is
 * stored. A token enrolls at most `uses` agents (1 unless made with `--uses N`, for a DaemonSet's
 * pods); `useCount` counts the enrollments it made, `usedAt`/`usedBy` name the latest. `agentId`,
 * when set, is the only id the token may enroll (and it then replaces that agent's key). `region`
 * is the region the agents it enrolls are in; `url`, when set, the only URL that agent may be
 * reached at.
 */
export const agentEnrollmentTokens = pgTable("agent_enrollment_tokens", {
  id: text("id").primaryKey(),
  hash: text("hash").notNull(),
  agentId: text("agent_id"),
  createdAt: timestamp("created_at", { withTimezone: true, mode: "date" }).notNull().defaultNow(),
  expiresAt: timestamp("expires_at", { withTimezone: true, mode: "date" }).notNull(),
  usedAt: timestamp("used_at", { withTimezone: true, mode: "date" }),
  usedBy: text("used_by"),
  /** The most enrollments this token makes; over 1 only for new ids (gateway/agents/enrollment.ts). */
  uses: integer("uses").notNull().default(1),
  useCount: integer("use_count").notNull().default(0),
  region: text("region").notNull().default("local"),
  url: text("url"),
  /** The tenant the agent it enrolls serves alone (`agent-token create --tenant`); null: any. */
  ownerTenant: text("owner_tenant"),
});
