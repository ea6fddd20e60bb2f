/**
 * What the gateway needs from the JavaScript runtime that hosts it: serve a fetch handler on a
 * host and port, report the port actually bound (port 0 = any free one), stop. One small adapter
 * per runtime (bun.ts, deno.ts, node.ts); everything else in gateway/ uses web APIs and node:*
 * modules that all three runtimes implement.
 */
export type RuntimeName = "bun" | "deno" | "node";

export type FetchHandler = (request: Request) => Response | Promise<Response>;

export interface ServeOptions {
  fetch: FetchHandler;
  hostname: string;
  /** 0 picks a free port; `RunningServer.port` tells which. */
  port: number;
  /**
   * How long one request may take, ms: a request may legitimately wait for a long exec (spec 8:
   * up to `maxExecTimeoutS`), so the runtime's own defaults (Bun 10 s idle, Node 300 s) are
   * raised to this.
   */
  requestTimeoutMs: number;
}

export interface RunningServer {
  runtime: RuntimeName;
  hostname: string;
  port: number;
  /** Stops accepting, closes open connections, resolves when the listener is closed. */
  stop(): Promise<void>;
}

export type Serve = (opts: ServeOptions) => Promise<RunningServer>;
