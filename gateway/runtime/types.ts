/**
 * What the gateway needs from the JavaScript runtime that hosts it: serve a fetch handler on a
 * host and port, report the port actually bound (port 0 = any free one), stop. One small adapter
 * per runtime (bun.ts, deno.ts, node.ts); everything else in gateway/ uses web APIs and node:*
 * modules that all three runtimes implement.
 */
export type RuntimeName = "bun" | "deno" | "node";

/**
 * The server side of one accepted WebSocket, the same under every runtime. Sends never block: a
 * caller that cares about memory checks `bufferedAmount()` and waits for `SocketHandler.drain`.
 */
export interface ServerSocket {
  sendBinary(data: Uint8Array): void;
  sendText(data: string): void;
  /** Bytes given to send* and not yet written to the network. */
  bufferedAmount(): number;
  /**
   * Stops reading from the client, which then sees TCP back-pressure; messages already read may
   * still arrive.
   */
  pause(): void;
  resume(): void;
  close(code: number, reason: string): void;
}

/** What runs an upgraded connection. Called by the runtime adapter, one socket per handler. */
export interface SocketHandler {
  /**
   * Largest client message this handler takes, bytes; the runtime closes with 1009 beyond where
   * it can apply a limit per socket (Node), and the handler checks it itself everywhere.
   */
  readonly maxMessageBytes: number;
  open(socket: ServerSocket): void;
  message(data: Uint8Array | string): void;
  /** The send queue went down after having been high (see `ServerSocket.bufferedAmount`). */
  drain(): void;
  /** The connection ended, whoever closed it. Called once. */
  close(code: number, reason: string): void;
}

/**
 * Given to the fetch handler with a request that asks for a WebSocket upgrade. Calling it accepts
 * the upgrade (the handler returns what it returns: the runtime then answers 101 itself); it
 * throws where the request cannot be upgraded after all.
 */
export type Upgrade = (handler: SocketHandler) => Response;

export type FetchHandler = (request: Request, upgrade?: Upgrade) => Response | Promise<Response>;

export interface ServeOptions {
  fetch: FetchHandler;
  hostname: string;
  /** 0 picks a free port; `RunningServer.port` tells which. */
  port: number;
  /**
   * How long one request may take, ms: a request may legitimately wait for a long exec (docs/limits.md "Public API limits":
   * up to `maxExecTimeoutS`), so the runtime's own defaults (Bun 10 s idle, Node 300 s) are
   * raised to this.
   */
  requestTimeoutMs: number;
  /**
   * Seconds a connection may take to send a request's headers, or stay idle between requests,
   * before the server closes it (default `HTTP_IDLE_TIMEOUT_S`). Every adapter applies it (Deno
   * through its node:http, which is why it does not use `Deno.serve`: deno.ts).
   */
  idleTimeoutS?: number;
}

/**
 * Default `ServeOptions.idleTimeoutS`: a client that opened a connection and sends no request
 * (or not all of its headers) for 30 s is cut, as is a keep-alive connection idle that long;
 * nginx's `client_header_timeout` is 60 s, Node's `headersTimeout` 60 s. A request being answered
 * is not idle: its handler's own deadlines bound it (`requestTimeoutMs`).
 */
export const HTTP_IDLE_TIMEOUT_S = 30;

export interface RunningServer {
  runtime: RuntimeName;
  hostname: string;
  port: number;
  /** Stops accepting, closes open connections, resolves when the listener is closed. */
  stop(): Promise<void>;
}

export type Serve = (opts: ServeOptions) => Promise<RunningServer>;
