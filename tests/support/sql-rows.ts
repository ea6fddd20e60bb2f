/**
 * The rows of a raw SQL query on either database: postgres.js answers an array of rows, PGlite an
 * object with `rows`. For reading the operator views, which have no drizzle schema.
 */
import type { SQL } from "drizzle-orm";
import type { Db } from "../../db/client.ts";

export async function sqlRows(db: Db, query: SQL): Promise<Record<string, unknown>[]> {
  const r = (await db.execute(query)) as unknown as
    | { rows?: Record<string, unknown>[] }
    | Record<string, unknown>[];
  return Array.isArray(r) ? r : (r.rows ?? []);
}
