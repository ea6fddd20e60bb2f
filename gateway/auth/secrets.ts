import { randomBytes } from "node:crypto";
import { mkdirSync, readFileSync, renameSync, writeFileSync } from "node:fs";
import { join } from "node:path";

/**
 * The gateway's server secrets: the key pepper (API key hashes), the connect-token secret and
 * the agent secret (every enrolled agent's key is derived from it: gateway/agents/enrollment.ts). From the environment when set (`SANDBOXD_KEY_PEPPER`,
 * `SANDBOXD_CONNECT_SECRET`, `SANDBOXD_AGENT_SECRET`: what several
 * gateway replicas over one PostgreSQL must share), else generated once into
 * `<dataDir>/secrets/` (0600). Never stored in the database: a leaked database alone does not
 * let anyone test guessed keys.
 */
export interface GatewaySecrets {
  keyPepper: string;
  connectSecret: string;
  /** The root of the per-agent keys (gateway/agents/enrollment.ts); agents never hold it. */
  agentSecret: string;
}

function fromFile(dir: string, name: string): string {
  const path = join(dir, name);
  try {
    return readFileSync(path, "utf8").trim();
  } catch {
    mkdirSync(dir, { recursive: true, mode: 0o700 });
    const value = randomBytes(32).toString("hex");
    // Write then rename so two processes starting at once cannot read a half-written secret;
    // the loser's rename replaces the winner's, so read back what is there.
    const tmp = `${path}.${process.pid}.tmp`;
    writeFileSync(tmp, value, { mode: 0o600 });
    try {
      renameSync(tmp, path);
    } catch {
      // another process won
    }
    return readFileSync(path, "utf8").trim();
  }
}

/**
 * The secrets the operator set (SANDBOXD_KEY_PEPPER, SANDBOXD_CONNECT_SECRET,
 * SANDBOXD_AGENT_SECRET, read by cli/settings/); an empty one counts as unset.
 */
export type OperatorSecrets = Partial<GatewaySecrets>;

export function loadSecrets(dataDir: string, set: OperatorSecrets = {}): GatewaySecrets {
  const dir = join(dataDir, "secrets");
  return {
    keyPepper: set.keyPepper || fromFile(dir, "key-pepper"),
    connectSecret: set.connectSecret || fromFile(dir, "connect-secret"),
    agentSecret: set.agentSecret || fromFile(dir, "agent-secret"),
  };
}
