import { pgTable, text, timestamp } from "drizzle-orm/pg-core";

/**
 * A customer. Created on demand when its first key is issued (gateway/auth/keys.ts), with its home
 * region: where its sandboxes and template builds go, whichever gateway serves the call
 * (docs/regions.md "Rules of regions"). Fixed at creation. Null only on tenants made before
 * regions existed: they are served in the serving gateway's `--region`.
 */
export const tenants = pgTable("tenants", {
  id: text("id").primaryKey(), // ten_<random>
  name: text("name").notNull().unique(),
  region: text("region"),
  createdAt: timestamp("created_at", { withTimezone: true, mode: "date" }).notNull().defaultNow(),
});
