import { pgTable, text, timestamp } from "drizzle-orm/pg-core";

/**
 * The fingerprints of the secrets every gateway sharing this database must hold alike
 * (docs/operations.md "Secrets across a fleet"): an HMAC of a fixed label under each secret, so
 * the row says nothing of the secret. The first gateway to start writes them; each later one
 * compares its own and refuses to start on a difference, instead of serving keys it cannot
 * verify, connect URLs others reject or agents it cannot speak to.
 */
export const fleetSecrets = pgTable("fleet_secrets", {
  /** `key_pepper`, `connect_secret`, `agent_secret`. */
  name: text("name").primaryKey(),
  fingerprint: text("fingerprint").notNull(),
  setAt: timestamp("set_at", { withTimezone: true, mode: "date" }).notNull().defaultNow(),
});
