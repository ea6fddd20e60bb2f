/**
 * The gateway served by Node's http server through `@hono/node-server` (which turns
 * IncomingMessage/ServerResponse into web Request/Response for the fetch handler). WebSocket
 * upgrades arrive on the server's `upgrade` event instead; they go through the same fetch handler
 * (as a web Request with an `Upgrade`), and `ws` completes the handshake when the handler accepts.
 */
import { type IncomingMessage, type Server, STATUS_CODES } from "node:http";
import type { AddressInfo, Socket } from "node:net";
import { serve } from "@hono/node-server";
import { type WebSocket, WebSocketServer } from "ws";
import {
  HTTP_IDLE_TIMEOUT_S,
  type RunningServer,
  type RuntimeName,
  type ServeOptions,
  type SocketHandler,
  type Upgrade,
} from "./types.ts";
import { isUpgradeRequest, WS_IDLE_TIMEOUT_S, WS_MAX_MESSAGE_BYTES } from "./ws-limits.ts";

function webRequest(req: IncomingMessage, fallbackHost: string): Request {
  const headers = new Headers();
  for (const [name, value] of Object.entries(req.headers)) {
    if (value !== undefined) headers.set(name, Array.isArray(value) ? value.join(", ") : value);
  }
  return new Request(`http://${req.headers.host ?? fallbackHost}${req.url ?? "/"}`, {
    method: req.method ?? "GET",
    headers,
  });
}

/** Answers a refused upgrade with the handler's ordinary response, then closes the socket. */
async function writeResponse(socket: Socket, res: Response): Promise<void> {
  const body = Buffer.from(await res.arrayBuffer());
  let head = `HTTP/1.1 ${res.status} ${STATUS_CODES[res.status] ?? ""}\r\n`;
  res.headers.forEach((value, name) => {
    if (name !== "content-length" && name !== "transfer-encoding" && name !== "connection") {
      head += `${name}: ${value}\r\n`;
    }
  });
  head += `content-length: ${body.byteLength}\r\nconnection: close\r\n\r\n`;
  socket.end(Buffer.concat([Buffer.from(head, "latin1"), body]));
}

function wire(ws: WebSocket, socket: Socket, handler: SocketHandler, open: Set<WebSocket>): void {
  open.add(ws);
  // Node's ws does not ping by itself: one that missed a whole interval is cut (ws-limits.ts).
  let alive = true;
  const ping = setInterval(() => {
    if (!alive) return ws.terminate();
    alive = false;
    ws.ping();
  }, WS_IDLE_TIMEOUT_S * 1000);
  ws.on("pong", () => {
    alive = true;
  });
  ws.on("message", (data, isBinary) => {
    alive = true;
    const buf = Array.isArray(data)
      ? Buffer.concat(data)
      : data instanceof ArrayBuffer
        ? Buffer.from(data)
        : data;
    handler.message(isBinary ? buf : buf.toString("utf8"));
  });
  socket.on("drain", () => handler.drain());
  ws.on("error", () => {}); // a close event follows
  ws.on("close", (code, reason) => {
    clearInterval(ping);
    open.delete(ws);
    handler.close(code, reason.toString("utf8"));
  });
  handler.open({
    sendBinary: (data) => ws.send(data, { binary: true }),
    sendText: (data) => ws.send(data, { binary: false }),
    bufferedAmount: () => ws.bufferedAmount,
    pause: () => ws.pause(),
    resume: () => ws.resume(),
    close: (code, reason) => ws.close(code, reason),
  });
}

export function serveNode(opts: ServeOptions): Promise<RunningServer> {
  return serveNodeHttp(opts, "node");
}

/**
 * Serves on the runtime's `node:http` and `ws`: Node's own, or Deno's implementation of them
 * (deno.ts says why Deno uses it rather than `Deno.serve`).
 */
export async function serveNodeHttp(opts: ServeOptions, runtime: RuntimeName): Promise<RunningServer> {
  const idleMs = (opts.idleTimeoutS ?? HTTP_IDLE_TIMEOUT_S) * 1000;
  const server = await new Promise<Server>((resolve, reject) => {
    const s = serve({
      fetch: (request) => opts.fetch(request),
      hostname: opts.hostname,
      port: opts.port,
      // headersTimeout: the whole header block within the idle timeout (Node checks it every
      // `connectionsCheckingInterval`); keepAliveTimeout: idle between requests; requestTimeout:
      // the whole request, body included.
      serverOptions: {
        requestTimeout: opts.requestTimeoutMs,
        headersTimeout: idleMs,
        keepAliveTimeout: idleMs,
        connectionsCheckingInterval: Math.min(1000, idleMs),
      },
    }) as Server;
    s.once("listening", () => resolve(s));
    s.once("error", reject);
  });
  // One WebSocketServer per message limit: `ws` checks `maxPayload` while parsing a frame's
  // header, so a relay's own limit refuses an oversized message (1009) before it is read.
  const servers = new Map<number, WebSocketServer>();
  const wssFor = (limit: number) => {
    let wss = servers.get(limit);
    if (!wss) {
      wss = new WebSocketServer({
        noServer: true,
        maxPayload: Math.min(limit, WS_MAX_MESSAGE_BYTES),
        perMessageDeflate: false,
      });
      servers.set(limit, wss);
    }
    return wss;
  };
  const open = new Set<WebSocket>();
  server.on("upgrade", (req: IncomingMessage, socket: Socket, head: Buffer) => {
    socket.on("error", () => socket.destroy());
    const request = webRequest(req, opts.hostname);
    let accepted = false;
    const upgrade: Upgrade | undefined = isUpgradeRequest(request)
      ? (handler) => {
          accepted = true;
          wssFor(handler.maxMessageBytes).handleUpgrade(req, socket, head, (ws) =>
            wire(ws, socket, handler, open),
          );
          return new Response(null);
        }
      : undefined;
    Promise.resolve()
      .then(() => opts.fetch(request, upgrade))
      .then(
        (res) => (accepted ? undefined : writeResponse(socket, res)),
        () => socket.destroy(),
      )
      .catch(() => socket.destroy());
  });
  const addr = server.address() as AddressInfo;
  return {
    runtime,
    hostname: opts.hostname,
    port: addr.port,
    stop: () =>
      new Promise<void>((resolve, reject) => {
        server.close((err) => (err ? reject(err) : resolve()));
        // Idle keep-alive connections would hold close() open until they time out; upgraded
        // sockets are no longer the http server's, so they are ended here.
        server.closeAllConnections();
        for (const ws of open) ws.terminate();
      }),
  };
}
