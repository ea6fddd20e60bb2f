/**
 * Helpers of the suites that run a routing gateway with real agent HTTP servers
 * (tests/vm/agents-routing.test.ts, tests/integration/agent-credentials.test.ts) and of those that drive the
 * agent API's client. Test code only.
 */
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { type Dialer, startDialer } from "../../agent/api/dial.ts";
import { enroll } from "../../agent/api/enroll.ts";
import { type HeartbeatSender, startHeartbeats } from "../../agent/api/heartbeat.ts";
import type { SandboxDriver } from "../../agent/sandbox/drivers/driver.ts";
import type { SandboxManager } from "../../agent/sandbox/manager.ts";
import { type AgentServer, startAgentServer } from "../../agent/server.ts";
import { DIAL_URL_SCHEME, dialUrl } from "../../contracts/agent/dial.ts";
import type { AgentCredentials } from "../../contracts/agent/token.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { createEnrollmentToken } from "../../gateway/agents/enrollment.ts";
import { type RunningGateway, startGateway } from "../../gateway/server.ts";

/**
 * A gateway routing to enrolled agents (no fixed agent), on PGlite in a fresh temp dir, region
 * `eu`; `onCleanup` receives what stops it and removes the dir.
 */
export async function startRoutingGateway(opts: {
  agentSecret: string;
  staleAfterMs: number;
  onCleanup: (c: () => Promise<void>) => void;
  /** The key cache's short TTL (`StartGatewayOptions.keyCacheTtlMs`). */
  keyCacheTtlMs?: number;
  /** How long a create waits for a live agent (`GatewayConfig.agentWaitMs`). */
  agentWaitMs?: number;
  /** The gateway's log lines (default: dropped). */
  log?: (line: string) => void;
  /** A shared PostgreSQL (gateways of one region) instead of the gateway's own PGlite. */
  databaseUrl?: string;
  /** Default 0 (any free port). */
  port?: number;
  /** `StartGatewayOptions.peerUrl`. */
  peerUrl?: string;
}): Promise<RunningGateway> {
  const dir = await mkdtemp(join(tmpdir(), "sbx-route-gw-"));
  const gw = await startGateway({
    dataDir: dir,
    port: opts.port ?? 0,
    ...(opts.databaseUrl !== undefined ? { databaseUrl: opts.databaseUrl } : {}),
    // Gateways of one database hold the same secrets (gateway/fleet-secrets.ts): the test's.
    secrets: { keyPepper: `${opts.agentSecret}-pepper`, connectSecret: `${opts.agentSecret}-connect` },
    ...(opts.peerUrl !== undefined ? { peerUrl: opts.peerUrl } : {}),
    agentSecret: opts.agentSecret,
    staleAfterMs: opts.staleAfterMs,
    ...(opts.keyCacheTtlMs !== undefined ? { keyCacheTtlMs: opts.keyCacheTtlMs } : {}),
    config: {
      region: "eu",
      version: "test",
      ...(opts.agentWaitMs !== undefined ? { agentWaitMs: opts.agentWaitMs } : {}),
    },
    log: opts.log ?? (() => {}),
  });
  opts.onCleanup(async () => {
    await gw.stop();
    await rm(dir, { recursive: true, force: true });
  });
  return gw;
}

/** The `SandboxdError` `p` rejects with; anything else (or no rejection) fails the test. */
export async function errorOf(p: Promise<unknown>): Promise<SandboxdError> {
  try {
    await p;
  } catch (err) {
    if (err instanceof SandboxdError) return err;
    throw err;
  }
  throw new Error("expected a rejection");
}

/**
 * An agent HTTP server over `manager` that enrolls at `gw` with a fresh one-time token for
 * `region` (as `sandboxd agent --enroll` does) and heartbeats every `intervalMs` with its own key. The caller
 * stops `hb` and `server`.
 */
export async function startEnrolledAgent(opts: {
  gw: RunningGateway;
  agentSecret: string;
  manager: SandboxManager;
  stateDir: string;
  id: string;
  region: string;
  intervalMs: number;
  /** A BYOC agent: enrolled to dial out (`agent-token create --dial`), linked to `gw` by its dialer. */
  dial?: boolean;
  /** `AgentServerOptions.metricsToken`. */
  metricsToken?: string;
  /** `AgentServerOptions.otlpEndpoint`. */
  otlpEndpoint?: string;
}): Promise<{ credentials: AgentCredentials; server: AgentServer; hb: HeartbeatSender; dialer?: Dialer }> {
  const { gw, manager, stateDir, id } = opts;
  const { token } = await gw.withDb((db) =>
    createEnrollmentToken(db, opts.agentSecret, {
      region: opts.region,
      ...(opts.dial ? { url: DIAL_URL_SCHEME } : {}),
    }),
  );
  const credentials = await enroll({ gatewayUrl: gw.url, token, id, stateDir });
  const server = startAgentServer({
    manager,
    credentials,
    uploadDir: join(stateDir, "uploads"),
    hostname: "127.0.0.1",
    port: 0,
    version: "test",
    ...(opts.metricsToken !== undefined ? { metricsToken: opts.metricsToken } : {}),
    ...(opts.otlpEndpoint !== undefined ? { otlpEndpoint: opts.otlpEndpoint } : {}),
  });
  const dialer = opts.dial
    ? startDialer({
        gatewayUrls: [gw.url],
        credentials,
        target: { host: "127.0.0.1", port: Number(new URL(server.url).port) },
        log: () => {},
      })
    : undefined;
  const hb = startHeartbeats({
    gatewayUrl: gw.url,
    credentials,
    region: opts.region,
    advertiseUrl: opts.dial ? dialUrl(id) : server.url,
    capacity: () => manager.capacityNow(),
    templates: () => manager.readyTemplates(),
    intervalMs: opts.intervalMs,
  });
  return { credentials, server, hb, ...(dialer ? { dialer } : {}) };
}

/**
 * One public-API call to a gateway at `url` with `key`: a Uint8Array body goes as
 * `application/octet-stream`, anything else as JSON.
 */
export function callGateway(url: string, key: string, method: string, path: string, body?: unknown) {
  const raw = body instanceof Uint8Array;
  return fetch(`${url}${path}`, {
    method,
    headers: {
      authorization: `Bearer ${key}`,
      ...(body === undefined
        ? {}
        : { "content-type": raw ? "application/octet-stream" : "application/json" }),
    },
    ...(body === undefined ? {} : { body: raw ? body : JSON.stringify(body) }),
  });
}

/** A driver with no VMs and no templates: every VM operation is `unsupported` (agents that only enroll, beat and answer). */
export function inertDriver(): SandboxDriver {
  const no = async (): Promise<never> => {
    throw new SandboxdError("unsupported", "this test agent runs no VMs");
  };
  return {
    name: "inert",
    prepareTemplate: no,
    dropTemplate: no,
    restoreTemplate: no,
    spawn: no,
    fork: no,
    suspend: no,
    resume: no,
    pause: no,
    unpause: no,
    openTunnel: no,
    openPty: no,
    onGuestTunnel: () => {},
    destroy: no,
    onExit: () => {},
    diskBytes: no,
    adopt: no,
    reap: async () => [],
    detach: async () => {},
  };
}
