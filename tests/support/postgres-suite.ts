/**
 * Runs a db suite against a real PostgreSQL too: `suite("PostgreSQL", url)` where `url()` starts
 * the server on first use (stopped after the file's tests), or one skipped test saying why when
 * the postgres binaries are absent.
 */
import { afterAll, test } from "bun:test";
import { findPgBin, startPostgres, type TestPostgres } from "../../db/testing/postgres.ts";

export function onPostgres(suite: (name: string, url: () => Promise<string>) => void): void {
  if (findPgBin() === null) {
    test.skip("PostgreSQL: SKIPPED, no postgres binaries under /usr/lib/postgresql/*/bin", () => {});
    return;
  }
  let pg: TestPostgres | null = null;
  afterAll(() => pg?.stop());
  suite("PostgreSQL", async () => {
    pg ??= await startPostgres();
    return pg!.url;
  });
}
