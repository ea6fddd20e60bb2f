/**
 * The gateway outlives its database: with a real PostgreSQL (tests/support/postgres.ts) halted under
 * a running gateway, keyed calls answer 503 `db_unavailable` with `Retry-After` (not 500
 * `internal`) and `GET /v1/health` answers 200 `degraded`; once PostgreSQL is started again the
 * same calls succeed, with no restart of the gateway. Skipped, with a message, where the
 * PostgreSQL binaries are absent.
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createKey } from "../../gateway/auth/keys.ts";
import { type RunningGateway, startGateway } from "../../gateway/server.ts";
import { MemoryAgent } from "../support/memory-agent.ts";
import { findPgBin, startPostgres, type TestPostgres } from "../support/postgres.ts";

const HAVE_PG = findPgBin() !== null;
if (!HAVE_PG) console.warn("gateway-db-down: no PostgreSQL binaries, skipping");

let pg: TestPostgres | null = null;
let gw: RunningGateway | undefined;
let dir = "";
let key = "";

beforeAll(async () => {
  if (!HAVE_PG) return;
  pg = await startPostgres();
  dir = mkdtempSync(join(tmpdir(), "sandboxd-dbdown-"));
  gw = await startGateway({
    port: 0,
    databaseUrl: pg!.url,
    agent: new MemoryAgent(),
    config: {
      keyPepper: "pepper-0123456789abcdef",
      connectSecret: "connect-0123456789abcdef",
      uploadDir: join(dir, "uploads"),
    },
    log: () => {},
  });
  key = (await gw.withDb((db) => createKey(db, gw!.config.keyPepper, { tenant: "db", tier: "pro" }))).key;
}, 120_000);

afterAll(async () => {
  await gw?.stop().catch(() => {});
  pg?.stop();
  if (dir) rmSync(dir, { recursive: true, force: true });
}, 30_000); // closing the pool waits up to 5 s for connections the restart left behind

async function call(path: string, auth = true) {
  const res = await fetch(`${gw!.url}${path}`, auth ? { headers: { authorization: `Bearer ${key}` } } : {});
  return {
    status: res.status,
    retryAfter: res.headers.get("retry-after"),
    body: (await res.json()) as { code?: string; status?: string; templates?: unknown },
  };
}

test.skipIf(!HAVE_PG)(
  "database down: 503 db_unavailable + Retry-After, health degraded; back up: 200",
  async () => {
    expect((await call("/v1/sandboxes")).status).toBe(200);
    expect((await call("/v1/health", false)).body.status).toBe("ok");

    pg!.halt();
    const t0 = performance.now();
    const down = await call("/v1/sandboxes");
    const downMs = performance.now() - t0;
    expect(down.status).toBe(503);
    expect(down.body.code).toBe("db_unavailable");
    expect(Number(down.retryAfter)).toBeGreaterThanOrEqual(1);
    // A second call (a fresh connection attempt, not the one that broke) answers the same.
    const again = await call("/v1/sandboxes");
    expect({ status: again.status, code: again.body.code }).toEqual({ status: 503, code: "db_unavailable" });
    const health = await call("/v1/health", false);
    expect(health.status).toBe(200);
    expect(health.body.status).toBe("degraded");
    expect(health.body.templates).toEqual({});
    console.log(JSON.stringify({ test: "gateway-db-down", first_503_ms: Math.round(downMs) }));

    pg!.start();
    let back = await call("/v1/sandboxes");
    // Bounded at 30 s (a restarted server and a loaded host), asserted below.
    for (let i = 0; i < 300 && back.status !== 200; i++) {
      await Bun.sleep(100);
      back = await call("/v1/sandboxes");
    }
    expect(back.status).toBe(200);
    expect((await call("/v1/health", false)).body.status).toBe("ok");
  },
  120_000,
);
