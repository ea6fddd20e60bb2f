/**
 * One tenant's quota checks, made atomic: a check-and-reserve runs in a transaction that holds
 * the tenant's advisory lock (`pg_advisory_xact_lock`, released at commit or rollback), so two
 * racing requests of one tenant count one after the other and cannot both take the last place.
 * The same lock serves every quota (sandboxes, sessions, suspended sandboxes, templates): each
 * holds it only to count and write its reservation row, never across an agent call (a VM boot,
 * a suspend, a build), so one tenant's slow operation never waits on another's.
 *
 * PGlite and PostgreSQL both implement advisory locks. PGlite has one connection and runs one
 * transaction at a time, so there the lock is uncontended; what must not happen is a query on
 * the outer `db` inside `fn` (it would wait for the transaction that waits for it): `fn` uses
 * only the `tx` it is given.
 */
import { sql } from "drizzle-orm";
import type { Db } from "../../db/client.ts";

export type Tx = Parameters<Parameters<Db["transaction"]>[0]>[0];

export function underTenantLock<T>(db: Db, tenantId: string, fn: (tx: Tx) => Promise<T>): Promise<T> {
  return db.transaction(async (tx) => {
    await tx.execute(sql`select pg_advisory_xact_lock(hashtext(${tenantId}))`);
    return fn(tx);
  });
}
