/**
 * Runs the gateway as an HTTP server: opens the database (PGlite under `<dataDir>/pglite`, or
 * PostgreSQL at `databaseUrl`), loads the server secrets, resolves the config and serves
 * `createApp` with the hosting runtime's own server (runtime/: Bun.serve, or the runtime's
 * node:http server through @hono/node-server under Node and Deno). Nothing here is specific to one runtime.
 */

import { join } from "node:path";
import { isNotNull, sql } from "drizzle-orm";
import type { AgentApi } from "../contracts/agent/api.ts";
import { DIAL_PATH } from "../contracts/agent/dial.ts";
import { ENROLL_PATH } from "../contracts/agent/enroll.ts";
import { AGENT_EVENTS_PATH, type VmEvent } from "../contracts/agent/events.ts";
import { HEARTBEAT_PATH } from "../contracts/agent/heartbeat.ts";
import { secretKey } from "../contracts/agent/token.ts";
import { DEFAULT_DRAIN_DELAY_MS, DEFAULT_DRAIN_TIMEOUT_MS, Drain } from "../contracts/drain.ts";
import { SandboxdError } from "../contracts/errors.ts";
import type { LogFn } from "../contracts/log.ts";
import { Metrics, metricsAnswer } from "../contracts/metrics.ts";
import { Tracer } from "../contracts/trace.ts";
import { type Db, type DbHandle, openDb } from "../db/client.ts";
import { agents } from "../db/schema/agents.ts";
import type { AgentCallTelemetry } from "./agents/agent-http.ts";
import { DialHub } from "./agents/dial-hub.ts";
import { RELAY_PATH } from "./agents/dial-relay.ts";
import { handleEnroll } from "./agents/enrollment.ts";
import { handleAgentEvents } from "./agents/events-http.ts";
import { AGENT_STALE_AFTER_MS, handleHeartbeat, liveAgentIds } from "./agents/registry.ts";
import { AgentRouter } from "./agents/router.ts";
import { appDeps, createApp } from "./app.ts";
import { KEYS_CHANNEL, VerifiedKeys } from "./auth/key-cache.ts";
import { KeyConnections } from "./auth/key-connections.ts";
import { loadSecrets, type OperatorSecrets } from "./auth/secrets.ts";
import { type GatewayConfig, type GatewayConfigInput, resolveConfig } from "./config.ts";
import { ActivityWriter } from "./core/activity.ts";
import { applyAgentEvents } from "./core/agent-events.ts";
import { Deadlines } from "./core/deadlines.ts";
import { startHostLossSweeper } from "./core/host-loss.ts";
import { startReaper } from "./core/reaper.ts";
import { type Reconciler, startReconciler } from "./core/reconcile.ts";
import { ROWS_CHANNEL, RowCache } from "./core/row-cache.ts";
import { TemplateCatchUp } from "./core/template-catch-up.ts";
import type { Clock } from "./deps.ts";
import { checkFleetSecrets } from "./fleet-secrets.ts";
import { RelayRegistry } from "./relay/registry.ts";
import { answerAfterBody } from "./runtime/early-answer.ts";
import { type RunningServer, type RuntimeName, serveFetch } from "./runtime/index.ts";
import type { Upgrade } from "./runtime/types.ts";

export type StartGatewayOptions = {
  /** Default 8080; 0 picks a free port (see `RunningGateway.port`). */
  port?: number;
  /** Default 127.0.0.1. */
  hostname?: string;
  /**
   * One fixed agent (tests). Without it the gateway routes to the agents registered by
   * heartbeat (gateway/agents/router.ts) and serves `POST /internal/agents/enroll` and
   * `POST /internal/agents/heartbeat`.
   */
  agent?: AgentApi;
  /**
   * Routing mode: the gateway's agent secret, from which every enrolled agent's key is derived
   * (default `secrets.agentSecret`, else the data dir's). Agents never see it.
   */
  agentSecret?: string;
  /**
   * The secrets the operator set (cli/settings/ reads SANDBOXD_KEY_PEPPER, SANDBOXD_CONNECT_SECRET,
   * SANDBOXD_AGENT_SECRET): they win over the data dir's files; `config`'s win over them.
   */
  secrets?: OperatorSecrets;
  /** `SANDBOXD_METRICS_TOKEN`: `GET /metrics` answers a bearer of it; unset, there is none. */
  metricsToken?: string;
  /** `SANDBOXD_OTLP_ENDPOINT`: spans are exported there (OTLP/HTTP JSON); unset, they are not. */
  otlpEndpoint?: string;
  /**
   * Routing mode: this gateway's URL as the other gateways of its region reach it (`--peer-url`):
   * the links of dial-out agents it holds are offered to them (docs/regions.md "Gateways behind
   * one address"). None: its links serve this gateway only; it still relays through its peers'.
   */
  peerUrl?: string;
  /** Routing mode: heartbeat age after which an agent is not live (default gateway/agents/registry.ts). */
  staleAfterMs?: number;
  /**
   * Routing mode: heartbeat age after which an agent is lost and its sandboxes end `host_lost`,
   * and how often that is looked for (defaults gateway/core/host-loss.ts).
   */
  lostAfterMs?: number;
  lostSweepMs?: number;
  /** Overrides of the resolved config (secrets included, which then win over the data dir's). */
  config?: Partial<GatewayConfigInput>;
  clock?: Clock;
  log?: LogFn;
  /**
   * Seconds a connection may wait for a request's headers, or sit idle between requests, before
   * it is closed (default `HTTP_IDLE_TIMEOUT_S`, runtime/types.ts).
   */
  httpIdleTimeoutS?: number;
  /**
   * Runs the idle-session reaper (gateway/core/sandboxes.ts) every `limits.reaperIntervalS` while
   * the server runs (default true; every gateway process runs one). Off for tests that drive the
   * clock themselves.
   */
  reaper?: boolean;
  /**
   * How long a verified key is trusted while notifications of key changes are not known to arrive
   * (default `KEY_CACHE_TTL_MS`, auth/key-cache.ts). Tests set it long, so that only a
   * notification can end an entry within their bound.
   */
  keyCacheTtlMs?: number;
  /**
   * How often the keys holding connections are read again, ms (default `KEY_RECHECK_MS`,
   * auth/key-connections.ts). Tests set it long, so that only a notification or this process's
   * own revocation can end a connection within their bound.
   */
  keyRecheckMs?: number;
} & (
  | {
      /** Secrets (`<dataDir>/secrets`), uploads and, without `databaseUrl`, the PGlite db. */
      dataDir: string;
      /** PostgreSQL instead of PGlite (several gateway replicas share one). */
      databaseUrl?: string;
      /** With `databaseUrl`: db/client.ts `OpenDbOptions` (a direct LISTEN URL, migrate or not). */
      databaseListenUrl?: string;
      migrate?: boolean;
    }
  | {
      /** Without a data dir the secrets and `uploadDir` must come from `config` or `secrets`. */
      dataDir?: undefined;
      databaseUrl: string;
      databaseListenUrl?: string;
      migrate?: boolean;
    }
);

export interface RunningGateway {
  /** `http://<hostname>:<port>` with the port actually bound. */
  url: string;
  port: number;
  runtime: RuntimeName;
  config: GatewayConfig;
  /** The router, when the gateway routes to registered agents (no fixed `agent` given). */
  router?: AgentRouter;
  /**
   * Runs `fn` with the gateway's own db handle (over PGlite the only one this data dir can have
   * while the gateway runs), e.g. to register catalog templates. Refused after `stop()`.
   */
  withDb<T>(fn: (db: Db) => Promise<T>): Promise<T>;
  /**
   * A key revoked by this process (the operator socket's `key revoke`): the key middleware drops
   * it from its cache, so its next request here is refused (auth/key-cache.ts), and the key's
   * open connections here end at once (auth/key-connections.ts).
   */
  keyRevoked(keyId: string): void;
  /** The long-lived connections by key (auth/key-connections.ts): its state, for tests. */
  connections: KeyConnections;
  /** The rows the info reads serve from memory (core/row-cache.ts): its state, for tests. */
  rows: RowCache;
  /** The verified keys of the key middleware (auth/key-cache.ts): its state, for tests. */
  keys: VerifiedKeys;
  /** Stops the server (open connections are closed), then closes the database. Idempotent. */
  stop(): Promise<void>;
  /**
   * The graceful stop (contracts/drain.ts, SIGTERM): `/readyz` 503 at once, the requests in
   * flight waited for (after `delayMs`, up to `timeoutMs`), then `stop()`. Answers how many
   * requests were still running when it gave up.
   */
  drainAndStop(o?: { delayMs?: number; timeoutMs?: number }): Promise<number>;
}

function secretsWithoutDataDir(
  over: Partial<GatewayConfigInput>,
  set: OperatorSecrets,
): {
  keyPepper: string;
  connectSecret: string;
  uploadDir: string;
} {
  const keyPepper = over.keyPepper ?? set.keyPepper;
  const connectSecret = over.connectSecret ?? set.connectSecret;
  const uploadDir = over.uploadDir;
  if (!keyPepper || !connectSecret || !uploadDir) {
    throw new SandboxdError(
      "bad_request",
      "startGateway without dataDir needs keyPepper, connectSecret (config or secrets, i.e. " +
        "SANDBOXD_KEY_PEPPER, SANDBOXD_CONNECT_SECRET) and config.uploadDir",
    );
  }
  return { keyPepper, connectSecret, uploadDir };
}

/** The gateway's config: the caller's overrides over the secrets of its data dir (or given ones). */
function gatewayConfig(opts: StartGatewayOptions): GatewayConfig {
  const over = opts.config ?? {};
  const base =
    opts.dataDir !== undefined
      ? { ...loadSecrets(opts.dataDir, opts.secrets), uploadDir: join(opts.dataDir, "uploads") }
      : secretsWithoutDataDir(over, opts.secrets ?? {});
  return resolveConfig({
    ...over,
    keyPepper: over.keyPepper ?? base.keyPepper,
    connectSecret: over.connectSecret ?? base.connectSecret,
    uploadDir: over.uploadDir ?? base.uploadDir,
  });
}

/**
 * A routing gateway's (one given no in-process agent) agent secret and router; none for a
 * gateway with its own agent.
 */
/** A routing gateway's agent secret: the option, else the data dir's, else the operator's. */
function agentSecretOf(opts: StartGatewayOptions): string | undefined {
  return (
    opts.agentSecret ??
    (opts.dataDir !== undefined
      ? loadSecrets(opts.dataDir, opts.secrets).agentSecret
      : opts.secrets?.agentSecret)
  );
}

function agentRouting(
  opts: StartGatewayOptions,
  secret: string | undefined,
  db: Db,
  region: string,
  waitMs: number,
  clock: Clock,
  telemetry: AgentCallTelemetry,
): { router: AgentRouter; agentSecret: string; dial: DialHub } | undefined {
  if (opts.agent !== undefined) return undefined;
  if (!secret)
    throw new SandboxdError(
      "bad_request",
      "a routing gateway needs the agent secret (SANDBOXD_AGENT_SECRET)",
    );
  // Every agent's key derives from it: no weaker than one HS256 key (throws when short).
  secretKey(secret);
  const dial = new DialHub(opts.log, {
    db,
    agentSecret: secret,
    clock,
    ...(opts.peerUrl !== undefined ? { peerUrl: opts.peerUrl } : {}),
  });
  const router = new AgentRouter({
    db,
    agentSecret: secret,
    region,
    clock,
    dial,
    ...(opts.staleAfterMs !== undefined ? { staleAfterMs: opts.staleAfterMs } : {}),
    waitMs,
    telemetry,
  });
  return { router, agentSecret: secret, dial };
}

interface AgentRoutes {
  db: Db;
  agentSecret: string | undefined;
  /** Agents' dial-out links (routing gateways only). */
  dial: DialHub | undefined;
  clock: Clock;
  onHeartbeat: (agentId: string, previousAt: Date | null) => void;
  onEvents: (agentId: string, batch: { events: VmEvent[]; dropped: number }) => Promise<void>;
  log: (line: string) => void;
}

/** The server's handler: the agents' own routes (routing gateways only), else the public app. */
function gatewayFetch(app: ReturnType<typeof createApp>, agents: AgentRoutes) {
  const { db, agentSecret, clock, log } = agents;
  return (request: Request, upgrade?: Upgrade): Response | Promise<Response> => {
    // An agent that dials out opens its link here (gateway/agents/dial-hub.ts).
    if (agentSecret !== undefined && agents.dial && request.method === "GET") {
      const path = new URL(request.url).pathname;
      if (path === DIAL_PATH) return agents.dial.accept(db, agentSecret, request, upgrade);
      // A peer gateway relays its calls to an agent whose link is here (gateway/agents/dial-relay.ts).
      if (path === RELAY_PATH && agents.dial.relay) return agents.dial.relay.accept(request, upgrade);
    }
    // Agents enroll and report here (gateway/agents/); outside /v1: not part of the public API.
    if (agentSecret !== undefined && request.method === "POST") {
      const path = new URL(request.url).pathname;
      if (path === HEARTBEAT_PATH)
        return handleHeartbeat(db, agentSecret, request, clock, agents.onHeartbeat, log);
      if (path === AGENT_EVENTS_PATH)
        return handleAgentEvents(db, agentSecret, request, agents.onEvents, log);
      if (path === ENROLL_PATH) return handleEnroll(db, agentSecret, request, clock);
    }
    // `upgrade` reaches the connect route as a binding (HonoEnv); relays: gateway/relay/.
    if (upgrade) return app.fetch(request, { upgrade });
    // An error answered before the body was read drains it first (runtime/early-answer.ts).
    return Promise.resolve(app.fetch(request, {})).then((res) => answerAfterBody(request, res));
  };
}

/** No new work first (reconciler, reaper, server), then the writes in flight, then the database. */
async function stopInOrder(p: {
  reconciler: Reconciler | undefined;
  hostLoss: { stop(): void } | undefined;
  reaper: { stop(): Promise<void> } | undefined;
  server: RunningServer;
  activity: ActivityWriter;
  listener: { stop(): Promise<void> };
  handle: DbHandle;
}): Promise<void> {
  p.reconciler?.stop();
  p.hostLoss?.stop();
  try {
    await p.reaper?.stop();
    await p.server.stop();
  } finally {
    // Served calls' ends reach the database before it closes (core/activity.ts).
    await p.activity.stop();
    await p.listener.stop();
    await p.handle.close();
  }
}

/**
 * The rows against the agents' VMs: reconciliation for what their events missed
 * (gateway/core/reconcile.ts), and the sweep that ends the rows of agents that never come back
 * (gateway/core/host-loss.ts): quota and usage end with them.
 */
function watchAgents(
  opts: StartGatewayOptions,
  router: AgentRouter,
  truth: { db: DbHandle["db"]; clock: () => number; relays: RelayRegistry; rows: RowCache },
  log: (line: string) => void,
  config: GatewayConfig,
): { reconciler: Reconciler; hostLoss: { stop(): void }; catchUp: TemplateCatchUp } {
  const staleAfterMs = opts.staleAfterMs ?? AGENT_STALE_AFTER_MS;
  const { db, clock } = truth;
  const reconciler = startReconciler(
    { db, clock, relays: truth.relays, placement: router },
    { liveAgents: () => liveAgentIds(db, clock(), staleAfterMs), staleAfterMs, log },
  );
  const hostLoss = startHostLossSweeper(truth, {
    log,
    ...(opts.lostAfterMs !== undefined ? { lostAfterMs: opts.lostAfterMs } : {}),
    ...(opts.lostSweepMs !== undefined ? { intervalMs: opts.lostSweepMs } : {}),
  });
  // Templates baked before an agent joined reach it from its heartbeats (core/template-catch-up.ts).
  const catchUp = new TemplateCatchUp({ db, clock, placement: router, config }, log);
  return { reconciler, hostLoss, catchUp };
}

export async function startGateway(opts: StartGatewayOptions): Promise<RunningGateway> {
  const config = gatewayConfig(opts);
  const hostname = opts.hostname ?? "127.0.0.1";
  const handle: DbHandle = await openDb(
    opts.databaseUrl !== undefined
      ? {
          url: opts.databaseUrl,
          ...(opts.databaseListenUrl !== undefined ? { listenUrl: opts.databaseListenUrl } : {}),
          ...(opts.migrate !== undefined ? { migrate: opts.migrate } : {}),
        }
      : { dataDir: opts.dataDir! },
  );
  let server: RunningServer;
  let router: AgentRouter | undefined;
  let reaper: { stop(): Promise<void> } | undefined;
  let reconciler: Reconciler | undefined;
  let connections!: KeyConnections;
  let hostLoss: { stop(): void } | undefined;
  let catchUp: TemplateCatchUp | undefined;
  let routing: ReturnType<typeof agentRouting>;
  // A routing gateway's agent secret, read once: compared with the fleet's, then routed with.
  const agentSecret = opts.agent === undefined ? agentSecretOf(opts) : undefined;
  try {
    await checkFleetSecrets(handle.db, {
      key_pepper: config.keyPepper,
      connect_secret: config.connectSecret,
      agent_secret: agentSecret,
    });
  } catch (err) {
    await handle.close();
    throw err;
  }
  const drain = new Drain();
  const metrics = gatewayMetrics(handle, drain, opts.staleAfterMs);
  const tracer = new Tracer({
    service: "sandboxd-gateway",
    ...(opts.otlpEndpoint !== undefined ? { endpoint: opts.otlpEndpoint } : {}),
    log: opts.log ?? ((line: string) => console.error(line)),
  });
  metrics.counterFrom(
    "sandboxd_gateway_trace_spans_dropped_total",
    "Spans not exported (queue full, collector failing).",
    () => [{ labels: {}, value: tracer.dropped }],
  );
  const keys = new VerifiedKeys({
    db: handle.db,
    pepper: config.keyPepper,
    ...(opts.keyCacheTtlMs !== undefined ? { ttlMs: opts.keyCacheTtlMs } : {}),
  });
  const activity = new ActivityWriter(handle.db, opts.log ?? ((line: string) => console.error(line)));
  // Serves nothing until the LISTEN is in effect; reads go to the database meanwhile. The keys
  // keep their short TTL until then. One connection LISTENs for both.
  const rows = new RowCache();
  activity.rows = rows;
  const listener = handle.listen({ [ROWS_CHANNEL]: rows.events, [KEYS_CHANNEL]: keys.events });
  metrics.gauge(
    "sandboxd_gateway_database_listen_up",
    "1 while the LISTEN for row and key changes is in effect (reads served from memory), else 0.",
    () => [{ labels: {}, value: rows.serving ? 1 : 0 }],
  );
  try {
    const clock = opts.clock ?? Date.now;
    const log = opts.log ?? ((line: string) => console.error(line));
    const relays = new RelayRegistry();
    connections = new KeyConnections({
      db: handle.db,
      log,
      ...(opts.keyRecheckMs !== undefined ? { recheckMs: opts.keyRecheckMs } : {}),
    });
    routing = agentRouting(opts, agentSecret, handle.db, config.region, config.agentWaitMs, clock, {
      metrics,
      tracer,
    });
    router = routing?.router;
    const deps = appDeps({
      db: handle.db,
      agent: opts.agent ?? router!,
      ...(router ? { placement: router } : {}),
      config,
      relays,
      connections,
      activity,
      rows,
      deadlines: new Deadlines(),
      ...(opts.clock ? { clock: opts.clock } : {}),
    });
    const app = createApp({
      ...deps,
      metrics,
      tracer,
      keys,
      localRateLimit: handle.kind === "pglite",
      ...(opts.log ? { log: opts.log } : {}),
    });
    // The rows against the agents' VMs: their events as they happen (gateway/core/agent-events.ts)
    // and what watchAgents keeps.
    const truth = { db: handle.db, clock, relays };
    if (router)
      ({ reconciler, hostLoss, catchUp } = watchAgents(opts, router, { ...truth, rows }, log, config));
    const answer = gatewayFetch(app, {
      db: handle.db,
      agentSecret: routing?.agentSecret,
      dial: routing?.dial,
      clock,
      onHeartbeat: (id, previousAt) => {
        reconciler?.onHeartbeat(id, previousAt);
        catchUp?.onHeartbeat(id);
      },
      onEvents: async (agentId, batch) => {
        await applyAgentEvents(truth, agentId, batch.events, log);
        if (batch.dropped > 0) {
          reconciler?.onDropped(agentId, batch.dropped);
          metrics.inc(
            "sandboxd_gateway_agent_events_dropped_total",
            "VM events an agent dropped from its full queue (its sandboxes are reconciled instead).",
            { agent: agentId },
            batch.dropped,
          );
        }
      },
      log,
    });
    server = await serveFetch({
      // Probes first (no credentials); every other request counts as in flight for a drain.
      fetch: (request, upgrade) =>
        drain.probe(request, () => databaseAnswers(handle)) ??
        metricsAnswer(request, metrics, opts.metricsToken) ??
        drain.track(answer(request, upgrade)),
      hostname,
      port: opts.port ?? 8080,
      ...(opts.httpIdleTimeoutS !== undefined ? { idleTimeoutS: opts.httpIdleTimeoutS } : {}),
      // The longest exec a client may ask for, plus a minute for the VM around it.
      requestTimeoutMs: (config.limits.maxExecTimeoutS + 60) * 1000,
    });
    if (opts.reaper !== false) reaper = startReaper(deps, opts.log);
    // Links of dial-out agents held by this gateway's peers, relayed to (agents/dial-relay.ts).
    routing?.dial.relay?.start();
  } catch (err) {
    reconciler?.stop();
    hostLoss?.stop();
    await listener.stop();
    await handle.close();
    throw err;
  }
  return running({ hostname, server, config, router, handle, keys, connections, rows, drain }, () => {
    routing?.dial.stop();
    // The spans of the last requests go out before the process does (Tracer.close: bounded by
    // one export's timeout; a collector that is down loses them, counted).
    return stopInOrder({ reconciler, hostLoss, reaper, server, activity, listener, handle }).finally(() =>
      tracer.close(),
    );
  });
}

/** The handle `startGateway` answers: its URL, its parts tests look at, and the one stop. */
function running(
  p: {
    hostname: string;
    server: RunningServer;
    config: GatewayConfig;
    router: AgentRouter | undefined;
    handle: DbHandle;
    keys: VerifiedKeys;
    connections: KeyConnections;
    rows: RowCache;
    drain: Drain;
  },
  stopParts: () => Promise<void>,
): RunningGateway {
  const { hostname, server, router, handle, keys, connections } = p;
  const host = hostname.includes(":") ? `[${hostname}]` : hostname;
  let stopping: Promise<void> | undefined;
  return {
    url: `http://${host}:${server.port}`,
    port: server.port,
    runtime: server.runtime,
    config: p.config,
    ...(router ? { router } : {}),
    withDb: async (fn) => {
      if (stopping) throw new SandboxdError("internal", "the gateway is stopped");
      return fn(handle.db);
    },
    keyRevoked: (keyId) => {
      keys.forget(keyId);
      connections.revoke(keyId);
    },
    connections,
    rows: p.rows,
    keys,
    stop: () => {
      connections.stop();
      stopping ??= stopParts();
      return stopping;
    },
    drainAndStop: async (o = {}) => {
      const left = await p.drain.drain({
        delayMs: o.delayMs ?? DEFAULT_DRAIN_DELAY_MS,
        timeoutMs: o.timeoutMs ?? DEFAULT_DRAIN_TIMEOUT_MS,
      });
      connections.stop();
      stopping ??= stopParts();
      await stopping;
      return left;
    },
  };
}

/**
 * The gateway's gauges (docs/operations.md "Metrics"), read at each scrape: requests in flight,
 * the database answering, and per agent of the database its heartbeat's age, slots free and total,
 * and whether it is live, cordoned or lost. Requests are counted by the app (request-context.ts).
 */
function gatewayMetrics(handle: DbHandle, drain: Drain, staleAfterMs = AGENT_STALE_AFTER_MS): Metrics {
  const m = new Metrics();
  m.gauge("sandboxd_gateway_requests_in_flight", "Requests being answered now.", () => [
    { labels: {}, value: drain.active },
  ]);
  m.gauge("sandboxd_gateway_database_up", "1 when the database answers a query within 2 s.", async () => [
    { labels: {}, value: (await databaseAnswers(handle)) ? 1 : 0 },
  ]);
  const perAgent = async (value: (r: typeof agents.$inferSelect, now: number) => number) => {
    const now = Date.now();
    const rows = await handle.db.select().from(agents).where(isNotNull(agents.keyId));
    return rows.map((r) => ({ labels: { agent: r.id, region: r.region }, value: value(r, now) }));
  };
  m.gauge(
    "sandboxd_gateway_agent_heartbeat_age_seconds",
    "Seconds since each enrolled agent's last heartbeat.",
    () => perAgent((r, now) => (r.lastHeartbeatAt ? (now - r.lastHeartbeatAt.getTime()) / 1000 : -1)),
  );
  m.gauge("sandboxd_gateway_agent_live", "1 when the agent's heartbeat is fresh, else 0.", () =>
    perAgent((r, now) => (r.lastHeartbeatAt && now - r.lastHeartbeatAt.getTime() < staleAfterMs ? 1 : 0)),
  );
  m.gauge(
    "sandboxd_gateway_agent_slots_free",
    "VM slots free on each agent, as its last heartbeat said.",
    () => perAgent((r) => r.slotsFree),
  );
  m.gauge("sandboxd_gateway_agent_slots_total", "VM slots of each agent.", () =>
    perAgent((r) => r.slotsTotal),
  );
  m.gauge("sandboxd_gateway_agent_cordoned", "1 for an agent cordoned by the operator.", () =>
    perAgent((r) => (r.cordonedAt ? 1 : 0)),
  );
  m.gauge("sandboxd_gateway_agent_lost", "1 for an agent declared lost (its sandboxes ended).", () =>
    perAgent((r) => (r.lostAt ? 1 : 0)),
  );
  return m;
}

/** The gateway's readiness check: its database answers a trivial query within READY_DB_MS. */
async function databaseAnswers(handle: DbHandle): Promise<boolean> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  try {
    return await Promise.race([
      handle.db.execute(sql`select 1`).then(() => true),
      new Promise<boolean>((r) => {
        timer = setTimeout(() => r(false), READY_DB_MS);
      }),
    ]);
  } finally {
    clearTimeout(timer);
  }
}

/** A readiness probe's database check: a probe runs every few seconds, an answer takes ms. */
const READY_DB_MS = 2_000;
