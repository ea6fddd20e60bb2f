/**
 * The edge's entry for Deno and Deno Deploy (docs/edge.md): `Deno.serve` on the edge app, its
 * configuration from the environment (edge/config.ts), WebSocket upgrades through
 * edge/deno-websocket.ts. `deno run --allow-net --allow-env edge/deno.ts`; locally it listens on
 * `SANDBOXD_EDGE_HOST`:`SANDBOXD_EDGE_PORT` (default 0.0.0.0:8000; Deno Deploy picks its own) and
 * prints one JSON line `{"listening": URL}` once it does. A bad configuration exits 2 naming it.
 */
import { createEdgeApp } from "./app.ts";
import { parseEdgeConfig } from "./config.ts";
import { denoWebSocketBridge } from "./deno-websocket.ts";

interface DenoServeInfo {
  remoteAddr: { hostname: string };
}
declare const Deno: {
  env: { toObject(): Record<string, string> };
  serve(
    opts: { port: number; hostname: string; onListen: (a: { hostname: string; port: number }) => void },
    handler: (req: Request, info: DenoServeInfo) => Response | Promise<Response>,
  ): { finished: Promise<void> };
  upgradeWebSocket(req: Request, opts: { protocol?: string }): { socket: WebSocket; response: Response };
  exit(code: number): never;
};

const env = Deno.env.toObject();
const parsed = parseEdgeConfig(env);
if (!parsed.ok) {
  console.error(`sandboxd edge: ${parsed.message}`);
  Deno.exit(2);
}
const { config } = parsed;
const port = Number(env.SANDBOXD_EDGE_PORT ?? 8000);
if (!Number.isInteger(port) || port < 0 || port > 65535) {
  console.error(`sandboxd edge: SANDBOXD_EDGE_PORT must be a port, 0-65535 (0: any free one)`);
  Deno.exit(2);
}
/** Each request's peer, as Deno.serve tells it (a Request has no address of its own). */
const peers = new WeakMap<Request, string>();
const upstreamFetch = (req: Request) => fetch(req);
const app = createEdgeApp({
  config,
  fetch: upstreamFetch,
  random: Math.random,
  // Deno Deploy and `deno run` give the peer itself; a header is read only when one is named.
  clientAddress: (req) =>
    env.SANDBOXD_EDGE_CLIENT_IP_HEADER
      ? (req.headers.get(env.SANDBOXD_EDGE_CLIENT_IP_HEADER) ?? undefined)
      : peers.get(req),
  newRequestId: () => crypto.randomUUID(),
  webSocket: denoWebSocketBridge({
    upgradeWebSocket: (req, opts) => Deno.upgradeWebSocket(req, opts),
    fetch: upstreamFetch,
  }),
  log: (line) => console.error(line),
});

Deno.serve(
  {
    port,
    hostname: env.SANDBOXD_EDGE_HOST ?? "0.0.0.0",
    onListen: ({ hostname, port }) =>
      console.log(JSON.stringify({ listening: `http://${hostname}:${port}` })),
  },
  (req, info) => {
    peers.set(req, info.remoteAddr.hostname);
    return app.fetch(req);
  },
);
