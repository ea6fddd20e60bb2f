/**
 * Secrets across a fleet (docs/operations.md "Secrets across a fleet"): gateways that share one
 * database must hold the same key pepper (or none verifies another's keys), connect secret (or
 * one rejects the connect URLs another minted) and agent secret (or one cannot speak to the
 * agents another enrolled). Each data dir generates its own when none is set, so two gateways
 * pointed at one PostgreSQL without shared secrets would disagree silently. At start each
 * gateway compares the fingerprints of its secrets with the database's (`fleet_secrets`): the
 * first writes them, a later one with another refuses to start, naming the secret.
 */
import { createHmac } from "node:crypto";
import { SandboxdError } from "../contracts/errors.ts";
import type { Db } from "../db/client.ts";
import { fleetSecrets } from "../db/schema/fleet-secrets.ts";

/** What is hashed under each secret: a fixed label, versioned should the scheme change. */
const LABEL = "sandboxd fleet secret fingerprint v1";

/** An HMAC of LABEL under `secret`, hex, 32 characters: equal secrets, equal prints; nothing else. */
export function secretFingerprint(secret: string): string {
  return createHmac("sha256", secret).update(LABEL).digest("hex").slice(0, 32);
}

/** Where to set each one, for the refusal. */
const SETTING: Record<string, string> = {
  key_pepper: "SANDBOXD_KEY_PEPPER",
  connect_secret: "SANDBOXD_CONNECT_SECRET",
  agent_secret: "SANDBOXD_AGENT_SECRET",
};

/**
 * Records this gateway's secrets' fingerprints where none is yet, and throws `bad_request` when
 * the database holds another for any of them. An absent secret (a gateway with a fixed agent has
 * no agent secret) is neither written nor compared.
 */
export async function checkFleetSecrets(db: Db, secrets: Record<string, string | undefined>): Promise<void> {
  const mine = Object.entries(secrets).filter((e): e is [string, string] => e[1] !== undefined);
  if (mine.length === 0) return;
  await db
    .insert(fleetSecrets)
    .values(mine.map(([name, s]) => ({ name, fingerprint: secretFingerprint(s) })))
    .onConflictDoNothing();
  const held = new Map((await db.select().from(fleetSecrets)).map((r) => [r.name, r.fingerprint]));
  const differ = mine.filter(([name, s]) => held.get(name) !== secretFingerprint(s)).map(([name]) => name);
  if (differ.length > 0)
    throw new SandboxdError(
      "bad_request",
      `this gateway's ${differ.join(", ")} differ from the other gateways' on this database: set ${differ.map((n) => SETTING[n] ?? n).join(", ")} to the fleet's values (docs/operations.md "Secrets across a fleet")`,
      { details: { differ } },
    );
}
