/** The gateway served by `Bun.serve`. */
import type { RunningServer, ServeOptions } from "./types.ts";

/** Bun's idle timeout is at most 255 s; 0 turns it off. */
const BUN_MAX_IDLE_S = 255;

export async function serveBun(opts: ServeOptions): Promise<RunningServer> {
  const idleS = Math.ceil(opts.requestTimeoutMs / 1000);
  const server = Bun.serve({
    hostname: opts.hostname,
    port: opts.port,
    // A request may outlast Bun's 255 s cap (a 600 s exec): then no idle timeout at all, as under
    // Deno; the exec itself is bounded by its own timeout.
    idleTimeout: idleS > BUN_MAX_IDLE_S ? 0 : idleS,
    fetch: opts.fetch,
  });
  return {
    runtime: "bun",
    hostname: opts.hostname,
    port: server.port ?? opts.port,
    stop: () => server.stop(true),
  };
}
