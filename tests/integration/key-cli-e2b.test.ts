/**
 * `sandboxd key create --e2b` (cli/keys.ts) as an operator runs it: the native key, then the same
 * key in E2B's form (docs/e2b.md "Names") as the last line, which a gateway on the same data dir
 * accepts as `X-API-KEY` on E2B's control plane; the native key is refused there only in form,
 * never in substance (it works too).
 */
import { afterAll, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { e2bKeyOf, nativeKeyOf } from "../../contracts/e2b/ids.ts";
import { type RunningGateway, startGateway } from "../../gateway/server.ts";
import { runCli } from "../support/e2e-service.ts";
import { MemoryAgent } from "../support/memory-agent.ts";

/** bin/sandboxd checks the host and node modules first; PGlite migrates on every open. */
const CLI_TIMEOUT_MS = 60_000;
const dataDir = mkdtempSync(join(tmpdir(), "sandboxd-keycli-e2b-"));
let gw: RunningGateway | null = null;
afterAll(async () => {
  await gw?.stop();
  rmSync(dataDir, { recursive: true, force: true });
});

test(
  "key create --e2b prints the native key, then its E2B form last; both open E2B's API",
  async () => {
    const env: NodeJS.ProcessEnv = { ...process.env };
    delete env.DATABASE_URL;
    const created = await runCli(
      ["key", "create", "--data-dir", dataDir, "--tenant", "acme", "--tier", "pro", "--e2b"],
      env,
      CLI_TIMEOUT_MS,
    );
    expect(created.code).toBe(0);
    const lines = created.stdout.trimEnd().split("\n");
    expect(lines).toHaveLength(2);
    const [native, e2b] = lines as [string, string];
    expect(native).toMatch(/^svc_pro_/);
    expect(e2b).toMatch(/^e2b_[0-9a-f]+$/);
    expect(e2b).toBe(e2bKeyOf(native));
    expect(nativeKeyOf(e2b)).toBe(native);
    expect(created.stderr).toContain("E2B's form");

    // Without --e2b: one line, the native key, as before.
    const plain = await runCli(
      ["key", "create", "--data-dir", dataDir, "--tenant", "acme", "--tier", "pro"],
      env,
      CLI_TIMEOUT_MS,
    );
    expect(plain.code).toBe(0);
    expect(plain.stdout.trimEnd().split("\n")).toHaveLength(1);

    // PGlite is one process's: the gateway starts once the CLI is done.
    gw = await startGateway({ port: 0, dataDir, agent: new MemoryAgent(), log: () => {} });
    for (const key of [e2b, native]) {
      const res = await fetch(`${gw.url}/e2b/v2/sandboxes`, { headers: { "x-api-key": key } });
      expect(res.status).toBe(200);
      expect(await res.json()).toEqual([]);
    }
    const wrong = await fetch(`${gw.url}/e2b/v2/sandboxes`, { headers: { "x-api-key": `${e2b}00` } });
    expect(wrong.status).toBe(401);
  },
  CLI_TIMEOUT_MS * 3,
);
