/**
 * `sandboxd agent-token create|list|revoke` as an operator runs it (bin/sandboxd in a
 * subprocess) against a routing gateway started by `startGateway` on the same data dir (same
 * agent secret): a created token enrolls an agent whose heartbeats are accepted; after `revoke`
 * the same agent's heartbeats are refused. PGlite is one process's database, so the gateway is
 * stopped while the CLI runs.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { enroll, loadOrEnroll } from "../../agent/api/enroll.ts";
import { startHeartbeats } from "../../agent/api/heartbeat.ts";
import { type RunningGateway, startGateway } from "../../gateway/server.ts";
import { runCli } from "../support/e2e-service.ts";

const TOKEN_RE = /^sbxe_[a-f0-9]{16}_[A-Za-z0-9_-]{43}$/;
/** bin/sandboxd checks the host and node modules first; PGlite migrates on every open. */
const CLI_TIMEOUT_MS = 60_000;

function cli(args: string[]): Promise<{ code: number | null; stdout: string; stderr: string }> {
  const env: NodeJS.ProcessEnv = { ...process.env };
  delete env.DATABASE_URL;
  delete env.SANDBOXD_AGENT_SECRET;
  return runCli(args, env, CLI_TIMEOUT_MS);
}

describe("agent-token CLI over PGlite in the data dir", () => {
  let dataDir = "";
  let stateDir = "";
  let gw: RunningGateway | null = null;
  const start = async () => {
    delete process.env.SANDBOXD_AGENT_SECRET;
    gw = await startGateway({ port: 0, dataDir, config: { region: "eu", version: "test" }, log: () => {} });
    return gw;
  };
  const stop = async () => {
    await gw?.stop();
    gw = null;
  };
  /** One heartbeat with the agent's stored credentials: resolves when accepted. */
  const beat = async (g: RunningGateway) => {
    const credentials = await loadOrEnroll({ gatewayUrl: g.url, stateDir, defaultId: "unused" });
    const hb = startHeartbeats({
      gatewayUrl: g.url,
      credentials,
      region: "eu",
      advertiseUrl: "http://127.0.0.1:9",
      capacity: () => ({ slotsFree: 1, slotsTotal: 1, vcpusFree: 1, memMibFree: 256 }),
      intervalMs: 60_000,
    });
    try {
      await hb.first;
    } finally {
      hb.stop();
    }
  };

  beforeAll(() => {
    dataDir = mkdtempSync(join(tmpdir(), "sandboxd-agenttoken-"));
    stateDir = mkdtempSync(join(tmpdir(), "sandboxd-agenttoken-agent-"));
  });
  afterAll(async () => {
    await stop();
    rmSync(dataDir, { recursive: true, force: true });
    rmSync(stateDir, { recursive: true, force: true });
  });

  test(
    "create prints a one-time token last, it enrolls an agent, revoke ends that agent's key",
    async () => {
      const created = await cli([
        "agent-token",
        "create",
        "--data-dir",
        dataDir,
        "--ttl",
        "10m",
        "--region",
        "eu",
      ]);
      expect(created.code).toBe(0);
      const token = created.stdout.trimEnd().split("\n").at(-1)!;
      expect(token).toMatch(TOKEN_RE);
      expect(created.stderr).toContain("single use");
      expect(created.stderr).toContain("in region eu");

      const g = await start();
      expect((await enroll({ gatewayUrl: g.url, token, id: "eu-a", stateDir })).id).toBe("eu-a");
      await beat(g);
      await stop();

      const listed = await cli(["agent-token", "list", "--data-dir", dataDir]);
      expect(listed.code).toBe(0);
      expect(JSON.parse(listed.stdout.trim())).toMatchObject({ id: "eu-a", state: "enrolled", region: "eu" });
      // The key is never shown.
      expect(listed.stdout).not.toMatch(/[0-9a-f]{64}/);

      const revoked = await cli(["agent-token", "revoke", "eu-a", "--data-dir", dataDir]);
      expect(revoked.code).toBe(0);
      expect(revoked.stdout).toContain("revoked agent eu-a");
      const again = await cli(["agent-token", "revoke", "eu-a", "--data-dir", dataDir]);
      expect(again.code).not.toBe(0);
      expect(again.stderr).toContain("no enrolled agent eu-a");
      const after = await cli(["agent-token", "list", "--data-dir", dataDir]);
      expect(JSON.parse(after.stdout.trim())).toMatchObject({ id: "eu-a", state: "revoked" });

      const g2 = await start();
      let refused: unknown;
      await beat(g2).catch((err) => {
        refused = err;
      });
      expect(String(refused)).toContain("401");
      await stop();
    },
    8 * CLI_TIMEOUT_MS,
  );

  test(
    "--uses N makes a token of N enrollments of new ids; with --agent, or out of range, refused",
    async () => {
      const made = await cli(["agent-token", "create", "--data-dir", dataDir, "--uses", "3", "--ttl", "1d"]);
      expect(made.code).toBe(0);
      expect(made.stdout.trimEnd().split("\n").at(-1)).toMatch(TOKEN_RE);
      expect(made.stderr).toContain("3 uses, new agent ids only");
      const bound = await cli([
        "agent-token",
        "create",
        "--data-dir",
        dataDir,
        "--uses",
        "2",
        "--agent",
        "x",
      ]);
      expect(bound.code).not.toBe(0);
      expect(bound.stderr).toContain("--agent and --uses exclude each other");
      const zero = await cli(["agent-token", "create", "--data-dir", dataDir, "--uses", "0"]);
      expect(zero.code).not.toBe(0);
      expect(zero.stderr).toContain("--uses must be 1-5000");
    },
    4 * CLI_TIMEOUT_MS,
  );

  test(
    "a bad --ttl exits non-zero with a clear message",
    async () => {
      const bad = await cli(["agent-token", "create", "--data-dir", dataDir, "--ttl", "soon"]);
      expect(bad.code).not.toBe(0);
      expect(bad.stdout).toBe("");
      expect(bad.stderr).toContain("--ttl must be like");
    },
    2 * CLI_TIMEOUT_MS,
  );
});
