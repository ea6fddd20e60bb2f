/**
 * The edge (docs/edge.md): a Hono app that runs in an edge isolate (Cloudflare Workers, workerd,
 * Deno Deploy) in front of the regional gateways. It authenticates nothing: it reads the region a
 * request's key (or connect token) names, without any database, and proxies the request (HTTP,
 * Server-Sent Events, WebSocket) to a gateway of that region; a request that names none goes to
 * the configured default region. Its own refusals are the service's `{code, message}` envelope
 * with the contract's status (contracts/api/error-status.ts).
 *
 * What it holds: nothing between requests (no timers, no sockets, no state but its config), and no
 * body: request and response bodies stream through as they come. The only things it reads whole
 * are header values and the `t` query parameter, each bounded by its parser (MAX_API_KEY_CHARS,
 * MAX_CONNECT_TOKEN_CHARS) on top of the runtime's own bound on a request's head.
 *
 * Imports: only contracts/ modules that import nothing at run time, and Hono. No node built-in
 * (tests/style/edge.test.ts bundles it for the browser and checks).
 */
import { Hono } from "hono";
import { parseApiKey, presentedKey } from "../contracts/api/api-key.ts";
import { connectTokenRegion } from "../contracts/api/connect-region.ts";
import { STATUS_OF_CODE } from "../contracts/api/error-status.ts";
import { nativeKeyOf, sandboxIdOfE2b } from "../contracts/e2b/ids.ts";
import type { PublicErrorCode } from "../contracts/errors.ts";
import type { EdgeConfig } from "./config.ts";

/** Names the region the edge sent a request to, on every answer that came through a gateway. */
export const REGION_HEADER = "x-sandboxd-edge-region";

/** What the edge is given by its runtime's entry (edge/worker.ts, edge/deno.ts). */
export interface EdgeDeps {
  config: EdgeConfig;
  /**
   * The runtime's fetch. workerd's carries a WebSocket upgrade and answers it with a 101 whose
   * `webSocket` the edge returns as it is.
   */
  fetch: (req: Request) => Promise<Response>;
  /** [0, 1): which of a region's gateways a request tries first. */
  random: () => number;
  /** The client's address as the runtime knows it (the peer, or a header the platform sets). */
  clientAddress: (req: Request) => string | undefined;
  /** A request id for a request that brings none (the gateway logs under the same id). */
  newRequestId: () => string;
  /**
   * A runtime whose fetch cannot carry a WebSocket (Deno) bridges upgrades itself: `target` is the
   * gateway's URL, `headers` what to send it. A rejection counts as a gateway that did not answer.
   */
  webSocket?: (req: Request, target: URL, headers: Headers) => Promise<Response>;
  log?: (line: string) => void;
}

/** Where a request goes, and what named the region. */
export interface EdgeRoute {
  region: string;
  by: "key" | "connect-token" | "access-token" | "default";
}

/** What names the region, in an `unknown_region` refusal. */
const NAMED_BY: Record<EdgeRoute["by"], string> = {
  key: "the API key",
  "connect-token": "the connect URL",
  "access-token": "the sandbox's access token",
  default: "the edge's default",
};

/** A connect by URL (docs/connect.md): `GET /v1/sandboxes/{id}/connect?...&t=<token>`. */
const CONNECT_PATH = /^\/v1\/sandboxes\/[^/]+\/connect$/;

/**
 * The region a request names: its key's (`Authorization: Bearer`, the WebSocket key subprotocol,
 * or `X-API-Key`, native or in E2B's form), else a connect URL's token's, else an E2B data-plane
 * call's `X-Access-Token` (its claim `reg`), else the default. A key or token that names no
 * region, or is no key at all, goes to the default region: the gateway there refuses what it must.
 */
export function routeOf(config: EdgeConfig, req: Request, url: URL): EdgeRoute {
  const header = (name: string) => req.headers.get(name) ?? undefined;
  const key = presentedKey(header) ?? header("x-api-key");
  const native = key === undefined ? undefined : nativeKeyOf(key);
  const keyRegion = native === undefined ? undefined : parseApiKey(native)?.region;
  if (keyRegion !== undefined) return { region: keyRegion, by: "key" };
  if (key === undefined) {
    const t = url.searchParams.get("t");
    const tokenRegion = t !== null && CONNECT_PATH.test(url.pathname) ? connectTokenRegion(t) : undefined;
    if (tokenRegion !== undefined) return { region: tokenRegion, by: "connect-token" };
    const access = header("x-access-token");
    const accessRegion = access === undefined ? undefined : connectTokenRegion(access);
    if (accessRegion !== undefined) return { region: accessRegion, by: "access-token" };
  }
  return { region: config.defaultRegion, by: "default" };
}

/** An E2B host's first label, `<port>-<E2B id>` (the gateway's own form: envd/index.ts `hostTarget`). */
const E2B_HOST_LABEL = /^[0-9]{1,5}-([a-z0-9-]{1,100})\./;
/** The longest `E2b-Sandbox-Id` read (an E2B id is at most 64 characters, a client id follows). */
const MAX_E2B_ID_CHARS = 128;

/**
 * The E2B sandbox a data-plane call names (its `E2b-Sandbox-Id` header, or a host
 * `<port>-<id>.<domain>`), undefined for any other call. Its calls all go to one gateway of the
 * region: a terminal, a process's tag and a watcher live in the gateway process that started them
 * (docs/e2b.md), and `SendInput` or `Update` for a terminal must reach that process.
 */
export function e2bSandboxOf(req: Request, url: URL): string | undefined {
  const e2bId =
    req.headers.get("e2b-sandbox-id")?.slice(0, MAX_E2B_ID_CHARS) ?? E2B_HOST_LABEL.exec(url.hostname)?.[1];
  // The id the gateway will serve (the client-id suffix dropped); one that cannot be an id: none.
  return e2bId === undefined ? undefined : sandboxIdOfE2b(e2bId);
}

/** FNV-1a, 32 bits: a stable spread of sandbox ids over a region's gateways (not a secret). */
function fnv1a(s: string): number {
  let h = 0x811c9dc5;
  for (let i = 0; i < s.length; i++) h = Math.imul(h ^ s.charCodeAt(i), 0x01000193);
  return h >>> 0;
}

/**
 * Headers that describe one connection, not the request (RFC 9110 7.6.1), never forwarded; with
 * them every header the request's `Connection` names. `host` is the gateway's, set by fetch.
 */
const HOP_BY_HOP = [
  "connection",
  "keep-alive",
  "proxy-authenticate",
  "proxy-authorization",
  "proxy-connection",
  "te",
  "trailer",
  "transfer-encoding",
  "upgrade",
  "host",
];

function stripHopByHop(headers: Headers): void {
  for (const named of (headers.get("connection") ?? "").split(",")) {
    const name = named.trim().toLowerCase();
    if (name !== "") headers.delete(name);
  }
  for (const name of HOP_BY_HOP) headers.delete(name);
}

/** The gateway's own rule for a client's request id (docs/api.md "Rules every route shares"). */
const REQUEST_ID = /^[A-Za-z0-9._-]{1,128}$/;

/** Methods retried on the next gateway when one does not answer: safe ones only (docs/edge.md "Retries"). */
const RETRIED = new Set(["GET", "HEAD", "OPTIONS"]);

/** Statuses whose answer has no body (RFC 9110 15.3.5, 15.4.5; 1xx). */
const NO_BODY = new Set([101, 204, 205, 304]);

function isWebSocketUpgrade(req: Request): boolean {
  return req.method === "GET" && req.headers.get("upgrade")?.toLowerCase() === "websocket";
}

/** An answer of the edge's own: the service's envelope, with the contract's status. */
export function edgeError(
  code: PublicErrorCode,
  message: string,
  requestId: string,
  retryAfterS?: number,
): Response {
  const headers: Record<string, string> = { "content-type": "application/json", "x-request-id": requestId };
  if (retryAfterS !== undefined) headers["retry-after"] = String(retryAfterS);
  return new Response(JSON.stringify({ code, message }), { status: STATUS_OF_CODE[code], headers });
}

/**
 * `Retry-After` of `gateway_unavailable`, seconds: a safe request has found every gateway of the
 * region down, an unsafe one the one it was sent to; a second later the edge picks again at
 * random, and a gateway back from a restart (seconds) answers.
 */
export const GATEWAY_RETRY_AFTER_S = 1;

export function createEdgeApp(deps: EdgeDeps): Hono {
  const app = new Hono();
  const log = deps.log ?? (() => {});
  app.all("*", (c) => proxy(deps, c.req.raw, log));
  app.onError((err, c) => {
    log(`edge: ${c.req.method} ${c.req.path}: ${err instanceof Error ? err.message : String(err)}`);
    const id = c.req.header("x-request-id");
    return edgeError("internal", "internal error", id && REQUEST_ID.test(id) ? id : deps.newRequestId());
  });
  return app;
}

async function proxy(deps: EdgeDeps, req: Request, log: (line: string) => void): Promise<Response> {
  const url = new URL(req.url);
  const given = req.headers.get("x-request-id");
  const requestId = given !== null && REQUEST_ID.test(given) ? given : deps.newRequestId();
  const route = routeOf(deps.config, req, url);
  const gateways = deps.config.regions.get(route.region);
  if (gateways === undefined) {
    return edgeError(
      "unknown_region",
      `${NAMED_BY[route.by]} names region ${route.region}, which this edge does not serve; send it to that region's address`,
      requestId,
    );
  }

  const headers = new Headers(req.headers);
  stripHopByHop(headers);
  const upgrade = isWebSocketUpgrade(req);
  if (upgrade) headers.set("upgrade", "websocket");
  const client = deps.clientAddress(req);
  const forwarded = req.headers.get("x-forwarded-for");
  if (client !== undefined) headers.set("x-forwarded-for", forwarded ? `${forwarded}, ${client}` : client);
  headers.set("x-forwarded-proto", url.protocol.replace(/:$/, ""));
  // The host the client asked for (fetch sets the gateway's own as Host): an E2B data-plane call
  // names its sandbox by it (`<port>-<id>.<domain>`, gateway/e2b/envd/index.ts). Set, not
  // appended: what a client claims came before is not the edge's to pass on.
  headers.set("x-forwarded-host", url.host);
  headers.set("x-request-id", requestId);

  // One gateway at random (for an E2B sandbox's data-plane call, the one its id picks), then (a
  // safe request that got no answer) the others in turn.
  const sticky = e2bSandboxOf(req, url);
  const first =
    sticky === undefined
      ? Math.floor(deps.random() * gateways.length) % gateways.length
      : fnv1a(sticky) % gateways.length;
  const order = [...gateways.slice(first), ...gateways.slice(0, first)];
  const tries = RETRIED.has(req.method) ? order : order.slice(0, 1);
  const failures: string[] = [];
  for (const base of tries) {
    const target = new URL(`${base}${url.pathname}${url.search}`);
    try {
      const res =
        upgrade && deps.webSocket
          ? await deps.webSocket(req, target, headers)
          : await deps.fetch(
              new Request(target.href, {
                method: req.method,
                headers,
                body: req.body,
                redirect: "manual",
                // A streamed request body (fetch's rule for a ReadableStream body); the runtimes
                // that do not know the option ignore it.
                ...({ duplex: "half" } as object),
              }),
            );
      return answer(res, route.region);
    } catch (err) {
      failures.push(`${target.origin}: ${err instanceof Error ? err.message : String(err)}`);
    }
  }
  log(`edge: ${req.method} ${url.pathname} [${requestId}]: region ${route.region}: ${failures.join("; ")}`);
  return edgeError(
    "gateway_unavailable",
    `no gateway of region ${route.region} answered; retry with backoff`,
    requestId,
    GATEWAY_RETRY_AFTER_S,
  );
}

/**
 * The gateway's answer as the client gets it: its status and body as they come (an event stream
 * streams), without hop-by-hop headers. A 101 is returned as it is: in workerd it holds the
 * WebSocket (`webSocket`), which a copy would lose.
 */
function answer(res: Response, region: string): Response {
  if (res.status === 101) return res;
  const headers = new Headers(res.headers);
  stripHopByHop(headers);
  headers.set(REGION_HEADER, region);
  return new Response(NO_BODY.has(res.status) ? null : res.body, {
    status: res.status,
    statusText: res.statusText,
    headers,
  });
}
