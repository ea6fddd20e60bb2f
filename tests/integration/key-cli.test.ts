/**
 * `sandboxd key create|list|revoke` as an operator runs it (bin/sandboxd in a subprocess), and
 * the keys it issues against a gateway started by `startGateway` on the same data dir (same key
 * pepper): a created pro key is accepted, a revoked one is refused. Once over PGlite in the data
 * dir and once over a real PostgreSQL started by the test (`DATABASE_URL`; skipped, with a
 * message, only when the postgres binaries are absent).
 *
 * PGlite is one process's database: this test's in-process gateway serves no operator socket, so
 * over PGlite it is stopped while the CLI runs (tests/e2e/key-cli-live.test.ts runs the CLI against a
 * running `sandboxd up`, through its operator socket). Over PostgreSQL the gateway keeps
 * running and sees the revocation on the next request.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { type RunningGateway, startGateway } from "../../gateway/server.ts";
import { runCli } from "../support/e2e-service.ts";
import { MemoryAgent } from "../support/memory-agent.ts";
import { findPgBin, startPostgres, type TestPostgres } from "../support/postgres.ts";

const KEY_RE = /^svc_pro_([a-z0-9]{12})_[A-Za-z0-9]{40}$/;
/** bin/sandboxd checks the host and node modules first; PGlite migrates on every open. */
const CLI_TIMEOUT_MS = 60_000;
/**
 * How long another process's revocation may take to reach the running gateway: its notification
 * comes within milliseconds of the commit; the bound is for a loaded 2-core host shared with other
 * test files, and far below the key TTL, so only the notification can meet it.
 */
const NOTIFY_BOUND_MS = 5_000;
/** The gateway's short key TTL here: far past the bound, so that only the notification helps. */
const KEY_CACHE_LONG_TTL_MS = 600_000;

interface CliResult {
  code: number | null;
  stdout: string;
  stderr: string;
}

function cli(args: string[], databaseUrl: string | undefined): Promise<CliResult> {
  const env: NodeJS.ProcessEnv = { ...process.env };
  delete env.DATABASE_URL;
  if (databaseUrl !== undefined) env.DATABASE_URL = databaseUrl;
  return runCli(args, env, CLI_TIMEOUT_MS);
}

interface Listing {
  keyId: string;
  prefix: string;
  name: string;
  tier: string;
  tenant: string;
  createdAt: string;
  revokedAt: string | null;
}

function parseList(stdout: string): Listing[] {
  return stdout
    .split("\n")
    .filter((l) => l.trim() !== "")
    .map((l) => JSON.parse(l) as Listing);
}

function suite(name: string, databaseUrl: () => string | undefined) {
  describe(name, () => {
    let dataDir = "";
    let gw: RunningGateway | null = null;
    const start = async () => {
      const url = databaseUrl();
      gw = await startGateway({
        port: 0,
        dataDir,
        ...(url !== undefined ? { databaseUrl: url } : {}),
        agent: new MemoryAgent(),
        // Past the bound below: over PostgreSQL only the revocation's notification can make the
        // running gateway refuse the key in time, as docs/api.md promises.
        keyCacheTtlMs: KEY_CACHE_LONG_TTL_MS,
        log: () => {},
      });
      return gw;
    };
    const stop = async () => {
      await gw?.stop();
      gw = null;
    };
    const list = (url: string) => fetch(`${gw!.url}/v1/sandboxes`, { headers: { authorization: url } });

    beforeAll(() => {
      dataDir = mkdtempSync(join(tmpdir(), "sandboxd-keycli-"));
    });
    afterAll(async () => {
      await stop();
      rmSync(dataDir, { recursive: true, force: true });
    });

    test(
      "create prints the key last, list shows it without secret, revoke ends it",
      async () => {
        const url = databaseUrl();
        const created = await cli(
          ["key", "create", "--data-dir", dataDir, "--tenant", "acme", "--tier", "pro", "--name", "ci"],
          url,
        );
        expect(created.code).toBe(0);
        const key = created.stdout.trimEnd().split("\n").at(-1)!;
        const m = KEY_RE.exec(key);
        expect(m).not.toBeNull();
        const keyId = m![1]!;
        const secret = key.split("_").at(-1)!;
        expect(created.stderr).toContain(`key ${keyId} for tenant acme`);

        const listed = await cli(["key", "list", "--data-dir", dataDir, "--tenant", "acme"], url);
        expect(listed.code).toBe(0);
        const rows = parseList(listed.stdout);
        expect(rows).toHaveLength(1);
        expect(rows[0]).toMatchObject({
          keyId,
          prefix: `svc_pro_${keyId}`,
          name: "ci",
          tier: "pro",
          tenant: "acme",
          revokedAt: null,
        });
        // Neither the secret nor its hash is ever shown.
        expect(listed.stdout).not.toContain(secret);
        expect(Object.keys(rows[0]!).sort()).toEqual(
          ["createdAt", "keyId", "name", "prefix", "revokedAt", "tenant", "tier"].sort(),
        );
        expect(listed.stdout).not.toMatch(/[0-9a-f]{64}/);

        // The key authenticates against a gateway on the same data dir (same pepper).
        await start();
        const ok = await list(`Bearer ${key}`);
        expect(ok.status).toBe(200);
        expect(await ok.json()).toMatchObject({ sandboxes: [] });
        // The same id with another secret is refused.
        expect((await list(`Bearer svc_pro_${keyId}_${"A".repeat(40)}`)).status).toBe(401);
        if (url === undefined) await stop(); // PGlite: one process at a time

        const revoked = await cli(["key", "revoke", keyId, "--data-dir", dataDir], url);
        expect(revoked.code).toBe(0);
        expect(revoked.stdout).toContain(`revoked ${keyId}`);
        const again = await cli(["key", "revoke", keyId, "--data-dir", dataDir], url);
        expect(again.code).not.toBe(0);
        expect(again.stderr).toContain(`no active key ${keyId}`);

        const after = parseList((await cli(["key", "list", "--data-dir", dataDir], url)).stdout);
        expect(after).toHaveLength(1);
        expect(Number.isNaN(Date.parse(after[0]!.revokedAt ?? ""))).toBe(false);

        // PGlite: a gateway started after the revoke reads the revoked row at once. PostgreSQL:
        // the gateway kept running and the CLI revoked through the database, so the gateway's
        // key cache trusts the key until the revocation's notification drops it.
        const revokedAt = performance.now();
        if (gw === null) await start();
        let refused = await list(`Bearer ${key}`);
        while (refused.status === 200 && performance.now() - revokedAt < NOTIFY_BOUND_MS) {
          await Bun.sleep(50);
          refused = await list(`Bearer ${key}`);
        }
        expect(refused.status).toBe(401);
        expect(((await refused.json()) as { code: string }).code).toBe("unauthorized");
        await stop();
      },
      6 * CLI_TIMEOUT_MS,
    );

    test(
      "a bad tier exits non-zero with a clear message and creates nothing",
      async () => {
        const url = databaseUrl();
        const bad = await cli(
          ["key", "create", "--data-dir", dataDir, "--tenant", "nobody-co", "--tier", "platinum"],
          url,
        );
        expect(bad.code).not.toBe(0);
        expect(bad.stdout).toBe("");
        expect(bad.stderr).toContain("key create needs --tier, one of live, scale, demo, pro, enterprise");
        const rows = parseList((await cli(["key", "list", "--data-dir", dataDir], url)).stdout);
        expect(rows.some((r) => r.tenant === "nobody-co")).toBe(false);
      },
      3 * CLI_TIMEOUT_MS,
    );
  });
}

suite("key CLI over PGlite in the data dir", () => undefined);

const HAVE_PG = findPgBin() !== null;
if (!HAVE_PG) console.warn("key-cli: PostgreSQL binaries not found, skipping the DATABASE_URL suite");
let pg: TestPostgres | null = null;
describe.skipIf(!HAVE_PG)("with DATABASE_URL", () => {
  beforeAll(async () => {
    pg = await startPostgres();
  }, 120_000);
  afterAll(() => pg?.stop());
  suite("key CLI over PostgreSQL", () => pg!.url);
});
