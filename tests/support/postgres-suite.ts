/**
 * Runs a db suite against a real PostgreSQL too: `suite("PostgreSQL", url)` where `url()` starts
 * the server on first use (stopped after the file's tests), or one skipped test saying why when
 * the postgres binaries are absent.
 */
import { afterAll, test } from "bun:test";
import { type Db, openDb } from "../../db/client.ts";
import { FixedPlacement } from "../../gateway/agents/placement.ts";
import type { Deps } from "../../gateway/deps.ts";
import { type Harness, makeHarness } from "./gateway-harness.ts";
import { findPgBin, startPostgres, type TestPostgres } from "./postgres.ts";

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

/** A database a suite runs on: PGlite (`url` undefined) or a real PostgreSQL started on first use. */
export interface DatabaseCase {
  name: string;
  url: (() => Promise<string>) | undefined;
}

/**
 * The databases a file's suites run on: PGlite, and PostgreSQL where its binaries are (started
 * on the first `url()`, stopped after the file's tests; one skipped test says why when absent).
 * `postgresUrl` / `postgres` are that same server (its url, or itself to halt and start), for
 * suites that need PostgreSQL only.
 */
export function databaseCases(): {
  cases: DatabaseCase[];
  havePostgres: boolean;
  postgresUrl: () => Promise<string>;
  postgres: () => Promise<TestPostgres>;
} {
  const havePostgres = findPgBin() !== null;
  let pg: TestPostgres | null = null;
  afterAll(() => pg?.stop());
  const postgres = async (): Promise<TestPostgres> => {
    pg ??= await startPostgres();
    if (!pg) throw new Error("no postgres binaries under /usr/lib/postgresql/*/bin");
    return pg;
  };
  const postgresUrl = async () => (await postgres()).url;
  if (!havePostgres)
    test.skip("PostgreSQL: SKIPPED, no postgres binaries under /usr/lib/postgresql/*/bin", () => {});
  return {
    cases: [
      { name: "PGlite", url: undefined },
      ...(havePostgres ? [{ name: "PostgreSQL", url: postgresUrl }] : []),
    ],
    havePostgres,
    postgresUrl,
    postgres,
  };
}

/**
 * A gateway-harness suite on PGlite, then on PostgreSQL with `others`: a second connection pool
 * to the same database, as a second gateway process would hold (PGlite has one opener, so none
 * there). The server and pools are closed after the file's tests.
 */
export function onBothDatabases(
  suite: (name: string, open: () => Promise<{ harness: Harness; others: Db[] }>) => void,
): void {
  suite("PGlite", async () => ({ harness: await makeHarness(), others: [] }));
  if (findPgBin() === null) {
    test.skip("PostgreSQL: SKIPPED, no postgres binaries under /usr/lib/postgresql/*/bin", () => {});
    return;
  }
  let pg: TestPostgres | null = null;
  const closers: (() => Promise<void>)[] = [];
  afterAll(async () => {
    for (const c of closers) await c();
    pg?.stop();
  });
  suite("PostgreSQL, two gateways' connection pools", async () => {
    pg = await startPostgres();
    const second = await openDb({ url: pg!.url });
    closers.push(second.close);
    return { harness: await makeHarness({ url: pg!.url }), others: [second.db] };
  });
}

/** One gateway's view of a harness: its own placement over `db` (by default h's) and h's agent and clock. */
export function gatewayDeps(h: Harness, db: Db = h.handle.db): Deps {
  return {
    db,
    agent: h.agent,
    placement: new FixedPlacement(h.handle.db, h.agent, h.config.agent),
    config: h.config,
    clock: () => h.now.ms,
  };
}
