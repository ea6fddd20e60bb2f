/**
 * The public HTTP API: `createApp(deps)` builds a Hono app from its dependencies (db, agent,
 * config, clock); nothing global. Middleware order: error mapping (errors.ts) > auth
 * (auth/bearer.ts: Bearer key to tenant, tier, family) > per-key rate limit (auth/rate-limit.ts)
 * > routes. Body limits and validation happen at the edge of each handler (http.ts), so that the
 * template upload can stream.
 */
import { Hono } from "hono";
import type { Db } from "../db/client.ts";
import type { AgentApi } from "./agent-api.ts";
import { bearerKey } from "./auth/bearer.ts";
import { keyRateLimit } from "./auth/rate-limit.ts";
import type { GatewayConfig } from "./config.ts";
import type { Clock, Deps, HonoEnv } from "./deps.ts";
import { errorResponse } from "./errors.ts";
import { RelayRegistry } from "./relay/registry.ts";
import { createSessionA, registerFamilyA } from "./routes/family-a.ts";
import { connect, createSandboxB, registerSandboxes } from "./routes/sandboxes.ts";
import { registerHealth, registerSystem } from "./routes/system.ts";
import { registerTemplates } from "./routes/templates.ts";

export interface CreateAppDeps {
  db: Db;
  agent: AgentApi;
  config: GatewayConfig;
  clock?: Clock;
  log?: (line: string) => void;
  /** Connect relays of this process; one is made when not given. */
  relays?: RelayRegistry;
}

export function createApp(input: CreateAppDeps): Hono<HonoEnv> {
  const deps: Deps = {
    db: input.db,
    agent: input.agent,
    config: input.config,
    clock: input.clock ?? Date.now,
    relays: input.relays ?? new RelayRegistry(),
  };
  const log = input.log ?? ((line: string) => console.error(line));
  const rateLimit = keyRateLimit(deps.config.limits.ratePerSecond, deps.clock);
  const app = new Hono<HonoEnv>();

  app.onError((err, c) => errorResponse(err, c, log));
  app.notFound((c) =>
    c.json({ code: "not_found", message: `no route for ${c.req.method} ${c.req.path}` }, 404),
  );

  registerHealth(app, deps); // before auth: no key needed (spec 5.1)

  // A connect request carrying a scoped token and no key is authorised by the token (spec 5.5).
  app.get("/v1/sandboxes/:id/connect", async (c, next) => {
    if (c.req.header("authorization") === undefined && c.req.query("t") !== undefined) {
      return connect(deps, c, undefined);
    }
    await next();
  });

  app.use("/v1/*", bearerKey({ db: deps.db, pepper: deps.config.keyPepper }), rateLimit.middleware);

  // Shared path: the key's family picks the operation (spec 4.2: alias of POST /v1/sandboxes).
  app.post("/v1/sessions", (c) =>
    c.get("principal").family === "a" ? createSessionA(deps, c) : createSandboxB(deps, c),
  );
  app.get("/v1/sandboxes/:id/connect", (c) => connect(deps, c, c.get("principal")));
  registerFamilyA(app, deps);
  registerSandboxes(app, deps);
  registerTemplates(app, deps);
  registerSystem(app, deps, { rateLimited: rateLimit.refused });
  return app;
}
