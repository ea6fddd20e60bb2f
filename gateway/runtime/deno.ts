/**
 * The gateway served by `Deno.serve`. The project type-checks against Bun's types, so the part
 * of the Deno namespace used here is declared locally.
 */
import type { RunningServer, ServeOptions } from "./types.ts";

interface DenoHttpServer {
  addr: { hostname: string; port: number };
  finished: Promise<void>;
  shutdown(): Promise<void>;
}

interface DenoServeNamespace {
  serve(
    options: { hostname: string; port: number; signal?: AbortSignal; onListen?: (addr: unknown) => void },
    handler: (request: Request) => Response | Promise<Response>,
  ): DenoHttpServer;
}

export async function serveDeno(opts: ServeOptions): Promise<RunningServer> {
  const deno = (globalThis as { Deno?: DenoServeNamespace }).Deno;
  if (!deno) throw new Error("serveDeno needs the Deno runtime");
  // onListen: Deno prints "Listening on ..." to stdout by default; the caller logs instead.
  const server = deno.serve({ hostname: opts.hostname, port: opts.port, onListen: () => {} }, opts.fetch);
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
