/**
 * The public HTTP API: `createApp(deps)` builds a Hono app from its dependencies (db, agent,
 * config, clock); nothing global. Middleware order: error mapping (errors.ts) > auth (Bearer key
 * to tenant, tier, family) > per-key rate limit > routes. Body limits and validation happen at
 * the edge of each handler (http.ts), so that the template upload can stream.
 */
import { Hono } from "hono";
import type { AgentApi } from "../contracts/agent/api.ts";
import { SandboxdError } from "../contracts/errors.ts";
import type { Db } from "../db/client.ts";
import { FixedPlacement, type Placement } from "./agents/placement.ts";
import type { GatewayConfig } from "./config.ts";
import type { Clock, Deps, HonoEnv } from "./deps.ts";
import { errorResponse } from "./errors.ts";
import { verifyKey } from "./keys.ts";
import { RateLimiter } from "./rate-limit.ts";
import { RelayRegistry } from "./relay/registry.ts";
import { createSessionA, registerFamilyA } from "./routes/family-a.ts";
import { connect, createSandboxB, registerSandboxes } from "./routes/sandboxes.ts";
import { registerHealth, registerSystem } from "./routes/system.ts";
import { registerTemplates } from "./routes/templates.ts";

export interface CreateAppDeps {
  db: Db;
  agent: AgentApi;
  /** Where VMs go; without it every VM goes to `agent`, named by `config.agent`. */
  placement?: Placement;
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
    placement: input.placement ?? new FixedPlacement(input.db, input.agent, input.config.agent),
    config: input.config,
    clock: input.clock ?? Date.now,
    relays: input.relays ?? new RelayRegistry(),
  };
  const log = input.log ?? ((line: string) => console.error(line));
  const limiter = new RateLimiter(deps.config.limits.ratePerSecond, 1000, deps.clock);
  const rateLimited = new Map<string, number>();
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

  app.use("/v1/*", async (c, next) => {
    const header = c.req.header("authorization");
    const m = header === undefined ? null : /^Bearer\s+(\S+)\s*$/i.exec(header);
    if (!m) throw new SandboxdError("unauthorized", "missing API key: send Authorization: Bearer <key>");
    const principal = await verifyKey(deps.db, deps.config.keyPepper, m[1]!);
    if (!principal) throw new SandboxdError("unauthorized", "invalid API key");
    const wait = limiter.take(principal.keyId);
    if (wait > 0) {
      rateLimited.set(principal.keyId, (rateLimited.get(principal.keyId) ?? 0) + 1);
      throw new SandboxdError(
        "rate_limited",
        `more than ${deps.config.limits.ratePerSecond} requests per second`,
        {
          details: { retryAfterSeconds: wait },
        },
      );
    }
    c.set("principal", principal);
    await next();
  });

  // Shared path: the key's family picks the operation (spec 4.2: alias of POST /v1/sandboxes).
  app.post("/v1/sessions", (c) =>
    c.get("principal").family === "a" ? createSessionA(deps, c) : createSandboxB(deps, c),
  );
  app.get("/v1/sandboxes/:id/connect", (c) => connect(deps, c, c.get("principal")));
  registerFamilyA(app, deps);
  registerSandboxes(app, deps);
  registerTemplates(app, deps);
  registerSystem(app, deps, { rateLimited: (keyId) => rateLimited.get(keyId) ?? 0 });
  return app;
}
