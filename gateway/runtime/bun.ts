/** The gateway served by `Bun.serve`, WebSockets included (`server.upgrade` + `websocket`). */
import type { ServerWebSocket } from "bun";
import { SandboxdError } from "../../contracts/errors.ts";
import {
  HTTP_IDLE_TIMEOUT_S,
  type RunningServer,
  type ServeOptions,
  type ServerSocket,
  type SocketHandler,
  type Upgrade,
} from "./types.ts";
import { isUpgradeRequest, WS_IDLE_TIMEOUT_S, WS_MAX_MESSAGE_BYTES } from "./ws-limits.ts";

type WsData = { handler: SocketHandler };

function serverSocket(ws: ServerWebSocket<WsData>): ServerSocket {
  return {
    sendBinary: (data) => void ws.sendBinary(data),
    sendText: (data) => void ws.sendText(data),
    bufferedAmount: () => ws.getBufferedAmount(),
    pause: () => ws.pause(),
    resume: () => ws.resume(),
    close: (code, reason) => ws.close(code, reason),
  };
}

export async function serveBun(opts: ServeOptions): Promise<RunningServer> {
  const server = Bun.serve<WsData>({
    hostname: opts.hostname,
    port: opts.port,
    // Bun's one socket timeout covers the wait for a request's headers and the idle time between
    // requests. Once a request's headers are in, `srv.timeout(request, 0)` lifts it for that
    // request: a 600 s exec is silent for its whole run, over Bun's 255 s cap, and is bounded by
    // its own deadlines instead.
    idleTimeout: opts.idleTimeoutS ?? HTTP_IDLE_TIMEOUT_S,
    // The app bounds every body itself while streaming it (JSON bodies, template uploads up to
    // their 20 GiB limit, docs/limits.md); Bun's own default cap (128 MiB) refused larger
    // template uploads with a bare 413 before the app saw them.
    maxRequestBodySize: Number.MAX_SAFE_INTEGER,
    fetch: async (request, srv) => {
      srv.timeout(request, 0);
      let upgraded = false;
      const upgrade: Upgrade | undefined = isUpgradeRequest(request)
        ? (handler) => {
            if (!srv.upgrade(request, { data: { handler } })) {
              throw new SandboxdError("bad_request", "not a valid WebSocket upgrade request");
            }
            upgraded = true;
            return new Response(null);
          }
        : undefined;
      const response = await opts.fetch(request, upgrade);
      // After server.upgrade Bun answers 101 itself and wants no response.
      return upgraded ? undefined : response;
    },
    websocket: {
      idleTimeout: WS_IDLE_TIMEOUT_S,
      sendPings: true,
      maxPayloadLength: WS_MAX_MESSAGE_BYTES,
      // No drop or close on a full send queue: the relay bounds it (gateway/relay/).
      backpressureLimit: 0,
      closeOnBackpressureLimit: false,
      perMessageDeflate: false,
      open: (ws) => ws.data.handler.open(serverSocket(ws)),
      message: (ws, message) => ws.data.handler.message(message),
      drain: (ws) => ws.data.handler.drain(),
      close: (ws, code, reason) => ws.data.handler.close(code, reason),
    },
  });
  return {
    runtime: "bun",
    hostname: opts.hostname,
    port: server.port ?? opts.port,
    stop: () => server.stop(true),
  };
}
