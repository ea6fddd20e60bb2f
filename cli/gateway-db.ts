/** The gateway's database for the operator commands when no service runs them (cli/operator.ts). */
import { type Db, openDb } from "../db/client.ts";
import { databaseUrl } from "./settings.ts";

/**
 * Runs `fn` on the gateway's database: PostgreSQL when `DATABASE_URL` is set, else the PGlite
 * under `dataDir` (which only one process opens at a time, db/lock.ts: a running service holds it
 * and runs the commands itself). Closed afterwards, also on failure.
 */
export async function withGatewayDb<T>(dataDir: string, fn: (db: Db) => Promise<T>): Promise<T> {
  const url = databaseUrl();
  const handle = await openDb(url ? { url } : { dataDir });
  try {
    return await fn(handle.db);
  } finally {
    await handle.close();
  }
}
