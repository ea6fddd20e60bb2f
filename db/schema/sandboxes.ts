import { sql } from "drizzle-orm";
import { bigint, index, integer, jsonb, pgTable, text, timestamp } from "drizzle-orm/pg-core";
import { agents } from "./agents.ts";
import { templates } from "./templates.ts";
import { tenants } from "./tenants.ts";

/**
 * Every live VM a tenant holds: the sessions API sessions (`sess_`) and one-shot execs (`exec_`), sandboxes API
 * sandboxes (`sbx_`).
 * Rows are kept after destruction (state `destroyed`, `end_reason`) so that a reclaimed session
 * answers 410 rather than 404 and usage keeps its history. Allowed state changes are listed in
 * gateway/core/record-states.ts.
 */
export const sandboxes = pgTable(
  "sandboxes",
  {
    id: text("id").primaryKey(),
    tenantId: text("tenant_id")
      .notNull()
      .references(() => tenants.id),
    api: text("api", { enum: ["sessions", "sandboxes"] }).notNull(),
    /** `exec`: a sessions API one-shot exec (`/v1/exec`, each item of a batch), live for its call. */
    kind: text("kind", { enum: ["session", "sandbox", "exec"] }).notNull(),
    templatePk: text("template_pk")
      .notNull()
      .references(() => templates.pk),
    /** The template id as the client named it. */
    templateId: text("template_id").notNull(),
    agentId: text("agent_id")
      .notNull()
      .references(() => agents.id),
    /** The agent's handle; null until the agent has created the VM. */
    vmId: text("vm_id"),
    parentId: text("parent_id"),
    state: text("state", { enum: ["starting", "running", "suspended", "destroyed"] }).notNull(),
    /**
     * `host_lost`: its agent went silent past the lost bound (gateway/core/host-loss.ts);
     * `expired`: deleted at its absolute deadline (`on_timeout: delete`, gateway/core/lifetimes.ts).
     */
    endReason: text("end_reason", { enum: ["deleted", "reaped", "failed", "host_lost", "expired"] }),
    /**
     * Why it ended, in words, when the gateway did not end it itself: the agent's reason for a VM
     * that died (`QEMU exited (signal SIGKILL)`), or what reconciliation found.
     */
    endDetail: text("end_detail"),
    /**
     * A suspend or resume on its way (the agent is being asked): the record already counts
     * toward the quota of the state it goes to (gateway/core/sandboxes.ts). Taken under the
     * tenant's lock, cleared when the change is recorded or fails; `hold_until` ends a hold whose
     * gateway died during the call.
     */
    hold: text("hold", { enum: ["suspend", "resume"] }),
    holdUntil: timestamp("hold_until", { withTimezone: true, mode: "date" }),
    labels: jsonb("labels").$type<Record<string, string>>().notNull().default(sql`'{}'::jsonb`),
    endpoints: jsonb("endpoints").$type<Record<string, string>>().notNull().default(sql`'{}'::jsonb`),
    vcpus: integer("vcpus").notNull().default(0),
    memMib: integer("mem_mib").notNull().default(0),
    diskBytes: bigint("disk_bytes", { mode: "number" }).notNull().default(0),
    execCount: integer("exec_count").notNull().default(0),
    /**
     * Session execs running now, counted up when one starts and down when it ends (its
     * `last_exec_at` is set at both): the idle reaper never reclaims a session while one runs,
     * however long it takes, whichever gateway serves it.
     */
    execsInFlight: integer("execs_in_flight").notNull().default(0),
    /**
     * The idle lifetime in force, seconds: the sandboxes API, the one asked for at create or the
     * operator's default then (null: none); The sessions API, the session's own TTL (null: the operator's
     * TTL). The reaper applies `idle_action` past it (gateway/core/idle.ts).
     */
    idleTimeoutS: integer("idle_timeout_s"),
    idleAction: text("idle_action", { enum: ["suspend", "delete"] }),
    /**
     * Who suspended it, or is suspending it (with `hold`): `idle` (the reaper) or `timeout` (its
     * absolute deadline), whose next call resumes it transparently, or `user` (a suspend call;
     * calls are refused until a resume). Null while running otherwise.
     */
    suspendedBy: text("suspended_by", { enum: ["user", "idle", "timeout"] }),
    /**
     * The absolute lifetime (sandboxes API): past `expires_at` the service applies `on_timeout`,
     * whatever the sandbox is doing. `timeout_s` is the lifetime last asked for (at create or by
     * `POST .../timeout`), counted from that call. Null: no absolute lifetime.
     */
    timeoutS: integer("timeout_s"),
    expiresAt: timestamp("expires_at", { withTimezone: true, mode: "date" }),
    onTimeout: text("on_timeout", { enum: ["suspend", "delete"] }),
    /** The snapshot it was created from (`POST /v1/sandboxes` with `snapshot`); null: a template. */
    snapshotId: text("snapshot_id"),
    createdAt: timestamp("created_at", { withTimezone: true, mode: "date" }).notNull(),
    lastExecAt: timestamp("last_exec_at", { withTimezone: true, mode: "date" }),
    destroyedAt: timestamp("destroyed_at", { withTimezone: true, mode: "date" }),
  },
  (t) => [
    index("sandboxes_tenant_state_idx").on(t.tenantId, t.api, t.state),
    index("sandboxes_template_state_idx").on(t.templatePk, t.state),
    index("sandboxes_state_idle_idx").on(t.kind, t.state, t.lastExecAt),
    // Lifetimes due: the deadline timer and the reaper read the earliest live ones.
    index("sandboxes_expires_idx").on(t.expiresAt),
    // Lists: a tenant's rows of one API in a stable order (created_at, id), paged by cursor.
    index("sandboxes_tenant_list_idx").on(t.tenantId, t.api, t.createdAt, t.id),
  ],
);
