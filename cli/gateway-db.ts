/** The gateway's database for the operator commands (`key`, `agent-token`). */
import { type Db, openDb } from "../db/client.ts";

/**
 * Runs `fn` on the gateway's database: PostgreSQL when `DATABASE_URL` is set, else the PGlite
 * under `dataDir` (which only one process opens at a time: the operator commands run while the
 * gateway is stopped). Closed afterwards, also on failure.
 */
export async function withGatewayDb<T>(dataDir: string, fn: (db: Db) => Promise<T>): Promise<T> {
  const url = process.env.DATABASE_URL;
  const handle = await openDb(url ? { url } : { dataDir });
  try {
    return await fn(handle.db);
  } finally {
    await handle.close();
  }
}
