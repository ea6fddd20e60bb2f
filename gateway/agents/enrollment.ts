/**
 * Per-agent credentials on the gateway's side (contracts/agent/enroll.ts).
 *
 * - Enrollment tokens expire and are single use unless made for `uses` enrollments (a DaemonSet's
 *   pods, one token in a Secret for every node); only an HMAC of their secret is stored. Each
 *   enrollment counts its use in the same transaction that (re)keys the agent, by a conditional
 *   UPDATE, so racing redemptions never make more than `uses` agents.
 * - A token for several uses enrolls new ids only: it never re-keys an agent, enrolled or revoked,
 *   since every pod that started with it still holds it (a host whose agent the operator revoked
 *   must not come back with the same token). Re-keying is a token bound to one id (`agentId`).
 * - An agent's key is HMAC-SHA256(agent secret, id, key id): the gateway must hold every agent's
 *   key to sign its calls to that agent, and deriving it from the gateway's agent secret (a file
 *   in `<data>/secrets/` or `SANDBOXD_AGENT_SECRET`, never the database) means the `agents` table
 *   holds only the random key id. A leaked database alone signs nothing (docs/keys-and-auth.md "Agent credentials").
 * - Revoking an agent (registry.ts `revokeAgent`) clears its key id: its heartbeats and the
 *   gateway's calls to it stop at once, and it leaves placement. A new enrollment gives it a new key id, so the old key stays
 *   dead.
 * - The token names the region the agent is in, and may pin the URL it is reached at: both are
 *   written at enrollment and no heartbeat changes them (registry.ts `handleHeartbeat`), so only
 *   the operator who made the token decides which tenants' sandboxes a host may receive
 *   (docs/regions.md "Rules of regions").
 */
import { createHmac, randomBytes, timingSafeEqual } from "node:crypto";
import { and, eq, lt, sql } from "drizzle-orm";
import { DIAL_URL_SCHEME, dialUrl } from "../../contracts/agent/dial.ts";
import {
  DEFAULT_REGION,
  ENROLLMENT_TOKEN_RE,
  EnrollRequest,
  type EnrollResponse,
  RegionName,
} from "../../contracts/agent/enroll.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import type { Db } from "../../db/client.ts";
import { agentEnrollmentTokens, agents } from "../../db/schema/agents.ts";
import { jsonAnswer, parseJsonBody } from "./internal-http.ts";

/** Default life of an enrollment token: long enough to start a host by hand, short if leaked. */
export const DEFAULT_ENROLLMENT_TTL_S = 3600;

/**
 * The most agents one token may enroll: Kubernetes' largest supported cluster is 5,000 nodes, so
 * a DaemonSet never needs more; the bound catches typos, and a token that enrolls without end is
 * what counted uses exist to prevent.
 */
export const MAX_ENROLLMENT_USES = 5000;

function hmac(secret: string, ...parts: string[]): string {
  return createHmac("sha256", secret).update(parts.join("\0")).digest("hex");
}

/** The key of agent `id` under key id `keyId` (64 hex characters). */
export function deriveAgentKey(agentSecret: string, id: string, keyId: string): string {
  return hmac(agentSecret, "sandboxd-agent-key", id, keyId);
}

function tokenHash(agentSecret: string, secret: string): string {
  return hmac(agentSecret, "sandboxd-enrollment-token", secret);
}

export interface IssuedEnrollmentToken {
  token: string;
  id: string;
  expiresAt: Date;
}

export async function createEnrollmentToken(
  db: Db,
  agentSecret: string,
  opts: {
    ttlS?: number;
    agentId?: string;
    now?: Date;
    region?: string;
    url?: string;
    ownerTenant?: string;
    /** How many agents it may enroll (default 1); over 1, new ids only and no `agentId`. */
    uses?: number;
  } = {},
): Promise<IssuedEnrollmentToken> {
  const now = opts.now ?? new Date();
  const ttlS = opts.ttlS ?? DEFAULT_ENROLLMENT_TTL_S;
  if (!Number.isFinite(ttlS) || ttlS <= 0)
    throw new SandboxdError("bad_request", `token ttl must be positive, got ${ttlS}`);
  const uses = opts.uses ?? 1;
  if (!Number.isInteger(uses) || uses < 1 || uses > MAX_ENROLLMENT_USES)
    throw new SandboxdError("bad_request", `token uses must be 1-${MAX_ENROLLMENT_USES}, got ${uses}`);
  if (uses > 1 && opts.agentId !== undefined)
    throw new SandboxdError(
      "bad_request",
      "a token for one agent id (--agent) is single use; --uses is for new ids",
    );
  const region = opts.region ?? DEFAULT_REGION;
  if (!RegionName.safeParse(region).success)
    throw new SandboxdError("bad_request", `${region} is not a valid region name`);
  if (opts.url !== undefined && !URL.canParse(opts.url))
    throw new SandboxdError("bad_request", `${opts.url} is not a URL`);
  const id = randomBytes(8).toString("hex");
  const secret = randomBytes(32).toString("base64url");
  const expiresAt = new Date(now.getTime() + ttlS * 1000);
  await db.insert(agentEnrollmentTokens).values({
    id,
    hash: tokenHash(agentSecret, secret),
    agentId: opts.agentId ?? null,
    createdAt: now,
    expiresAt,
    region,
    url: opts.url ?? null,
    ownerTenant: opts.ownerTenant ?? null,
    uses,
  });
  return { token: `sbxe_${id}_${secret}`, id, expiresAt };
}

/**
 * Redeems `req.token` for agent `req.id`: returns the agent's id and its new key. Refused with
 * `unauthorized` when the token is unknown, altered, used up or expired; `forbidden` when it is
 * bound to another id; `conflict` when the id is enrolled and the token is not bound to it (a
 * token cannot take over another agent), and for a token of several uses when the id is known at
 * all (enrolled, revoked or never keyed). Only a successful enrollment spends a use.
 */
export async function enrollAgent(
  db: Db,
  agentSecret: string,
  req: EnrollRequest,
  now: Date = new Date(),
): Promise<EnrollResponse> {
  const refuse = (why: string) => new SandboxdError("unauthorized", `enrollment token refused: ${why}`);
  const m = ENROLLMENT_TOKEN_RE.exec(req.token);
  if (!m) throw refuse("malformed");
  const [, tokenId, secret] = m as unknown as [string, string, string];
  return db.transaction(async (tx) => {
    const [row] = await tx.select().from(agentEnrollmentTokens).where(eq(agentEnrollmentTokens.id, tokenId));
    const presented = Buffer.from(tokenHash(agentSecret, secret), "hex");
    const stored = Buffer.from(row?.hash ?? "", "hex");
    if (!row || stored.length !== presented.length || !timingSafeEqual(stored, presented))
      throw refuse("unknown token");
    const usedUp = () => refuse(row.uses === 1 ? "already used" : `all ${row.uses} uses spent`);
    if (row.useCount >= row.uses) throw usedUp();
    if (row.expiresAt.getTime() <= now.getTime()) throw refuse("expired");
    if (row.agentId !== null && row.agentId !== req.id)
      throw new SandboxdError("forbidden", `this token enrolls agent ${row.agentId} only, not ${req.id}`);
    const [existing] = await tx.select().from(agents).where(eq(agents.id, req.id));
    if (existing && row.uses > 1) {
      throw new SandboxdError(
        "conflict",
        `agent ${req.id} is known (${existing.keyId ? "enrolled" : "revoked or never keyed"}); a token of several uses enrolls new ids only: use a token made with --agent ${req.id}`,
      );
    }
    if (existing?.keyId && row.agentId !== req.id) {
      throw new SandboxdError(
        "conflict",
        `agent ${req.id} is already enrolled; revoke it first (sandboxd agent-token revoke ${req.id}) or use a token made with --agent ${req.id}`,
      );
    }
    // Racing redemptions of the last use: PostgreSQL re-reads the row after the first commits,
    // so only one finds a use left.
    const used = await tx
      .update(agentEnrollmentTokens)
      .set({ usedAt: now, usedBy: req.id, useCount: sql`${agentEnrollmentTokens.useCount} + 1` })
      .where(
        and(
          eq(agentEnrollmentTokens.id, tokenId),
          lt(agentEnrollmentTokens.useCount, agentEnrollmentTokens.uses),
        ),
      )
      .returning({ usedAt: agentEnrollmentTokens.usedAt });
    if (used.length !== 1) throw usedUp();
    const keyId = randomBytes(16).toString("hex");
    // The region is the token's, for good; an unpinned URL stays empty until the first
    // heartbeat, and without one the agent is not live.
    // A token for a dial-out agent (url `dial:`) pins it to `dial://<its id>`: it is reached only
    // through its own link, and no heartbeat can point the gateways at an address of its choosing.
    const set = {
      keyId,
      enrolledAt: now,
      revokedAt: null,
      lastHeartbeatAt: null,
      region: row.region,
      url: row.url === DIAL_URL_SCHEME ? dialUrl(req.id) : (row.url ?? ""),
      // A tenant's own agent (or, re-enrolled with a token for none, an operator's again).
      ownerTenant: row.ownerTenant,
      urlPinned: row.url !== null,
    };
    if (row.uses > 1) {
      // New ids only, also against a racing enrollment of the same id: the second insert waits
      // for the first and then inserts nothing, and its transaction (its use) is undone.
      const made = await tx
        .insert(agents)
        .values({ id: req.id, ...set })
        .onConflictDoNothing({ target: agents.id })
        .returning({ id: agents.id });
      if (made.length !== 1)
        throw new SandboxdError(
          "conflict",
          `agent ${req.id} was enrolled meanwhile; a token of several uses enrolls new ids only`,
        );
    } else {
      await tx
        .insert(agents)
        .values({ id: req.id, ...set })
        .onConflictDoUpdate({ target: agents.id, set });
    }
    return { id: req.id, key: deriveAgentKey(agentSecret, req.id, keyId) };
  });
}

/** `POST /internal/agents/enroll` (`ENROLL_PATH`, contracts/agent/enroll.ts). */
export async function handleEnroll(
  db: Db,
  agentSecret: string,
  request: Request,
  clock: () => number,
): Promise<Response> {
  const req = await parseJsonBody(request, EnrollRequest, "enrollment");
  if (!req.ok) return req.answer;
  try {
    return jsonAnswer(200, await enrollAgent(db, agentSecret, req.data, new Date(clock())));
  } catch (err) {
    if (!(err instanceof SandboxdError)) throw err;
    const status = { unauthorized: 401, forbidden: 403, conflict: 409 }[err.code as string] ?? 500;
    return jsonAnswer(status, { code: err.code, message: err.message });
  }
}
