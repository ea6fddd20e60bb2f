/**
 * `sandboxd key` and `sandboxd agent-token` while `sandboxd up` runs on PGlite (the real service
 * as a subprocess, the real CLI): the commands go through the service's operator socket
 * (cli/operator.ts), so a created key works on the very next request and a revoked one is refused
 * on the next; nothing else opens the PGlite directory meanwhile: a second `up` on the data dir,
 * and the CLI when the socket does not answer, stop with an error naming the holder and the fix
 * (db/lock.ts). After `up` stops, the CLI opens the database itself again.
 */
import { describe, expect, test } from "bun:test";
import { statSync } from "node:fs";
import { rename } from "node:fs/promises";
import { join } from "node:path";
import { runCli } from "../support/e2e-service.ts";
import { useService } from "../support/service.ts";

/** `up` with --no-catalog boots no VM; its start is the gateway, the agent and one enrollment. */
const TEST_TIMEOUT_MS = 240_000;

// `up --no-catalog`; no keys: the tests make theirs with the CLI.
const fx = useService({ prefix: "sbx-e2e-keys-", python: false });

const env = (): NodeJS.ProcessEnv => {
  const e: NodeJS.ProcessEnv = { ...process.env };
  delete e.DATABASE_URL; // the data dir's PGlite, held by the running `up`
  delete e.SANDBOXD_DATA_DIR;
  return e;
};
const cli = (...args: string[]) => runCli([...args, "--data-dir", fx.dataDir], env());
const list = (key: string) => fx.svc.api.get("/v1/sandboxes", { key });

describe("while `sandboxd up` runs on PGlite", () => {
  test(
    "key create works on the next request, revoke refuses the next; agent tokens likewise",
    async () => {
      const sock = join(fx.dataDir, "operator", "sandboxd.sock");
      // Operator-only: the socket is the service user's alone, in a directory only it can enter.
      expect(statSync(sock).mode & 0o777).toBe(0o600);
      expect(statSync(join(fx.dataDir, "operator")).mode & 0o777).toBe(0o700);
      expect(statSync(sock).uid).toBe(process.getuid!());

      const created = await cli("key", "create", "--tenant", "acme", "--tier", "pro", "--name", "live");
      expect(created.code).toBe(0);
      const key = created.stdout.trim().split("\n").at(-1)!;
      // The tenant is made at home in `up`'s region (`local`), which its keys name.
      const keyId = /^svc_pro_local_([a-z0-9]{12})_[A-Za-z0-9]{40}$/.exec(key)?.[1];
      expect(keyId).toBeDefined();
      const first = await list(key);
      expect(first.status).toBe(200);
      expect(first.body).toEqual({ sandboxes: [], next_cursor: null });
      expect(fx.svc.logTail(200)).toContain("operator: key.create done");

      const listed = await cli("key", "list", "--tenant", "acme");
      expect(listed.code).toBe(0);
      expect(listed.stdout).toContain(`"keyId":"${keyId}"`);
      expect(listed.stdout).not.toContain(key.split("_").at(-1)!);

      // up's own agent enrolled itself: listed as enrolled; a new token is issued while it runs.
      const agentsListed = await cli("agent-token", "list");
      expect(agentsListed.code).toBe(0);
      expect(agentsListed.stdout).toContain(`"id":"local","state":"enrolled"`);
      const token = await cli("agent-token", "create", "--ttl", "5m");
      expect(token.code).toBe(0);
      expect(token.stdout.trim().split("\n").at(-1)).toMatch(/^sbxe_[a-f0-9]{16}_[A-Za-z0-9_-]{43}$/);
      const ghost = await cli("agent-token", "revoke", "ghost");
      expect(ghost.code).not.toBe(0);
      expect(ghost.stderr).toContain("no enrolled agent ghost");
      expect(fx.svc.logTail(200)).toContain("operator: agent-token.revoke failed");

      // `usage` reads the same database through the socket too (no second PGlite opener).
      const usage = await cli("usage", "--tenant", "acme", "--json");
      expect(usage.code).toBe(0);
      expect(JSON.parse(usage.stdout.trim()).lines).toBeArray();
      expect(fx.svc.logTail(200)).toContain("operator: usage.read done");
      const nobody = await cli("usage", "--tenant", "nobody");
      expect(nobody.code).not.toBe(0);
      expect(nobody.stderr).toContain("no tenant nobody");

      const revoked = await cli("key", "revoke", keyId!);
      expect(revoked.code).toBe(0);
      const refused = await list(key);
      expect(refused.status).toBe(401);
      expect((refused.body as { code: string }).code).toBe("unauthorized");
      const again = await cli("key", "revoke", keyId!);
      expect(again.code).not.toBe(0);
      expect(again.stderr).toContain(`no active key ${keyId}`);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "a second opener of the PGlite directory gets an error naming the holder and the fix",
    async () => {
      const second = await runCli(["up", "--port", "0", "--no-catalog", "--data-dir", fx.dataDir], env());
      expect(second.code).not.toBe(0);
      expect(second.stdout).not.toContain("listening");
      expect(second.stderr).toContain(`${join(fx.dataDir, "pglite")} is in use by process ${fx.svc.pid}`);
      expect(second.stderr).toContain("Stop that process first");

      // The CLI with no socket answering (here: moved away) does not open the directory either.
      const sock = join(fx.dataDir, "operator", "sandboxd.sock");
      await rename(sock, `${sock}.away`);
      try {
        const blocked = await cli("key", "list");
        expect(blocked.code).not.toBe(0);
        expect(blocked.stderr).toContain(`is in use by process ${fx.svc.pid}`);
        expect(blocked.stderr).toContain("does not answer");
      } finally {
        await rename(`${sock}.away`, sock);
      }
      // The service is unharmed: it still answers, and so does its socket.
      expect((await fx.svc.api.get("/v1/health")).status).toBe(200);
      expect((await cli("key", "list")).code).toBe(0);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "once `up` has stopped, the CLI opens the database itself",
    async () => {
      expect((await fx.stop()).exit).toBe(0);
      const created = await cli("key", "create", "--tenant", "acme", "--tier", "live");
      expect(created.code).toBe(0);
      const listed = await cli("key", "list", "--tenant", "acme");
      expect(listed.stdout.trim().split("\n")).toHaveLength(2);
    },
    TEST_TIMEOUT_MS,
  );
});
