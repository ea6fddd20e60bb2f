/**
 * Opens the gateway's database: PGlite (Postgres compiled to WASM, in-process) under
 * `<dataDir>/pglite` by default, or a real PostgreSQL when a URL is given. Both go through
 * drizzle with the same schema, and the committed migrations (migrations/, drizzle-kit output)
 * are applied on open. There is no global db: callers pass the returned handle around.
 */
import { mkdirSync } from "node:fs";
import { join } from "node:path";
import { PGlite } from "@electric-sql/pglite";
import type { PgDatabase, PgQueryResultHKT } from "drizzle-orm/pg-core";
import { drizzle as drizzlePglite } from "drizzle-orm/pglite";
import { migrate as migratePglite } from "drizzle-orm/pglite/migrator";
import { drizzle as drizzlePostgres } from "drizzle-orm/postgres-js";
import { migrate as migratePostgres } from "drizzle-orm/postgres-js/migrator";
import postgres from "postgres";
import { SandboxdError } from "../contracts/errors.ts";
import { lockDir } from "./lock.ts";
import * as schema from "./schema/index.ts";

export type Schema = typeof schema;
/** What both drivers share; the gateway only uses this. */
export type Db = PgDatabase<PgQueryResultHKT, Schema>;

export interface DbHandle {
  db: Db;
  kind: "pglite" | "postgres";
  close(): Promise<void>;
}

export type OpenDbOptions = { dataDir: string } | { url: string };

// import.meta.dirname (not Bun's import.meta.dir): the gateway also runs under Node and Deno.
export const MIGRATIONS_DIR = join(import.meta.dirname, "..", "migrations");

export async function openDb(opts: OpenDbOptions): Promise<DbHandle> {
  if ("url" in opts) {
    // max 10: the gateway is stateless and runs several replicas; 10 each is well under the
    // default max_connections (100) of a small Postgres.
    const client = postgres(opts.url, { max: 10, onnotice: () => {} });
    const db = drizzlePostgres(client, { schema });
    try {
      await migratePostgres(db, { migrationsFolder: MIGRATIONS_DIR });
    } catch (cause) {
      await client.end({ timeout: 1 });
      throw new SandboxdError("internal", "cannot migrate the PostgreSQL database", { cause });
    }
    return {
      db: db as unknown as Db,
      kind: "postgres",
      close: () => client.end({ timeout: 5 }),
    };
  }
  const dir = join(opts.dataDir, "pglite");
  mkdirSync(dir, { recursive: true });
  // PGlite has no lock of its own: a second process on the directory would be a second writer.
  const lock = lockDir(dir);
  const client = new PGlite(dir);
  const db = drizzlePglite(client, { schema });
  try {
    await migratePglite(db, { migrationsFolder: MIGRATIONS_DIR });
  } catch (cause) {
    await client.close().finally(() => lock.release());
    throw new SandboxdError("internal", `cannot migrate the PGlite database in ${dir}`, { cause });
  }
  return {
    db: db as unknown as Db,
    kind: "pglite",
    close: () => client.close().finally(() => lock.release()),
  };
}
