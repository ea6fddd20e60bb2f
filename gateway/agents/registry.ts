/**
 * The registry of host agents (the `agents` table) and the heartbeat that keeps it current.
 *
 * Agents report to the gateway over HTTP (`POST /internal/agents/heartbeat`), not by writing the
 * database themselves: the default database is PGlite, which one process (the gateway) owns, and
 * an agent host runs untrusted code, so it should hold no database credentials. A heartbeat
 * carries the agent's id, region, advertised URL and capacity; the first one registers it. It is
 * authenticated with the secret that gateway and agents already share (`SANDBOXD_AGENT_SECRET`),
 * in a token of its own audience, so a gateway->agent token can never pass as a heartbeat.
 */
import { and, eq, gt } from "drizzle-orm";
import { jwtVerify, SignJWT } from "jose";
import { z } from "zod";
import type { AgentCapacity } from "../../contracts/agent/api.ts";
import { secretKey } from "../../contracts/agent/token.ts";
import { describeError, SandboxdError } from "../../contracts/errors.ts";
import type { Db } from "../../db/client.ts";
import { agents } from "../../db/schema/agents.ts";

export type AgentRow = typeof agents.$inferSelect;

export const HEARTBEAT_PATH = "/internal/agents/heartbeat";
/** How often an agent reports: capacity shown to placement is at most this old (plus a hop). */
export const HEARTBEAT_INTERVAL_MS = 5_000;
/**
 * An agent whose last heartbeat is older than this is not live: three missed beats, so one slow
 * or lost beat does not take a healthy host out of placement, while a dead or frozen host stops
 * receiving creates, and its sandboxes' calls fail at once with `agent_unavailable`, within 15 s.
 */
export const AGENT_STALE_AFTER_MS = 3 * HEARTBEAT_INTERVAL_MS;

const HEARTBEAT_AUDIENCE = "sandboxd-gateway-heartbeat";
const AGENT_ISSUER = "sandboxd-agent";

export const Heartbeat = z.object({
  id: z.string().regex(/^[A-Za-z0-9._-]{1,64}$/),
  region: z.string().regex(/^[A-Za-z0-9._-]{1,64}$/),
  url: z.string().url(),
  capacity: z.object({
    slotsFree: z.number().int().min(0),
    slotsTotal: z.number().int().min(0),
    vcpusFree: z.number().int().min(0),
    memMibFree: z.number().int().min(0),
  }),
});
export type Heartbeat = z.infer<typeof Heartbeat>;

/** Registers the agent or refreshes its row (URL and region may change across restarts). */
export async function recordHeartbeat(db: Db, hb: Heartbeat, at: Date): Promise<void> {
  const set = {
    region: hb.region,
    url: hb.url,
    slotsTotal: hb.capacity.slotsTotal,
    slotsFree: hb.capacity.slotsFree,
    vcpusFree: hb.capacity.vcpusFree,
    memMibFree: hb.capacity.memMibFree,
    lastHeartbeatAt: at,
  };
  await db
    .insert(agents)
    .values({ id: hb.id, ...set })
    .onConflictDoUpdate({ target: agents.id, set });
}

/** Agents of `region` whose heartbeat is fresher than `staleAfterMs`. */
export async function liveAgents(
  db: Db,
  region: string,
  nowMs: number,
  staleAfterMs: number,
): Promise<AgentRow[]> {
  return db
    .select()
    .from(agents)
    .where(and(eq(agents.region, region), gt(agents.lastHeartbeatAt, new Date(nowMs - staleAfterMs))));
}

export function isLive(row: AgentRow, nowMs: number, staleAfterMs: number): boolean {
  return row.lastHeartbeatAt !== null && row.lastHeartbeatAt.getTime() > nowMs - staleAfterMs;
}

export async function signHeartbeatToken(key: Uint8Array): Promise<string> {
  return new SignJWT({})
    .setProtectedHeader({ alg: "HS256", typ: "JWT" })
    .setIssuer(AGENT_ISSUER)
    .setAudience(HEARTBEAT_AUDIENCE)
    .setIssuedAt()
    .setExpirationTime("30s")
    .sign(key);
}

/** The gateway's side: checks the token, validates the body, upserts the row. */
export async function handleHeartbeat(
  db: Db,
  key: Uint8Array,
  request: Request,
  clock: () => number,
): Promise<Response> {
  const json = (status: number, body: unknown) => Response.json(body, { status });
  const m = /^Bearer ([A-Za-z0-9_.-]+)$/.exec(request.headers.get("authorization") ?? "");
  if (!m) return json(401, { code: "unauthorized", message: "missing bearer token" });
  try {
    await jwtVerify(m[1]!, key, {
      algorithms: ["HS256"],
      audience: HEARTBEAT_AUDIENCE,
      issuer: AGENT_ISSUER,
      requiredClaims: ["exp", "iat"],
      clockTolerance: 5,
    });
  } catch {
    return json(401, { code: "unauthorized", message: "heartbeat token rejected" });
  }
  let body: unknown;
  try {
    body = await request.json();
  } catch {
    return json(400, { code: "bad_request", message: "heartbeat body is not JSON" });
  }
  const hb = Heartbeat.safeParse(body);
  if (!hb.success) return json(400, { code: "bad_request", message: hb.error.message });
  await recordHeartbeat(db, hb.data, new Date(clock()));
  return json(200, { ok: true });
}

export interface HeartbeatSender {
  /** Resolves after the first heartbeat was accepted (rejects if it was not). */
  first: Promise<void>;
  stop(): void;
}

/**
 * The agent's side: reports `capacity()` to the gateway now and every `intervalMs`. A failed beat
 * is logged and retried on the next tick (the gateway may be restarting).
 */
export function startHeartbeats(opts: {
  gatewayUrl: string;
  secret: string | Uint8Array;
  id: string;
  region: string;
  /** The URL the gateway reaches this agent at. */
  advertiseUrl: string;
  capacity: () => AgentCapacity;
  intervalMs?: number;
  log?: (m: string) => void;
}): HeartbeatSender {
  const key = secretKey(opts.secret);
  const url = `${opts.gatewayUrl.replace(/\/+$/, "")}${HEARTBEAT_PATH}`;
  const beat = async (): Promise<void> => {
    const body: Heartbeat = {
      id: opts.id,
      region: opts.region,
      url: opts.advertiseUrl,
      capacity: opts.capacity(),
    };
    const res = await fetch(url, {
      method: "POST",
      headers: {
        authorization: `Bearer ${await signHeartbeatToken(key)}`,
        "content-type": "application/json",
      },
      body: JSON.stringify(body),
      signal: AbortSignal.timeout(HEARTBEAT_INTERVAL_MS),
    });
    if (!res.ok) throw new SandboxdError("internal", `heartbeat refused: ${res.status} ${await res.text()}`);
  };
  const first = beat();
  first.catch((err) => opts.log?.(`heartbeat: ${describeError(err)}`));
  let busy = false;
  const timer = setInterval(() => {
    if (busy) return;
    busy = true;
    beat()
      .catch((err) => opts.log?.(`heartbeat: ${describeError(err)}`))
      .finally(() => {
        busy = false;
      });
  }, opts.intervalMs ?? HEARTBEAT_INTERVAL_MS);
  return { first, stop: () => clearInterval(timer) };
}
