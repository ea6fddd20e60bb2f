/**
 * Migrations on a shared PostgreSQL (db/client.ts, docs/operations.md "Migrations"), on a real
 * server with a fresh database per case: six gateways' opens at once on an empty database all
 * succeed and apply each migration once (the advisory lock: without it they race to create the
 * same tables); `sandboxd migrate` (the command, as a process) migrates and may run again; an open
 * with `migrate: false` refuses a schema older than the build, naming the command, and takes a
 * current one. Skipped without PostgreSQL binaries.
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import postgres from "postgres";
import { SandboxdError } from "../../contracts/errors.ts";
import { MIGRATIONS_DIR, openDb } from "../../db/client.ts";
import { startPostgres, type TestPostgres } from "../support/postgres.ts";

const REPO = join(import.meta.dir, "..", "..");
/** A fresh server and a few migrations of an empty database on a loaded host. */
const TEST_TIMEOUT_MS = 90_000;
const JOURNAL = JSON.parse(readFileSync(join(MIGRATIONS_DIR, "meta", "_journal.json"), "utf8")) as {
  entries: unknown[];
};

let pg: TestPostgres | null = null;
beforeAll(async () => {
  pg = await startPostgres();
}, 60_000);
afterAll(() => pg?.stop());

let n = 0;
/** A new empty database on the test server; its URL. */
async function freshDatabase(): Promise<string> {
  const name = `mig_${process.pid}_${++n}`;
  const admin = postgres(pg!.url, { max: 1, onnotice: () => {} });
  await admin.unsafe(`create database ${name}`);
  await admin.end();
  const u = new URL(pg!.url);
  u.pathname = `/${name}`;
  return u.toString();
}

async function applied(url: string): Promise<number> {
  const c = postgres(url, { max: 1, onnotice: () => {} });
  try {
    const rows = await c`select count(*)::int as n from drizzle.__drizzle_migrations`;
    return rows[0]!.n as number;
  } finally {
    await c.end();
  }
}

test(
  "gateways opening one empty database at once migrate it once, and all start",
  async () => {
    if (!pg) return console.warn("PostgreSQL binaries not found: migration lock test skipped");
    const url = await freshDatabase();
    const opens = await Promise.allSettled(Array.from({ length: 6 }, () => openDb({ url })));
    const failed = opens
      .filter((o) => o.status === "rejected")
      .map((o) => String((o as PromiseRejectedResult).reason?.cause ?? ""));
    expect(failed).toEqual([]);
    for (const o of opens) if (o.status === "fulfilled") await o.value.close();
    expect(await applied(url)).toBe(JOURNAL.entries.length);
  },
  TEST_TIMEOUT_MS,
);

test(
  "`sandboxd migrate` migrates; a gateway that may not migrate refuses an old schema and takes a current one",
  async () => {
    if (!pg) return console.warn("PostgreSQL binaries not found: migration lock test skipped");
    const url = await freshDatabase();
    const refused = await openDb({ url, migrate: false }).then(
      () => undefined,
      (e: unknown) => e,
    );
    expect(refused).toBeInstanceOf(SandboxdError);
    expect(String((refused as Error).message)).toContain("run `sandboxd migrate` first");
    for (let i = 0; i < 2; i++) {
      const run = spawnSync(process.execPath, [join(REPO, "cli", "main.ts"), "migrate"], {
        env: { ...process.env, DATABASE_URL: url },
        encoding: "utf8",
        timeout: 60_000,
      });
      expect({ status: run.status, out: run.stdout.trim(), err: run.stderr.slice(-500) }).toMatchObject({
        status: 0,
        out: "migrated: PostgreSQL (DATABASE_URL)",
      });
    }
    expect(await applied(url)).toBe(JOURNAL.entries.length);
    const handle = await openDb({ url, migrate: false });
    await handle.close();
  },
  TEST_TIMEOUT_MS,
);
