/**
 * `sandboxd migrate`: applies the database migrations and exits, for fleets that migrate as a
 * step of their own (a Kubernetes Job, a deploy hook) and start gateways with `SANDBOXD_MIGRATE=off`.
 * On PostgreSQL (DATABASE_URL) under the same advisory lock a starting gateway takes, so it may
 * run beside gateways that start; on PGlite (the data dir's) only while no service holds it.
 */
import { parseArgs } from "node:util";
import { migratePostgresLocked, openDb } from "../db/client.ts";
import { defaultDataDir } from "./config.ts";
import { databaseUrl } from "./settings.ts";

export async function cmdMigrate(args: string[]): Promise<number> {
  const { values } = parseArgs({ args, options: { "data-dir": { type: "string" } } });
  const url = databaseUrl();
  if (url) {
    await migratePostgresLocked(url);
    process.stdout.write("migrated: PostgreSQL (DATABASE_URL)\n");
    return 0;
  }
  const dataDir = values["data-dir"] ?? defaultDataDir();
  const handle = await openDb({ dataDir });
  await handle.close();
  process.stdout.write(`migrated: PGlite in ${dataDir}\n`);
  return 0;
}
