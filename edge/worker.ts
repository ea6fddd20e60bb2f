/**
 * The edge's entry for Cloudflare Workers and workerd (docs/edge.md): a module worker whose
 * `fetch` serves every request through the edge app. The configuration comes from the worker's
 * bindings (edge/config.ts), parsed at the first request of an isolate and kept for the bindings
 * object it came with; a bad configuration answers 500 `internal` naming the binding.
 */
import { createEdgeApp, edgeError } from "./app.ts";
import { parseEdgeConfig } from "./config.ts";

type Handler = (req: Request) => Response | Promise<Response>;

/** One app per bindings object (one per isolate and deployment): nothing else outlives a request. */
const apps = new WeakMap<object, Handler>();

function handlerFor(env: Record<string, unknown>): Handler {
  const known = apps.get(env);
  if (known) return known;
  const parsed = parseEdgeConfig(env);
  let handler: Handler;
  if (!parsed.ok) {
    const message = `the edge is misconfigured: ${parsed.message}`;
    console.error(message);
    handler = () => edgeError("internal", message, crypto.randomUUID());
  } else {
    const { config } = parsed;
    const app = createEdgeApp({
      config,
      fetch: (req) => fetch(req),
      random: Math.random,
      clientAddress: (req) =>
        config.clientIpHeader === undefined
          ? undefined
          : (req.headers.get(config.clientIpHeader) ?? undefined),
      newRequestId: () => crypto.randomUUID(),
      log: (line) => console.error(line),
    });
    handler = (req) => app.fetch(req);
  }
  apps.set(env, handler);
  return handler;
}

export default {
  fetch(req: Request, env: Record<string, unknown>): Response | Promise<Response> {
    return handlerFor(env)(req);
  },
};
