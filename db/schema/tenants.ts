import { pgTable, text, timestamp } from "drizzle-orm/pg-core";

/** A customer. Created on demand when its first key is issued (gateway/auth/keys.ts). */
export const tenants = pgTable("tenants", {
  id: text("id").primaryKey(), // ten_<random>
  name: text("name").notNull().unique(),
  createdAt: timestamp("created_at", { withTimezone: true, mode: "date" }).notNull().defaultNow(),
});
