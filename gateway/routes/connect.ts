/**
 * Connecting from outside (docs/sandboxes.md "Rules of the sandboxes API"): `POST /v1/sandboxes/{id}/connect-url` mints a token scoped
 * to one sandbox, port and protocol (auth/connect-token.ts); `GET /v1/sandboxes/{id}/connect`
 * takes a Bearer key or that token instead, then relays a WebSocket to the guest port
 * (gateway/relay/). Two sub-apps, because the token form must answer before the key middleware.
 */
import { type Context, Hono } from "hono";
import * as B from "../../contracts/api/sandboxes-api.ts";
import { bestEffort } from "../../contracts/best-effort.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { signConnectToken, verifyConnectTokenClaims } from "../auth/connect-token.ts";
import { requirePro } from "../auth/guards.ts";
import { keyIsLive, type Principal } from "../auth/keys.ts";
import { wakeIfIdle } from "../core/idle.ts";
import { ownRegion } from "../core/regions.ts";
import {
  agentOf,
  beginUseOf,
  getOwned,
  inTermsOf,
  requireAllowed,
  type SandboxRow,
} from "../core/sandboxes.ts";
import type { Deps, HonoEnv } from "../deps.ts";
import { holdForKey, logOf } from "../deps.ts";
import { jsonBody, query } from "../http.ts";
import { CdpRelay, connectDevTools } from "../relay/cdp.ts";
import type { RelayBase } from "../relay/common.ts";
import { TcpRelay } from "../relay/tcp.ts";
import type { Upgrade } from "../runtime/types.ts";

/**
 * Mounted at `/v1/sandboxes` before the key middleware: a connect request carrying a token `t` and no
 * Authorization header is authorised by the token alone (docs/keys-and-auth.md "Rules of authentication"). Any other request passes on,
 * to the key middleware and then `connectRoutes`.
 */
export function connectTokenRoutes(deps: Deps, rateLimit: (keyId: string) => Promise<void>): Hono<HonoEnv> {
  const app = new Hono<HonoEnv>();
  app.get("/:id/connect", async (c, next) => {
    if (c.req.header("authorization") === undefined && c.req.query("t") !== undefined) {
      return connect(deps, c, { rateLimit });
    }
    await next();
  });
  return app;
}

/**
 * Mounted at `/v1/sandboxes` behind the key middleware: minting connect URLs, and connecting with a
 * key. Both are Pro features, so each handler checks the tier (`requirePro`, which checks the API
 * first) where it needs it: connecting reads its query first.
 */
export function connectRoutes(deps: Deps): Hono<HonoEnv> {
  const app = new Hono<HonoEnv>();
  const max = () => deps.config.limits.maxJsonBodyBytes;

  app.post("/:id/connect-url", async (c) => {
    const p = c.get("principal");
    requirePro(p, "connect URLs");
    const req = await jsonBody(c, B.ConnectUrlRequest, max());
    const row = await getOwned(deps, p, c.req.param("id"));
    if (!Object.hasOwn(row.endpoints, String(req.port))) {
      throw new SandboxdError(
        "port_not_exposed",
        `port ${req.port} is not exposed by template ${row.templateId}`,
      );
    }
    const ttl = Math.min(req.ttl_seconds, deps.config.limits.connectTtlMaxS); // clamp, docs/sandboxes.md#rules-of-the-sandboxes-api
    const protocol = req.protocol ?? "tcp";
    const nowSecs = Math.floor(deps.clock() / 1000);
    const expSecs = nowSecs + ttl;
    const t = await signConnectToken(deps.config.connectSecret, {
      tenantId: p.tenantId,
      keyId: p.keyId,
      sandboxId: row.id,
      port: req.port,
      protocol,
      nowSecs,
      expSecs,
      // Read by an edge to route the connect to the tenant's region (docs/edge.md).
      region: await ownRegion(deps, p.tenantId),
    });
    const base = connectBase(deps.config.publicBaseUrl, c.req.url);
    const url = `${base.origin}/v1/sandboxes/${row.id}/connect?port=${req.port}&protocol=${protocol}&t=${encodeURIComponent(t)}`;
    return c.json({ url, expires_at: new Date(expSecs * 1000).toISOString() });
  });

  app.get("/:id/connect", (c) => connect(deps, c, c.get("principal")));
  return app;
}

/**
 * The origin of connect URLs: the operator's public URL when set, else the URL this request
 * reached (its scheme as this gateway serves it and the client's Host), so a gateway that serves
 * plain HTTP hands out `ws://` URLs that work as given. `http:` becomes `ws:`, `https:` `wss:`.
 */
export function connectBase(publicBaseUrl: string | undefined, requestUrl: string): URL {
  const base = new URL(publicBaseUrl ?? requestUrl);
  base.protocol = base.protocol === "http:" || base.protocol === "ws:" ? "ws:" : "wss:";
  return base;
}

/**
 * `GET /v1/sandboxes/{id}/connect` (docs/sandboxes.md "Rules of the sandboxes API") with the caller's principal (a Bearer key, checked
 * by the key middleware) or, without one, the scoped token `t`, checked here. Every check (token,
 * tier, ownership, port, state, that it is a WebSocket upgrade) runs before the upgrade, as does
 * opening the tunnel, so that those failures are HTTP statuses; after the upgrade, failures close
 * the WebSocket (gateway/relay/common.ts has the codes). A token connect counts against the
 * minting key's rate limit (`byToken.rateLimit`) as a keyed one does in the key middleware; every
 * connect takes one of the tenant's relay slots (`limits.relaysPerTenant`, 429 beyond).
 */
async function connect(
  deps: Deps,
  c: Context<HonoEnv>,
  principal: Principal | { rateLimit: (keyId: string) => Promise<void> },
) {
  const id = c.req.param("id") ?? "";
  const q = query(c, B.ConnectQuery);
  const protocol = q.protocol ?? "tcp";
  let row: SandboxRow;
  let who: Principal;
  if (!("rateLimit" in principal)) {
    requirePro(principal, "connect");
    await wakeIfIdle(deps, principal, id);
    row = await getOwned(deps, principal, id);
    who = principal;
  } else {
    const unauthorized = new SandboxdError("unauthorized", "invalid or expired connect token");
    if (q.t === undefined) throw new SandboxdError("unauthorized", "missing API key or connect token");
    const claims = await verifyConnectTokenClaims(deps.config.connectSecret, q.t, {
      sandboxId: id,
      port: q.port,
      protocol,
      nowMs: deps.clock(),
    });
    if (claims === undefined) throw unauthorized;
    await principal.rateLimit(claims.keyId);
    // Revoking the minting key revokes its tokens: refused like any invalid credential.
    if (!(await keyIsLive(deps.db, claims.keyId))) throw unauthorized;
    const { tenantId } = claims;
    // Deleting a sandbox revokes its tokens (docs/sandboxes.md "Rules of the sandboxes API"): getOwned accepts only a live record of
    // the token's tenant, and a revoked token is an invalid credential (401), not a 404.
    const tokenPrincipal: Principal = { tenantId, keyId: claims.keyId, tier: "pro", api: "sandboxes" };
    who = tokenPrincipal;
    const owned = async () => {
      await wakeIfIdle(deps, tokenPrincipal, id);
      return getOwned(deps, tokenPrincipal, id);
    };
    row = await owned().catch((err: unknown) => {
      throw err instanceof SandboxdError && err.code === "not_found" ? unauthorized : err;
    });
  }
  if (!Object.hasOwn(row.endpoints, String(q.port))) {
    throw new SandboxdError(
      "port_not_exposed",
      `port ${q.port} is not exposed by template ${row.templateId}`,
    );
  }
  requireAllowed(id, row.state, "connect");
  const upgrade = wsUpgrade(c);
  const agent = agentOf(deps, row);
  const dial = () => agent.openTunnel(row.vmId!, q.port, "tcp");
  return serveRelay(deps, upgrade, who, row, async () => {
    const tunnel = await inTermsOf(row, dial());
    if (protocol === "tcp") return new TcpRelay(tunnel);
    // The guest's DevTools port through tcp tunnels; failures from here on close the WebSocket.
    const upstream = await connectDevTools(tunnel, dial, q.port).catch((err: unknown) =>
      err instanceof Error ? err : new Error(String(err)),
    );
    return new CdpRelay(upstream);
  });
}

/** The runtime's upgrade for a request that asks for a WebSocket; 400 for one that does not. */
export function wsUpgrade(c: Context<HonoEnv>): Upgrade {
  if (c.req.header("upgrade")?.toLowerCase() !== "websocket") {
    throw new SandboxdError("bad_request", "this endpoint needs a WebSocket upgrade");
  }
  const upgrade = c.env?.upgrade;
  if (!upgrade) throw new SandboxdError("internal", "this server cannot upgrade to a WebSocket");
  return upgrade;
}

/**
 * The end every relay route shares once its checks passed: takes one of the tenant's relay slots
 * (`limits.relaysPerTenant`, 429 beyond), counts the relay as a call in flight on the sandbox,
 * opens the guest side with `open` (its failures are still HTTP statuses), registers the relay
 * (deleting the sandbox ends it; so does revoking `p`'s key, auth/key-connections.ts) and upgrades.
 */
export async function serveRelay(
  deps: Deps,
  upgrade: Upgrade,
  p: Principal,
  row: SandboxRow,
  open: () => Promise<RelayBase>,
): Promise<Response> {
  const max = deps.config.limits.relaysPerTenant;
  const release = deps.relays ? deps.relays.reserve(row.tenantId, max) : () => {};
  if (!release) {
    throw new SandboxdError(
      "quota_exceeded",
      `this tenant already holds ${max} relays (connects and terminals)`,
    );
  }
  // An open relay is a call in flight, from before the dial to its end, taken with the same
  // compare-and-set as an exec: the reaper does not suspend or delete the sandbox under it, and a
  // relay on a sandbox the reaper claimed first is refused (410 or 409) instead of opened.
  const use = await beginUseOf(deps, p, row, "connect").catch((err: unknown) => {
    release();
    throw err;
  });
  let relay: RelayBase;
  try {
    relay = await open();
  } catch (err) {
    release();
    await bestEffort(logOf(deps), `ending the connect call on ${row.id}`, use.end());
    throw err;
  }
  const unregister = deps.relays ? deps.relays.add(row.id, relay) : () => {};
  // Under the key that opened it (a token's minting key): revoking that key ends it.
  const unhold = holdForKey(deps, p.keyId, relay);
  relay.registered(() => {
    unregister();
    unhold();
    release();
    void bestEffort(logOf(deps), `ending the connect call on ${row.id}`, use.end());
  });
  try {
    return upgrade(relay);
  } catch (err) {
    relay.close(1011, "upgrade failed");
    throw err;
  }
}
