/**
 * One rate limit across gateway replicas (docs/limits.md "Public API limits": 100 requests per second per key): two real
 * `bin/sandboxd gateway` processes and one real `bin/sandboxd agent` on one real PostgreSQL
 * (started by the test; skipped, with a message, only when the postgres binaries are absent). A
 * burst of 300 requests of one key, alternating between the two gateways, gets the API's 100
 * through (at most 110, and at least 90: the limiter is shared, not refusing everything), the rest
 * 429 `rate_limited` with Retry-After. Then the gateway's added latency per request is measured
 * with the shared limiter's local fast path (leases) and without it (a round trip per request);
 * the figures are printed, not asserted.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { openDb } from "../../db/client.ts";
import { SharedRateLimiter } from "../../gateway/auth/rate-limit.ts";
import {
  latencySummary,
  prepareDataDir,
  type RunningService,
  removeDataDir,
  runCli,
  startServing,
  waitFor,
} from "../support/e2e-service.ts";
import { findPgBin, startPostgres, type TestPostgres } from "../support/postgres.ts";

/** PostgreSQL's initdb, two gateways and an agent (which checks the host) on a loaded machine. */
const SETUP_TIMEOUT_MS = 240_000;
const TEST_TIMEOUT_MS = 120_000;
const BURST = 300;
const LIMIT = 100;

const HAVE_PG = findPgBin() !== null;
if (!HAVE_PG) console.warn("rate-limit-replicas: PostgreSQL binaries not found, skipping");

describe.skipIf(!HAVE_PG)("two gateways and one agent on one PostgreSQL", () => {
  let pg: TestPostgres | null = null;
  const dirs: string[] = [];
  const procs: RunningService[] = [];
  let gateways: RunningService[] = [];
  let env: NodeJS.ProcessEnv = {};

  const cli = async (...args: string[]) => {
    const r = await runCli(args, env);
    if (r.code !== 0) throw new Error(`sandboxd ${args.join(" ")} failed: ${r.stderr}`);
    return r.stdout.trim().split("\n").at(-1)!;
  };

  beforeAll(async () => {
    pg = await startPostgres();
    env = { ...process.env, DATABASE_URL: pg!.url, SANDBOXD_PRELAUNCH: "0" };
    delete env.SANDBOXD_DATA_DIR;
    // Replicas share the server secrets (README: several gateways over one PostgreSQL).
    env.SANDBOXD_KEY_PEPPER = "replicas-key-pepper-0123456789";
    env.SANDBOXD_CONNECT_SECRET = "replicas-connect-secret-0123456789";
    env.SANDBOXD_AGENT_SECRET = "replicas-agent-secret-0123456789abcdef";
    for (let i = 0; i < 3; i++) dirs.push(await prepareDataDir("sbx-e2e-replicas-"));
    for (const dir of dirs.slice(0, 2)) {
      const gw = await startServing(
        ["gateway", "--host", "127.0.0.1", "--port", "0", "--no-catalog", "--data-dir", dir],
        dir,
        env,
      );
      procs.push(gw);
      gateways.push(gw);
    }
    const token = await cli("agent-token", "create", "--data-dir", dirs[2]!, "--ttl", "10m");
    procs.push(
      await startServing(
        [
          "agent",
          ...["--gateway", gateways[0]!.url, "--enroll", token, "--listen", "127.0.0.1:0"],
          ...["--id", "replica-agent", "--no-catalog", "--data-dir", dirs[2]!],
        ],
        dirs[2]!,
        env,
      ),
    );
    // The agent is registered once a heartbeat has reached the database both gateways read.
    const registered = await waitFor(async () => {
      const out = await runCli(["agent-token", "list", "--data-dir", dirs[2]!], env);
      return /"id":"replica-agent","state":"enrolled".*"lastHeartbeatAt":"/.test(out.stdout);
    }, 60_000);
    expect(registered).toBe(true);
  }, SETUP_TIMEOUT_MS);

  afterAll(async () => {
    for (const p of procs.reverse()) await p.stop();
    gateways = [];
    for (const d of dirs) await removeDataDir(d);
    pg?.stop();
  });

  test(
    `a burst of ${BURST} requests of one key over both gateways gets ${LIMIT} through, not twice that`,
    async () => {
      const key = await cli("key", "create", "--data-dir", dirs[0]!, "--tenant", "burst", "--tier", "live");
      const warm = await cli("key", "create", "--data-dir", dirs[0]!, "--tenant", "burst", "--tier", "live");
      // Open the connections and the code paths with another key of the tenant, then let a
      // second pass so nothing of the warm-up is inside the burst's window.
      for (const gw of gateways) {
        const r = await fetch(`${gw.url}/v1/sessions`, { headers: { authorization: `Bearer ${warm}` } });
        expect(r.status).toBe(200);
      }
      await Bun.sleep(1100);

      const t0 = performance.now();
      const results = await Promise.all(
        Array.from({ length: BURST }, async (_, i) => {
          const gw = gateways[i % 2]!;
          const r = await fetch(`${gw.url}/v1/sessions`, { headers: { authorization: `Bearer ${key}` } });
          const body = (await r.json()) as { code?: string };
          return { gw: i % 2, status: r.status, code: body.code, retryAfter: r.headers.get("retry-after") };
        }),
      );
      const elapsedS = (performance.now() - t0) / 1000;
      const ok = results.filter((r) => r.status === 200);
      const limited = results.filter((r) => r.status === 429);
      const byGateway = [0, 1].map((g) => ok.filter((r) => r.gw === g).length);
      console.log(
        JSON.stringify({
          replicas_rate_limit: {
            sent: BURST,
            ok: ok.length,
            limited: limited.length,
            byGateway,
            elapsed_s: elapsedS,
          },
        }),
      );
      expect(ok.length + limited.length).toBe(BURST);
      // No second holds more than the limit (+10%); a burst that ran longer than a second (a
      // loaded host) may get one more allowance per second it spanned.
      expect(ok.length).toBeLessThanOrEqual(Math.floor(LIMIT * 1.1) * Math.max(1, Math.ceil(elapsedS)));
      expect(ok.length).toBeGreaterThanOrEqual(LIMIT * 0.9);
      for (const r of limited) {
        expect(r.code).toBe("rate_limited");
        expect(r.retryAfter).toMatch(/^\d+$/);
        expect(Number(r.retryAfter)).toBeGreaterThanOrEqual(1);
      }
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "the gateway's added latency per request, with and without the local fast path (printed)",
    async () => {
      const handle = await openDb({ url: pg!.url });
      try {
        // 60 requests a second (under the limit), sequential, for two seconds each way.
        const run = async (leaseMs: number) => {
          const rl = new SharedRateLimiter({ db: handle.db, limit: LIMIT, clock: Date.now, leaseMs });
          const key = `latency-${leaseMs}-${Date.now()}`;
          const samples: number[] = [];
          for (let i = 0; i < 120; i++) {
            const t = performance.now();
            expect(await rl.take(key)).toBe(0);
            samples.push(performance.now() - t);
            await Bun.sleep(1000 / 60);
          }
          return { ...latencySummary(samples), db_calls: rl.dbCalls, requests: samples.length };
        };
        const without = await run(0);
        const withLeases = await run(50);
        console.log(
          JSON.stringify({ limiter_added_latency_ms: { with_fast_path: withLeases, without: without } }),
        );
        expect(without.db_calls).toBe(120);
        expect(withLeases.db_calls).toBeLessThan(120 / 2);
      } finally {
        await handle.close();
      }
    },
    TEST_TIMEOUT_MS,
  );
});
