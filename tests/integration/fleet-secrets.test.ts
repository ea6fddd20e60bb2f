/**
 * Secrets across a fleet (gateway/fleet-secrets.ts, docs/operations.md "Secrets across a fleet"):
 * routing gateways on one real PostgreSQL. Two with the same secrets both start; one with another
 * key pepper, or another agent secret, refuses to start naming the setting, and leaves the
 * database's fingerprints as they were; the fingerprints hold no secret. Skipped without
 * PostgreSQL binaries.
 */
import { afterAll, afterEach, beforeAll, expect, test } from "bun:test";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import postgres from "postgres";
import { type RunningGateway, startGateway } from "../../gateway/server.ts";
import { startPostgres, type TestPostgres } from "../support/postgres.ts";

/** A fresh server and three gateways' migrations on a loaded host. */
const TEST_TIMEOUT_MS = 90_000;
const FLEET = {
  keyPepper: "fleet-pepper-0123456789abcdef",
  connectSecret: "fleet-connect-0123456789abcdef",
  agentSecret: "fleet-agent-secret-0123456789abcdef-0123",
};

let pg: TestPostgres | null = null;
beforeAll(async () => {
  pg = await startPostgres();
}, 60_000);
afterAll(() => pg?.stop());
const cleanups: Array<() => Promise<void>> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

async function gateway(secrets: typeof FLEET): Promise<RunningGateway> {
  const dataDir = await mkdtemp(join(tmpdir(), "sbx-fleet-secrets-"));
  cleanups.push(() => rm(dataDir, { recursive: true, force: true }));
  const gw = await startGateway({
    port: 0,
    dataDir,
    databaseUrl: pg!.url,
    secrets,
    config: { region: "eu", version: "test" },
    log: () => {},
  });
  cleanups.push(() => gw.stop());
  return gw;
}

const refusal = (p: Promise<unknown>) =>
  p.then(
    () => "started",
    (e: unknown) => String((e as Error).message),
  );

test(
  "gateways sharing a database start with the fleet's secrets and refuse to start with others",
  async () => {
    if (!pg) return console.warn("PostgreSQL binaries not found: fleet secrets test skipped");
    await gateway(FLEET);
    await gateway(FLEET);
    const db = postgres(pg.url, { max: 1, onnotice: () => {} });
    const before = await db`select name, fingerprint from fleet_secrets order by name`;
    expect(before.map((r) => r.name)).toEqual(["agent_secret", "connect_secret", "key_pepper"]);
    // A fingerprint is no secret: none of the secrets (nor a part of one) is in the table.
    for (const r of before)
      for (const s of Object.values(FLEET)) expect(String(r.fingerprint)).not.toContain(s.slice(0, 12));

    const pepper = await refusal(gateway({ ...FLEET, keyPepper: "another-pepper-0123456789abc" }));
    expect(pepper).toContain("key_pepper differ");
    expect(pepper).toContain("SANDBOXD_KEY_PEPPER");
    const agent = await refusal(gateway({ ...FLEET, agentSecret: "another-agent-secret-0123456789abcdef" }));
    expect(agent).toContain("agent_secret differ");
    expect(agent).not.toContain("key_pepper");
    const after = await db`select name, fingerprint from fleet_secrets order by name`;
    expect(after).toEqual(before);
    await db.end();
  },
  TEST_TIMEOUT_MS,
);
