/**
 * The gateway served by `Deno.serve`. The project type-checks against Bun's types, so the part
 * of the Deno namespace used here is declared locally.
 */
import type { RunningServer, ServeOptions, SocketHandler, Upgrade } from "./types.ts";
import { isUpgradeRequest } from "./ws-limits.ts";

interface DenoHttpServer {
  addr: { hostname: string; port: number };
  finished: Promise<void>;
  shutdown(): Promise<void>;
}

interface DenoServeNamespace {
  upgradeWebSocket(
    request: Request,
    options?: { idleTimeout?: number },
  ): { socket: WebSocket; response: Response };
  serve(
    options: { hostname: string; port: number; signal?: AbortSignal; onListen?: (addr: unknown) => void },
    handler: (request: Request) => Response | Promise<Response>,
  ): DenoHttpServer;
}

export async function serveDeno(opts: ServeOptions): Promise<RunningServer> {
  const deno = (globalThis as { Deno?: DenoServeNamespace }).Deno;
  if (!deno) throw new Error("serveDeno needs the Deno runtime");
  // onListen: Deno prints "Listening on ..." to stdout by default; the caller logs instead.
  // WebSockets: Deno.upgradeWebSocket gives a standard WebSocket, which can neither pause reading
  // nor report a drain; the relay polls `bufferedAmount` (gateway/relay/tcp.ts).
  const accept = (request: Request, handler: SocketHandler): Response => {
    const { socket, response } = deno.upgradeWebSocket(request);
    socket.binaryType = "arraybuffer";
    socket.onopen = () =>
      handler.open({
        sendBinary: (data) => socket.send(data),
        sendText: (data) => socket.send(data),
        bufferedAmount: () => socket.bufferedAmount,
        pause: () => {},
        resume: () => {},
        close: (code, reason) => socket.close(code, reason),
      });
    socket.onmessage = (e: MessageEvent) =>
      handler.message(typeof e.data === "string" ? e.data : new Uint8Array(e.data as ArrayBuffer));
    socket.onclose = (e: CloseEvent) => handler.close(e.code, e.reason);
    return response;
  };
  const server = deno.serve({ hostname: opts.hostname, port: opts.port, onListen: () => {} }, (request) => {
    const upgrade: Upgrade | undefined = isUpgradeRequest(request)
      ? (handler) => accept(request, handler)
      : undefined;
    return opts.fetch(request, upgrade);
  });
  return {
    runtime: "deno",
    hostname: opts.hostname,
    port: server.addr.port,
    stop: async () => {
      await server.shutdown();
      await server.finished;
    },
  };
}
