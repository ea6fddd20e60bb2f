/**
 * The gateway under Deno, served by Deno's own implementation of `node:http` and the `ws` package
 * (node.ts), not by `Deno.serve`. `Deno.serve` offers no header or idle timeout (its options are
 * the address, `signal`, `onListen`, `onError`; a connection that sends half a request's headers
 * stays open indefinitely), and the WebSocket from `Deno.upgradeWebSocket` cannot stop reading
 * from its client, so a relay could only cut a client that sends faster than the guest reads.
 * Deno's `node:http` server applies `headersTimeout`/`keepAliveTimeout`/`requestTimeout`, and
 * `ws` on its `node:net` socket pauses reading (TCP back-pressure to the client), so a gateway
 * under Deno keeps the same bounds as under Bun and Node (docs/operations.md "The HTTP edge under faults").
 */

import { SandboxdError } from "../../contracts/errors.ts";
import { serveNodeHttp } from "./node.ts";
import type { RunningServer, ServeOptions } from "./types.ts";

export function serveDeno(opts: ServeOptions): Promise<RunningServer> {
  if ((globalThis as { Deno?: unknown }).Deno === undefined)
    throw new SandboxdError("internal", "serveDeno needs the Deno runtime");
  return serveNodeHttp(opts, "deno");
}
