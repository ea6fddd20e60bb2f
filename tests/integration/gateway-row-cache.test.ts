/**
 * The row cache of the info reads (gateway/core/row-cache.ts), on PGlite and on a real
 * PostgreSQL:
 * - through `createApp` with a cache whose LISTEN state the test sets (no notifications at all):
 *   the gateway's own writes show on its next read, a deleted sandbox is 404 at once, tenant B
 *   never gets tenant A's cached row, the cache stays within its bound, and while the LISTEN is
 *   down every read goes to the database;
 * - through `startGateway` (the real LISTEN): a change written by another connection (a direct
 *   SQL UPDATE; on PostgreSQL also a second gateway's DELETE) shows within NOTIFY_BOUND_MS, and on
 *   PostgreSQL a halted database makes the reads fail (503) instead of answering from memory,
 *   then serve again once it is back.
 */
import { afterAll, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { eq } from "drizzle-orm";
import { type Db, openDb } from "../../db/client.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { createKey } from "../../gateway/auth/keys.ts";
import { RowCache } from "../../gateway/core/row-cache.ts";
import { upsertPublicTemplate } from "../../gateway/core/templates.ts";
import { type RunningGateway, startGateway } from "../../gateway/server.ts";
import { makeHarness } from "../support/gateway-harness.ts";
import { MemoryAgent } from "../support/memory-agent.ts";
import { databaseCases } from "../support/postgres-suite.ts";
import { until } from "../support/until.ts";

/**
 * How long another connection's change may take to show. A notification is delivered within
 * milliseconds of the commit (the time seen is printed); the bound is for a loaded 2-core host.
 * The cache keeps a row until told (no TTL under a LISTEN), so only a notification can meet it.
 */
const NOTIFY_BOUND_MS = 5_000;
/** The LISTEN connection's reconnect after PostgreSQL comes back (retry 500 ms, then a connect). */
const RELISTEN_MS = 15_000;

const { cases: DATABASES, havePostgres: HAVE_PG, postgresUrl: pgUrl, postgres } = databaseCases();

for (const dbCase of DATABASES) {
  describe(`${dbCase.name}: the app's own writes and reads`, () => {
    async function harness(rows: RowCache) {
      const h = await makeHarness({
        ...(dbCase.url ? { url: await dbCase.url() } : {}),
        rows,
        limits: { sandboxQuotaByTier: { demo: 50, live: 50, pro: 50, scale: 50, enterprise: 50 } },
      });
      const a = await h.key("tenant-a", "pro");
      const b = await h.key("tenant-b", "pro");
      const create = async (key = a) => {
        const res = await h.req("POST", "/v1/sandboxes", { key, json: { template: "python" } });
        expect(res.status).toBe(201);
        return ((await res.json()) as { id: string }).id;
      };
      const info = (id: string, key = a) => h.req("GET", `/v1/sandboxes/${id}`, { key });
      return { h, a, b, create, info };
    }

    test("its own suspend, resume and delete show on its next read, with no notification", async () => {
      // LISTEN in effect, but no notification ever comes: only the app's own invalidation helps.
      const rows = new RowCache();
      rows.events.up();
      const { h, create, info, a } = await harness(rows);
      try {
        const id = await create();
        expect(((await (await info(id)).json()) as { state: string }).state).toBe("running");
        const hits = rows.hits;
        expect((await info(id)).status).toBe(200);
        expect(rows.hits).toBe(hits + 1); // the second read came from memory
        expect((await h.req("POST", `/v1/sandboxes/${id}/suspend`, { key: a })).status).toBe(200);
        expect(((await (await info(id)).json()) as { state: string }).state).toBe("suspended");
        expect((await h.req("POST", `/v1/sandboxes/${id}/resume`, { key: a })).status).toBe(200);
        expect(((await (await info(id)).json()) as { state: string }).state).toBe("running");
        expect((await h.req("DELETE", `/v1/sandboxes/${id}`, { key: a })).status).toBe(200);
        expect((await info(id)).status).toBe(404);
      } finally {
        await h.close();
      }
    });

    test("tenant B never gets tenant A's cached row", async () => {
      const rows = new RowCache();
      rows.events.up();
      const { h, create, info, b } = await harness(rows);
      try {
        const id = await create();
        expect((await info(id)).status).toBe(200); // now cached, read by A
        expect(rows.size).toBe(1);
        const other = await info(id, b);
        expect(other.status).toBe(404);
        expect(((await other.json()) as { code: string }).code).toBe("not_found");
        // A sessions API key of A's tenant does not get it as a session either.
        const famA = await h.key("tenant-a", "live");
        expect((await h.req("GET", `/v1/sessions/${id}`, { key: famA })).status).toBe(404);
      } finally {
        await h.close();
      }
    });

    test("the cache keeps at most its bound of rows, least recently read out first", async () => {
      const rows = new RowCache(4);
      rows.events.up();
      const { h, create, info } = await harness(rows);
      try {
        const ids: string[] = [];
        for (let i = 0; i < 10; i++) ids.push(await create());
        const first = ids[0]!;
        for (const id of ids) {
          expect((await info(id)).status).toBe(200);
          expect((await info(first)).status).toBe(200); // keeps the first one recently read
          expect(rows.size).toBeLessThanOrEqual(4);
        }
        expect(rows.size).toBe(4);
        const hits = rows.hits;
        expect((await info(first)).status).toBe(200);
        expect(rows.hits).toBe(hits + 1);
        // The oldest read one went: its read is a miss, and answers all the same.
        const misses = rows.misses;
        expect((await info(ids[1]!)).status).toBe(200);
        expect(rows.misses).toBe(misses + 1);
      } finally {
        await h.close();
      }
    });

    test("while the LISTEN is down every read goes to the database", async () => {
      const rows = new RowCache();
      rows.events.up();
      const { h, create, info } = await harness(rows);
      try {
        const id = await create();
        expect((await info(id)).status).toBe(200);
        expect(rows.size).toBe(1);
        rows.events.down();
        expect(rows.size).toBe(0);
        // A change no notification tells of (one was lost while the LISTEN was down).
        await h.handle.db
          .update(sandboxes)
          .set({ labels: { seen: "db" } })
          .where(eq(sandboxes.id, id));
        const hits = rows.hits;
        const body = (await (await info(id)).json()) as { labels: Record<string, string> };
        expect(body.labels).toEqual({ seen: "db" });
        expect((await info(id)).status).toBe(200);
        expect(rows.hits).toBe(hits);
        expect(rows.size).toBe(0);
      } finally {
        await h.close();
      }
    });
  });
}

test("a read that began before an invalidation of its row does not cache the row it read", () => {
  const rows = new RowCache();
  rows.events.up();
  const row = { id: "sbx_1" } as Parameters<RowCache["put"]>[0];
  const mark = rows.begin();
  rows.invalidate("sbx_1"); // the change's notification came while the read was in flight
  rows.put(row, mark);
  expect(rows.get("sbx_1")).toBeUndefined();
  // A LISTEN lost and regained while a read was in flight refuses it too.
  const mark2 = rows.begin();
  rows.events.down();
  rows.events.up();
  rows.put(row, mark2);
  expect(rows.get("sbx_1")).toBeUndefined();
  // A read begun after both caches.
  rows.put(row, rows.begin());
  expect(rows.get("sbx_1")).toBe(row);
});

// ---- the real LISTEN, through startGateway ----

const PEPPER = "row-cache-pepper-0123456789";
const dirs: string[] = [];
const gateways: RunningGateway[] = [];
afterAll(async () => {
  for (const g of gateways) await g.stop().catch(() => {});
  for (const d of dirs) rmSync(d, { recursive: true, force: true });
}, 30_000); // closing a pool waits up to 5 s for connections a restart left behind

async function gateway(opts: { url?: string; agent: MemoryAgent; dir?: string }): Promise<RunningGateway> {
  const dir = opts.dir ?? mkdtempSync(join(tmpdir(), "sandboxd-rowcache-"));
  dirs.push(dir);
  const gw = await startGateway({
    port: 0,
    ...(opts.url ? { databaseUrl: opts.url } : { dataDir: dir }),
    agent: opts.agent,
    config: {
      keyPepper: PEPPER,
      connectSecret: "row-cache-connect-0123456789",
      uploadDir: join(dir, "uploads"),
    },
    reaper: false,
    log: () => {},
  });
  gateways.push(gw);
  return gw;
}

async function seeded(gw: RunningGateway, agent: MemoryAgent): Promise<{ key: string; id: string }> {
  agent.addReadyTemplate("python");
  const key = await gw.withDb(async (db) => {
    await upsertPublicTemplate({ db, clock: Date.now }, { id: "python", name: "Python", description: "py" });
    return (await createKey(db, PEPPER, { tenant: "acme", tier: "pro" })).key;
  });
  const res = await fetch(`${gw.url}/v1/sandboxes`, {
    method: "POST",
    headers: { authorization: `Bearer ${key}`, "content-type": "application/json" },
    body: JSON.stringify({ template: "python" }),
  });
  expect(res.status).toBe(201);
  return { key, id: ((await res.json()) as { id: string }).id };
}

/**
 * A read of sandbox `id` with `key`. Never 429: the polls here (tests/support/until.ts) stay far
 * under the key's rate limit, so a 429 is a failure, not a status to poll past.
 */
const info = async (gw: RunningGateway, key: string, id: string) => {
  const res = await fetch(`${gw.url}/v1/sandboxes/${id}`, { headers: { authorization: `Bearer ${key}` } });
  expect(res.status).not.toBe(429);
  return res;
};

/** Reads until one is served from memory (the LISTEN is confirmed a moment after the start). */
async function cached(gw: RunningGateway, key: string, id: string): Promise<void> {
  await until(async () => {
    const hits = gw.rows.hits;
    expect((await info(gw, key, id)).status).toBe(200);
    return gw.rows.hits > hits;
  }, 10_000);
}

for (const dbCase of DATABASES) {
  describe(`${dbCase.name}: notifications`, () => {
    test(`a direct SQL UPDATE from another connection shows within ${NOTIFY_BOUND_MS} ms`, async () => {
      const url = dbCase.url ? await dbCase.url() : undefined;
      const agent = new MemoryAgent();
      const gw = await gateway({ agent, ...(url ? { url } : {}) });
      const { key, id } = await seeded(gw, agent);
      await cached(gw, key, id);
      // Another writer: a second pool on PostgreSQL; on PGlite (one opener) the gateway's own
      // handle, which the app's own invalidation never hears of: only the trigger tells.
      let other: { db: Db; close(): Promise<void> } | undefined;
      if (url) other = await openDb({ url });
      try {
        const write = (db: Db) =>
          db
            .update(sandboxes)
            .set({ labels: { changed: "elsewhere" } })
            .where(eq(sandboxes.id, id));
        if (other) await write(other.db);
        else await gw.withDb(write);
        const ms = await until(async () => {
          const body = (await (await info(gw, key, id)).json()) as { labels: Record<string, string> };
          return body.labels.changed === "elsewhere";
        }, NOTIFY_BOUND_MS);
        console.log(JSON.stringify({ test: "row-cache", db: dbCase.name, change_seen_ms: Math.round(ms) }));
        await cached(gw, key, id); // and cached again
      } finally {
        await other?.close();
      }
    }, 60_000);
  });
}

describe.skipIf(!HAVE_PG)("PostgreSQL: two gateways, and the database going away", () => {
  test(`a sandbox deleted through another gateway is 404 here within ${NOTIFY_BOUND_MS} ms`, async () => {
    const url = await pgUrl();
    // One agent behind both gateways, as one host's agent would be.
    const agent = new MemoryAgent();
    const gwA = await gateway({ url, agent });
    const gwB = await gateway({ url, agent });
    const { key, id } = await seeded(gwA, agent);
    await cached(gwA, key, id);
    const del = await fetch(`${gwB.url}/v1/sandboxes/${id}`, {
      method: "DELETE",
      headers: { authorization: `Bearer ${key}` },
    });
    expect(del.status).toBe(200);
    await until(async () => (await info(gwA, key, id)).status === 404, NOTIFY_BOUND_MS);
  }, 60_000);

  test("with the database halted the reads fail instead of answering from memory; back up, they serve again", async () => {
    const url = await pgUrl();
    const agent = new MemoryAgent();
    const gw = await gateway({ url, agent });
    const { key, id } = await seeded(gw, agent);
    await cached(gw, key, id);
    const pg = await postgres();
    pg.halt();
    try {
      // The LISTEN connection's loss stops the cache (its close, or a stalled ping: 1 s apart,
      // 1 s to answer); 15 s for a loaded host.
      await until(() => !gw.rows.serving, 15_000);
      const down = await info(gw, key, id);
      expect(down.status).toBe(503);
    } finally {
      pg.start();
    }
    await until(() => gw.rows.serving, RELISTEN_MS);
    expect(gw.rows.size).toBe(0); // emptied on the way back: notifications were lost meanwhile
    await until(async () => (await info(gw, key, id)).status === 200, RELISTEN_MS);
    await cached(gw, key, id);
  }, 90_000);
});
