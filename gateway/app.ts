/**
 * The public HTTP API: `createApp(deps)` builds a Hono app from its dependencies (db, agent,
 * config, clock); nothing global. In order: error mapping (errors.ts); the routes that need no
 * key (health, connect by token, the web console's static files); the key middleware (auth/bearer.ts: Bearer key to tenant, tier,
 * API) and the per-key rate limit (auth/rate-limit.ts) on every other `/v1/*` path; then one
 * sub-app per area of routes/. Hono runs the handlers of a request in the order they were added,
 * so a route mounted before the middleware answers without it. Body limits and validation happen
 * at the edge of each handler (http.ts), so that the template upload can stream.
 */

import { Hono } from "hono";
import type { AgentApi, AgentHostApi } from "../contracts/agent/api.ts";
import { SandboxdError } from "../contracts/errors.ts";
import type { LogFn } from "../contracts/log.ts";
import type { Metrics } from "../contracts/metrics.ts";
import type { Tracer } from "../contracts/trace.ts";
import type { Db } from "../db/client.ts";
import { FixedPlacement, type Placement } from "./agents/placement.ts";
import { bearerKey } from "./auth/bearer.ts";
import { VerifiedKeys } from "./auth/key-cache.ts";
import { KeyConnections } from "./auth/key-connections.ts";
import { keyRateLimit } from "./auth/rate-limit.ts";
import type { GatewayConfig } from "./config.ts";
import type { ActivityWriter } from "./core/activity.ts";
import type { Deadlines } from "./core/deadlines.ts";
import type { RowCache } from "./core/row-cache.ts";
import type { Clock, Deps, HonoEnv } from "./deps.ts";
import { mountE2b } from "./e2b/index.ts";
import { errorResponse } from "./errors.ts";
import { RelayRegistry } from "./relay/registry.ts";
import { requestContext } from "./request-context.ts";
import { connectRoutes, connectTokenRoutes } from "./routes/connect.ts";
import { consoleRoutes } from "./routes/console.ts";
import { fileRoutes } from "./routes/files.ts";
import { processRoutes } from "./routes/processes.ts";
import { ptyRoutes } from "./routes/pty.ts";
import { sandboxRoutes } from "./routes/sandboxes.ts";
import { execRoutes, sessionRoutes } from "./routes/sessions.ts";
import { snapshotRoutes } from "./routes/snapshots.ts";
import { healthRoutes, systemRoutes } from "./routes/system.ts";
import { imageRoutes, templateRoutes } from "./routes/templates.ts";

export interface CreateAppDeps {
  db: Db;
  /**
   * The calls that name no VM. Without `placement` it must be one whole agent (`AgentApi`), which
   * then takes every VM, named by `config.agent`; with it, the router over many agents.
   */
  agent: AgentHostApi;
  /** Where VMs go and which agent serves the calls on a VM (gateway/agents/placement.ts). */
  placement?: Placement;
  config: GatewayConfig;
  clock?: Clock;
  log?: LogFn;
  /** The process's operator metrics (contracts/metrics.ts): requests counted and timed. */
  metrics?: Metrics;
  /** Spans of the requests (contracts/trace.ts); none: only a client's trace id is logged. */
  tracer?: Tracer;
  /** Connect relays of this process; one is made when not given. */
  relays?: RelayRegistry;
  /** Long-lived connections by key (auth/key-connections.ts); one is made when not given. */
  connections?: KeyConnections;
  /** Ends of calls written behind (core/activity.ts); each end is its own UPDATE without. */
  activity?: ActivityWriter;
  /** Deadlines this process writes, for its deadline timer (core/deadlines.ts, core/reaper.ts). */
  deadlines?: Deadlines;
  /**
   * The database is this process's alone (PGlite): the rate limit's window is kept in memory
   * (auth/rate-limit.ts LocalRateLimiter) instead of shared through the database.
   */
  localRateLimit?: boolean;
  /** Verified keys of this process (auth/key-cache.ts); one is made when not given. */
  keys?: VerifiedKeys;
  /**
   * Sandbox rows from memory for the reads that only show one (core/row-cache.ts), kept true by
   * the database's notifications (the server LISTENs for it); none when not given.
   */
  rows?: RowCache;
}

/**
 * The `Deps` createApp serves with, defaults filled in; the server builds them once so that the
 * work it runs beside the app (the idle reaper) shares the app's placement and relays.
 */
export function appDeps(input: CreateAppDeps): Deps {
  return {
    db: input.db,
    agent: input.agent,
    placement: input.placement ?? placementOf(input),
    config: input.config,
    clock: input.clock ?? Date.now,
    relays: input.relays ?? new RelayRegistry(),
    connections:
      input.connections ?? new KeyConnections({ db: input.db, ...(input.log ? { log: input.log } : {}) }),
    ...(input.activity ? { activity: input.activity } : {}),
    ...(input.rows ? { rows: input.rows } : {}),
    ...(input.deadlines ? { deadlines: input.deadlines } : {}),
    ...(input.log ? { log: input.log } : {}),
  };
}

/** Whether `agent` also serves the calls on its VMs, as one whole agent does. */
function isWholeAgent(agent: AgentHostApi): agent is AgentApi {
  return typeof (agent as Partial<AgentApi>).exec === "function";
}

/** A misconfiguration, found when the app is built rather than at a sandbox's first call. */
function placementOf(input: CreateAppDeps): Placement {
  if (!isWholeAgent(input.agent)) {
    throw new SandboxdError("internal", "createApp: an agent that serves no VM calls needs a placement");
  }
  return new FixedPlacement(input.db, input.agent, input.config.agent);
}

export function createApp(input: CreateAppDeps): Hono<HonoEnv> {
  const deps = appDeps(input);
  const log: LogFn = input.log ?? ((line: string) => console.error(line));
  const rateLimit = keyRateLimit(deps.config.limits.ratePerSecond, deps.clock, deps.db, {
    local: input.localRateLimit === true,
  });
  const app = new Hono<HonoEnv>();

  app.use("*", requestContext(log, input.metrics, input.tracer));
  app.onError((err, c) => errorResponse(err, c, log));
  app.notFound((c) =>
    c.json({ code: "not_found", message: `no route for ${c.req.method} ${c.req.path}` }, 404),
  );

  const keys = input.keys ?? new VerifiedKeys({ db: deps.db, pepper: deps.config.keyPepper });
  // E2B's SDK (docs/e2b.md): its own key header and tokens; first, since a host
  // `<port>-<id>.<domain>` is the data plane whatever the path.
  mountE2b(app, deps, { keys, rateLimit });
  app.route("/v1", healthRoutes(deps)); // no key (docs/keys-and-auth.md#rules-of-authentication)
  app.route("/v1/sandboxes", connectTokenRoutes(deps, rateLimit.take)); // a scoped token instead of a key (docs/keys-and-auth.md#rules-of-authentication)
  app.route("/", consoleRoutes()); // the web console's static files; its API calls carry the key

  app.use("/v1/*", bearerKey(keys), rateLimit.middleware);
  // Any key changed somewhere (a notification): the keys holding connections are read again.
  const connections = deps.connections;
  if (connections) keys.watch(() => void connections.check());

  // Each route checks the key's API (auth/guards.ts requireApiMw) unless its path is shared by
  // both APIs, where the key's API picks the handler: POST /v1/sessions and /v1/templates.
  app.route("/v1/exec", execRoutes(deps, log));
  app.route("/v1/sessions", sessionRoutes(deps));
  app.route("/v1/sandboxes", sandboxRoutes(deps));
  app.route("/v1/sandboxes", connectRoutes(deps));
  app.route("/v1/snapshots", snapshotRoutes(deps));
  for (const api of ["sandboxes", "sessions"] as const) {
    app.route(`/v1/${api}`, processRoutes(deps, api));
    app.route(`/v1/${api}`, ptyRoutes(deps, api));
    app.route(`/v1/${api}`, fileRoutes(deps, api));
  }
  app.route("/v1/templates", templateRoutes(deps));
  app.route("/v1/images", imageRoutes(deps));
  app.route("/v1", systemRoutes(deps, { rateLimited: rateLimit.refused }));
  return app;
}
