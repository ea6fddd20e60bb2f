import { index, pgTable, text, timestamp } from "drizzle-orm/pg-core";
import { tenants } from "./tenants.ts";

/**
 * API keys `svc_<tier>[_<region>]_<id>_<secret>` (docs/keys-and-auth.md "API keys"). The secret is never stored: only
 * HMAC-SHA256(pepper, full key) where the pepper is a server secret outside the db, so a leaked
 * table can neither be used nor brute-forced offline. `id` is the key's id segment (lookup);
 * `prefix` (`svc_<tier>[_<region>]_<id>`) is what listings show.
 */
export const apiKeys = pgTable(
  "api_keys",
  {
    id: text("id").primaryKey(),
    tenantId: text("tenant_id")
      .notNull()
      .references(() => tenants.id),
    tier: text("tier", { enum: ["live", "scale", "demo", "pro", "enterprise"] }).notNull(),
    prefix: text("prefix").notNull(),
    name: text("name").notNull().default(""),
    /** Hex HMAC-SHA256(pepper, key). */
    hash: text("hash").notNull(),
    createdAt: timestamp("created_at", { withTimezone: true, mode: "date" }).notNull().defaultNow(),
    revokedAt: timestamp("revoked_at", { withTimezone: true, mode: "date" }),
  },
  (t) => [index("api_keys_tenant_idx").on(t.tenantId)],
);
