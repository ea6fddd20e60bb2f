/**
 * The gateway served by Node's http server through `@hono/node-server` (which turns
 * IncomingMessage/ServerResponse into web Request/Response for the fetch handler).
 */
import type { Server } from "node:http";
import type { AddressInfo } from "node:net";
import { serve } from "@hono/node-server";
import type { RunningServer, ServeOptions } from "./types.ts";

export async function serveNode(opts: ServeOptions): Promise<RunningServer> {
  const server = await new Promise<Server>((resolve, reject) => {
    const s = serve({
      fetch: opts.fetch,
      hostname: opts.hostname,
      port: opts.port,
      serverOptions: { requestTimeout: opts.requestTimeoutMs },
    }) as Server;
    s.once("listening", () => resolve(s));
    s.once("error", reject);
  });
  const addr = server.address() as AddressInfo;
  return {
    runtime: "node",
    hostname: opts.hostname,
    port: addr.port,
    stop: () =>
      new Promise<void>((resolve, reject) => {
        server.close((err) => (err ? reject(err) : resolve()));
        // Idle keep-alive connections would hold close() open until they time out.
        server.closeAllConnections();
      }),
  };
}
