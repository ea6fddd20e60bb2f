/**
 * Opens the gateway's database: PGlite (Postgres compiled to WASM, in-process) under
 * `<dataDir>/pglite` by default, or a real PostgreSQL when a URL is given. Both go through
 * drizzle with the same schema, and the committed migrations (migrations/, drizzle-kit output)
 * are applied on open. There is no global db: callers pass the returned handle around.
 */
import { mkdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { PGlite } from "@electric-sql/pglite";
import { sql } from "drizzle-orm";
import type { PgDatabase, PgQueryResultHKT } from "drizzle-orm/pg-core";
import { drizzle as drizzlePglite } from "drizzle-orm/pglite";
import { migrate as migratePglite } from "drizzle-orm/pglite/migrator";
import { drizzle as drizzlePostgres } from "drizzle-orm/postgres-js";
import { migrate as migratePostgres } from "drizzle-orm/postgres-js/migrator";
import postgres from "postgres";
import { settled } from "../contracts/best-effort.ts";
import { SandboxdError } from "../contracts/errors.ts";
import { lockDir } from "./lock.ts";
import * as schema from "./schema/index.ts";

export type Schema = typeof schema;
/** What both drivers share; the gateway only uses this. */
export type Db = PgDatabase<PgQueryResultHKT, Schema>;

export interface DbHandle {
  db: Db;
  kind: "pglite" | "postgres";
  /**
   * LISTENs on each channel of `channels` until `stop()`, all on one connection: each channel's
   * `up()` once every LISTEN is in effect (every notification committed from then on reaches its
   * channel's `notify`), `down()` as soon as that may no longer hold (the connection is lost or
   * stopped); after a loss it LISTENs again, and says `up()` again when it is back.
   */
  listen(channels: Record<string, ChannelEvents>): { stop(): Promise<void> };
  close(): Promise<void>;
}

export interface ChannelEvents {
  notify(payload: string): void;
  up(): void;
  down(cause: unknown): void;
}

/**
 * How often a PostgreSQL LISTEN connection is asked a trivial query, and how long the answer may
 * take: a connection the network dropped without a close (no FIN, no RST) shows only when a query
 * stalls, and until then its listener would say it is up while notifications are lost. 1 s + 1 s
 * bounds that; one `select 1` a second per gateway costs the database nothing that shows.
 */
export const LISTEN_PING_MS = 1000;
export const LISTEN_PING_TIMEOUT_MS = 1000;
/** Wait before LISTENing again after a loss: the database is not hammered while it is away. */
export const LISTEN_RETRY_MS = 500;

export type OpenDbOptions =
  | { dataDir: string }
  | {
      url: string;
      /**
       * A direct connection for LISTEN when `url` goes through a transaction-mode pooler
       * (PgBouncer), which cannot hold a LISTEN; default `url`.
       */
      listenUrl?: string;
      /**
       * false: the schema must be migrated already (`sandboxd migrate`); an older one is refused
       * at open. Default true: migrate, under the advisory lock.
       */
      migrate?: boolean;
    };

/**
 * The advisory lock key migrations run under (any constant; "sbx" in ASCII): replicas starting at
 * once on one database wait for each other's migration instead of racing to create the same
 * tables; the second finds the work done.
 */
export const MIGRATION_LOCK_KEY = 0x736278;

/**
 * Applies the committed migrations to the PostgreSQL at `url`, holding the advisory lock on a
 * connection of its own (a session lock lives as long as its connection, and drizzle's migrator
 * then runs on that same connection). Safe to run from several processes at once.
 */
export async function migratePostgresLocked(url: string): Promise<void> {
  // One direct connection: a session lock needs a session, not a pooler's transaction.
  const client = postgres(url, { max: 1, prepare: false, onnotice: () => {} });
  try {
    await client`select pg_advisory_lock(${MIGRATION_LOCK_KEY})`;
    await migratePostgres(drizzlePostgres(client, { schema }), { migrationsFolder: MIGRATIONS_DIR });
    await client`select pg_advisory_unlock(${MIGRATION_LOCK_KEY})`;
  } catch (cause) {
    throw new SandboxdError("internal", "cannot migrate the PostgreSQL database", { cause });
  } finally {
    // Ending the session releases the lock too, had the unlock not run.
    await client.end({ timeout: 5 });
  }
}

/** The newest migration's tag (migrations/meta/_journal.json) and whether `db` has applied it. */
async function schemaIsCurrent(
  db: ReturnType<typeof drizzlePostgres>,
): Promise<{ ok: boolean; want: number }> {
  const journal = JSON.parse(readFileSync(join(MIGRATIONS_DIR, "meta", "_journal.json"), "utf8")) as {
    entries: { when: number }[];
  };
  const want = Math.max(...journal.entries.map((e) => e.when));
  try {
    const rows = (await db.execute(
      sql`select max(created_at) as at from drizzle.__drizzle_migrations`,
    )) as unknown as { at: string | number | null }[];
    return { ok: Number(rows[0]?.at ?? 0) >= want, want };
  } catch {
    return { ok: false, want };
  }
}

// import.meta.dirname (not Bun's import.meta.dir): the gateway also runs under Node and Deno.
export const MIGRATIONS_DIR = join(import.meta.dirname, "..", "migrations");

export async function openDb(opts: OpenDbOptions): Promise<DbHandle> {
  if ("url" in opts) {
    if (opts.migrate !== false) await migratePostgresLocked(opts.url);
    // max 10: the gateway is stateless and runs several replicas; 10 each is well under the
    // default max_connections (100) of a small Postgres. prepare: false: named prepared
    // statements do not survive a transaction-mode pooler handing each transaction to another
    // server connection.
    const client = postgres(opts.url, { max: 10, prepare: false, onnotice: () => {} });
    const db = drizzlePostgres(client, { schema });
    if (opts.migrate === false) {
      const current = await schemaIsCurrent(db);
      if (!current.ok) {
        await client.end({ timeout: 1 });
        throw new SandboxdError(
          "internal",
          "the PostgreSQL schema is older than this build: run `sandboxd migrate` first",
          { details: { wantMigration: current.want } },
        );
      }
    }
    const listenUrl = opts.listenUrl ?? opts.url;
    const listeners = new Set<{ stop(): Promise<void> }>();
    return {
      db: db as unknown as Db,
      kind: "postgres",
      listen: (channels) => {
        const l = listenPostgres(listenUrl, channels);
        listeners.add(l);
        return {
          stop: () => {
            listeners.delete(l);
            return l.stop();
          },
        };
      },
      close: async () => {
        for (const l of listeners) await l.stop();
        await client.end({ timeout: 5 });
      },
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
    // In-process: the LISTEN cannot be lost while the database is open; a notification is
    // delivered (a microtask) before the query that committed it resolves.
    listen: (channels) => {
      let stopped = false;
      const all = Object.values(channels);
      const unlistens = Promise.all(
        Object.entries(channels).map(([channel, on]) =>
          client.listen(channel, (payload) => on.notify(payload)),
        ),
      ).then(
        (us) => {
          if (!stopped) for (const on of all) on.up();
          return us;
        },
        (err: unknown) => {
          for (const on of all) on.down(err);
          return [];
        },
      );
      return {
        stop: async () => {
          if (stopped) return;
          stopped = true;
          for (const on of all) on.down(new Error("stopped"));
          // Unlistening on a connection that is closing anyway: the stop's goal holds either way.
          for (const u of await unlistens) await settled(u());
        },
      };
    },
    close: () => client.close().finally(() => lock.release()),
  };
}

/**
 * The LISTENs on a connection of their own (a pooled one could be handed to another query, and
 * postgres.js's own `listen` gives up for good when a reconnect fails): up once every LISTEN
 * answered, down on the connection's close or a ping that fails or stalls, then again after
 * `LISTEN_RETRY_MS` until `stop()`.
 */
function listenPostgres(url: string, channels: Record<string, ChannelEvents>): { stop(): Promise<void> } {
  const all = Object.values(channels);
  const down = (cause: unknown) => {
    for (const on of all) on.down(cause);
  };
  let current: postgres.Sql | undefined;
  let stopped = false;
  let timer: ReturnType<typeof setTimeout> | undefined;
  const lost = (c: postgres.Sql, cause: unknown) => {
    if (current !== c) return; // an older connection, already given up
    current = undefined;
    clearTimeout(timer);
    down(cause);
    void settled(c.end({ timeout: 0 })); // the connection already failed: `cause` is reported
    if (!stopped) timer = setTimeout(connect, LISTEN_RETRY_MS);
  };
  const ping = (c: postgres.Sql) => {
    timer = setTimeout(async () => {
      let stall: ReturnType<typeof setTimeout> | undefined;
      try {
        await Promise.race([
          c`select 1`,
          new Promise((_, fail) => {
            stall = setTimeout(
              () => fail(new Error("LISTEN connection did not answer a ping")),
              LISTEN_PING_TIMEOUT_MS,
            );
          }),
        ]);
        if (current === c) ping(c);
      } catch (err) {
        lost(c, err);
      } finally {
        clearTimeout(stall);
      }
    }, LISTEN_PING_MS);
  };
  const connect = async () => {
    if (stopped) return;
    // `onnotify` is read by postgres.js (src/index.js) but missing from its option types.
    const options = {
      max: 1,
      // The connection is held for the gateway's life: no idle end, no recycling (each would be
      // a window of lost notifications).
      idle_timeout: 0,
      max_lifetime: null,
      // A database that does not answer at all: give up after this long and try again.
      connect_timeout: 5,
      fetch_types: false,
      onnotice: () => {},
      onnotify: (ch: string, payload: string) => {
        if (current === c && Object.hasOwn(channels, ch)) channels[ch]!.notify(payload);
      },
      onclose: () => lost(c, new Error("LISTEN connection closed")),
    };
    const c: postgres.Sql = postgres(url, options as postgres.Options<Record<string, never>>);
    current = c;
    try {
      for (const channel of Object.keys(channels))
        await c.unsafe(`LISTEN "${channel.replaceAll('"', '""')}"`);
      if (current !== c) return;
      for (const on of all) on.up();
      ping(c);
    } catch (err) {
      lost(c, err);
    }
  };
  void connect();
  return {
    stop: async () => {
      if (stopped) return;
      stopped = true;
      clearTimeout(timer);
      const c = current;
      current = undefined;
      if (c) {
        down(new Error("stopped"));
        await settled(c.end({ timeout: 1 })); // stopping: the listeners were told above
      }
    },
  };
}
