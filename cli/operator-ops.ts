/**
 * The operator commands a running service runs for the CLI (cli/operator.ts): API keys, agent
 * enrollment tokens, usage and the fleet's cordons. Each takes JSON arguments and answers plain JSON (dates as ISO strings), the
 * same whether it ran in the service or in the CLI on the database.
 */
import { z } from "zod";
import { AgentId, DEFAULT_REGION, RegionName } from "../contracts/agent/enroll.ts";
import { Tier } from "../contracts/api/tiers.ts";
import { SandboxdError } from "../contracts/errors.ts";
import { agents } from "../db/schema/agents.ts";
import { createEnrollmentToken } from "../gateway/agents/enrollment.ts";
import { fleetAgents, setCordon } from "../gateway/agents/fleet.ts";
import { AGENT_STALE_AFTER_MS, revokeAgent } from "../gateway/agents/registry.ts";
import { createKey, keyIdOf, listKeys, revokeKey } from "../gateway/auth/keys.ts";
import type { GatewaySecrets } from "../gateway/auth/secrets.ts";
import { RECORD_TRANSITIONS } from "../gateway/core/record-states.ts";
import { tenantIdOf, usageReport } from "../gateway/core/usage.ts";
import type { RunningGateway } from "../gateway/server.ts";
import { type OperatorSocket, operatorOp, startOperatorSocket } from "./operator.ts";

const iso = (d: Date | null) => (d === null ? null : d.toISOString());

export const keyCreate = operatorOp(
  z.object({
    tenant: z.string().min(1),
    tier: Tier,
    name: z.string().optional(),
    region: RegionName.optional(),
  }),
  async ({ db, secrets, defaultRegion }, a) => {
    const region = a.region ?? defaultRegion;
    const issued = await createKey(db, secrets.keyPepper, {
      tenant: a.tenant,
      tier: a.tier,
      ...(a.name !== undefined ? { name: a.name } : {}),
      ...(region !== undefined ? { region } : {}),
    });
    return {
      key: issued.key,
      keyId: issued.keyId,
      prefix: issued.prefix,
      tier: issued.tier,
      region: issued.region,
    };
  },
);

export const keyList = operatorOp(z.object({ tenant: z.string().optional() }), async ({ db }, a) =>
  (await listKeys(db, a.tenant !== undefined ? { tenant: a.tenant } : {})).map((r) => ({
    ...r,
    createdAt: r.createdAt.toISOString(),
    revokedAt: iso(r.revokedAt),
  })),
);

export const keyRevoke = operatorOp(z.object({ id: z.string().min(1) }), async ({ db, keyRevoked }, a) => {
  if (!(await revokeKey(db, a.id))) throw new SandboxdError("not_found", `no active key ${a.id}`);
  // The serving gateway trusts a verified key for a second without its row: not this one.
  keyRevoked?.(keyIdOf(a.id));
  return { revoked: a.id };
});

export const agentTokenCreate = operatorOp(
  z.object({
    ttlS: z.number().int().positive(),
    agentId: AgentId.optional(),
    region: RegionName.optional(),
    url: z.string().url().optional(),
    tenant: z.string().min(1).optional(),
    uses: z.number().int().positive().optional(),
  }),
  async ({ db, secrets, defaultRegion }, a) => {
    const region = a.region ?? defaultRegion ?? DEFAULT_REGION;
    // A tenant's own agent: the tenant must exist (its id is what placement compares).
    const ownerTenant = a.tenant === undefined ? undefined : await tenantIdOf(db, a.tenant);
    if (a.tenant !== undefined && ownerTenant === undefined)
      throw new SandboxdError("not_found", `no tenant ${a.tenant}: create one of its keys first`);
    const issued = await createEnrollmentToken(db, secrets.agentSecret, {
      ttlS: a.ttlS,
      region,
      ...(a.agentId !== undefined ? { agentId: a.agentId } : {}),
      ...(a.url !== undefined ? { url: a.url } : {}),
      ...(ownerTenant !== undefined ? { ownerTenant } : {}),
      ...(a.uses !== undefined ? { uses: a.uses } : {}),
    });
    return {
      token: issued.token,
      id: issued.id,
      expiresAt: issued.expiresAt.toISOString(),
      region,
      uses: a.uses ?? 1,
    };
  },
);

export const agentTokenList = operatorOp(z.object({}), async ({ db }) => {
  const rows = await db.select().from(agents).orderBy(agents.id);
  return rows.map((r) => ({
    id: r.id,
    state: r.keyId ? "enrolled" : r.revokedAt ? "revoked" : "not enrolled",
    region: r.region,
    url: r.url,
    enrolledAt: iso(r.enrolledAt),
    revokedAt: iso(r.revokedAt),
    lastHeartbeatAt: iso(r.lastHeartbeatAt),
  }));
});

export const agentTokenRevoke = operatorOp(z.object({ id: z.string().min(1) }), async ({ db }, a) => {
  if (!(await revokeAgent(db, a.id))) throw new SandboxdError("not_found", `no enrolled agent ${a.id}`);
  return { revoked: a.id };
});

/** `sandboxd fleet list`: every agent, its state, cordon and live sandboxes (gateway/agents/fleet.ts). */
export const fleetList = operatorOp(z.object({}), async ({ db }) =>
  fleetAgents(db, Date.now(), AGENT_STALE_AFTER_MS, RECORD_TRANSITIONS.lost.from),
);

/** `sandboxd fleet cordon|uncordon|drain`: no new VM on the agent (`on`), or placeable again. */
export const fleetCordon = operatorOp(
  z.object({ id: z.string().min(1), on: z.boolean() }),
  async ({ db }, a) => {
    if (!(await setCordon(db, a.id, a.on, new Date())))
      throw new SandboxdError("not_found", `no agent ${a.id}`);
    return { id: a.id, cordoned: a.on };
  },
);

/** `sandboxd usage`: a tenant's usage over [from, to) from the same SQL as `GET /v1/usage`. */
export const usageRead = operatorOp(
  z.object({
    tenant: z.string().min(1),
    from: z.iso.datetime(),
    to: z.iso.datetime(),
    by: z.enum(["total", "sandbox", "day"]),
  }),
  async ({ db }, a) => {
    const tenantId = await tenantIdOf(db, a.tenant);
    if (!tenantId) throw new SandboxdError("not_found", `no tenant ${a.tenant}`);
    return usageReport(db, {
      tenantId,
      from: new Date(a.from),
      to: new Date(a.to),
      now: new Date(),
      by: a.by,
    });
  },
);

/** Every command by the name it has on the operator socket. */
export const OPERATOR_OPS = {
  "key.create": keyCreate,
  "key.list": keyList,
  "key.revoke": keyRevoke,
  "agent-token.create": agentTokenCreate,
  "agent-token.list": agentTokenList,
  "agent-token.revoke": agentTokenRevoke,
  "usage.read": usageRead,
  "fleet.list": fleetList,
  "fleet.cordon": fleetCordon,
};

/**
 * Serves these commands on the data dir's operator socket with a running gateway's database and
 * secrets (its key pepper and connect secret as it resolved them): `sandboxd key` and
 * `agent-token` while `up` or `gateway` runs.
 */
export function serveOperatorCommands(
  dataDir: string,
  gateway: RunningGateway,
  secrets: GatewaySecrets,
  log: (line: string) => void,
): Promise<OperatorSocket | undefined> {
  return startOperatorSocket({
    dataDir,
    ops: OPERATOR_OPS,
    withDb: gateway.withDb,
    keyRevoked: gateway.keyRevoked,
    defaultRegion: gateway.config.region,
    secrets: { ...secrets, keyPepper: gateway.config.keyPepper, connectSecret: gateway.config.connectSecret },
    log,
  });
}
