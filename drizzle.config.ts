/** drizzle-kit: `bunx drizzle-kit generate` writes reviewed SQL migrations into migrations/. */
import { defineConfig } from "drizzle-kit";

export default defineConfig({
  dialect: "postgresql",
  schema: "./db/schema/index.ts",
  out: "./migrations",
});
