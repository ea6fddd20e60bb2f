/**
 * `sandboxd up`: the embedded deployment, the gateway and one host agent in one process. The
 * gateway reaches the agent over its real HTTP API on loopback (the same path a multi-host
 * deployment uses), so there is one code path, not an in-process shortcut. The agent enrolls
 * like any other, with a one-time token this process makes for it, and keeps its key in
 * `<data>/agent/credentials.json`; a later `up` reuses that key while the gateway still knows it.
 */
import { mkdir } from "node:fs/promises";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { enroll, readCredentials } from "../agent/api/enroll.ts";
import { EventReporter } from "../agent/api/events.ts";
import { roomChanged, startHeartbeats } from "../agent/api/heartbeat.ts";
import { startAgentServer } from "../agent/server.ts";
import type { AgentCredentials } from "../contracts/agent/token.ts";
import { TCG_BOUNDARY } from "../contracts/api/health.ts";
import { settled } from "../contracts/best-effort.ts";
import { createEnrollmentToken } from "../gateway/agents/enrollment.ts";
import { enrolledAgent } from "../gateway/agents/registry.ts";
import { loadSecrets } from "../gateway/auth/secrets.ts";
import { type RunningGateway, startGateway } from "../gateway/server.ts";
import { lockDownDataDir } from "./data-dir.ts";
import { installFaultHandlers } from "./faults.ts";
import { installHeapStatsSignal } from "./heap-stats.ts";
import { serveOperatorCommands } from "./operator-ops.ts";
import { catalogOf, openAgentManager, parsePort, registerCatalog, startCatalogBuild } from "./serve.ts";
import type { Settings } from "./settings/parse.ts";
import {
  agentSettings,
  dataDirOf,
  drainOptions,
  gatewayLimits,
  gatewayStart,
  metricsToken,
  otlpEndpoint,
  reportedSettings,
  settingFlags,
  settingsOrRefuse,
} from "./settings.ts";

export async function cmdUp(args: string[], version: string, log: (m: string) => void): Promise<number> {
  const { values } = parseArgs({
    args,
    options: {
      port: { type: "string" },
      host: { type: "string" },
      "data-dir": { type: "string" },
      "public-url": { type: "string" },
      "no-catalog": { type: "boolean" },
      catalog: { type: "string" },
      ...settingFlags(),
    },
  });
  const settings = settingsOrRefuse(values);
  if (!settings) return 2;
  const port = parsePort(values.port, 8080);
  const catalogTemplates = catalogOf(values.catalog);
  const dataDir = values["data-dir"] ?? dataDirOf(settings);
  await lockDownDataDir(dataDir, log);
  const stateDir = join(dataDir, "agent");
  await mkdir(stateDir, { recursive: true });
  const secrets = loadSecrets(dataDir, gatewayStart(settings).secrets);
  const removeFaultHandlers = installFaultHandlers(log);
  const removeHeapStats = installHeapStatsSignal(settings.SANDBOXD_HEAP_STATS === "1");

  // State changes of the agent's VMs, queued until the gateway is up and the agent enrolled.
  const events = new EventReporter({ log });
  // The gateway routes to enrolled agents (gateway/agents/router.ts); its one agent enrolls and
  // registers by heartbeat like any other, as agent `local` in region `local`.
  const gateway = await startUpGateway(settings, { port, host: values.host, dataDir, version, log }, secrets);
  // The agent's manager opens after the gateway: over PGlite the gateway's database lock
  // (db/lock.ts) is what stops a second `up` on this data dir, before it touches any VM.
  const agent = agentSettings(settings);
  const manager = await openAgentManager(dataDir, stateDir, log, events, undefined, agent).catch(
    async (err) => {
      await gateway.stop();
      throw err;
    },
  );
  // `sandboxd key` / `agent-token` while this runs: through this socket, on this process's db.
  const operator = await serveOperatorCommands(dataDir, gateway, secrets, log);
  const { gatewayUrl, agentServer, heartbeats, credentials } = await serveLocalAgent({
    gateway,
    manager,
    agentSecret: secrets.agentSecret,
    stateDir,
    diskReserveBytes: agent.host.diskReserveBytes,
    version,
    log,
    otlpEndpoint: otlpEndpoint(settings),
  });
  events.onPush = (e) => roomChanged(e) && heartbeats.soon();
  events.start({ gatewayUrl, credentials });
  await settled(heartbeats.first); // the sender logs a failed beat; the next beat retries
  log(
    `gateway ${gateway.url} (${gateway.runtime}), agent ${agentServer.url}, data ${dataDir}, ${manager.driverName}`,
  );
  if (manager.accel === "tcg") log(`WARNING: ${TCG_BOUNDARY}`);
  // Machine-readable line for scripts and tests: the URL clients use.
  process.stdout.write(`listening ${gateway.url}\n`);

  const catalog = values["no-catalog"]
    ? undefined
    : startCatalogBuild(
        dataDir,
        manager,
        log,
        agent,
        () => registerCatalog(gateway, catalogTemplates),
        catalogTemplates,
      );

  await untilStopSignal();
  log("stopping: running sandboxes keep running and are re-adopted by the next `up`");
  await catalog?.stop();
  await operator?.stop();
  // /readyz goes 503, the requests in flight (an exec, a stream) end, then the gateway stops; the
  // agent's half serves them until then.
  const left = await gateway.drainAndStop(drainOptions(settings));
  log(`stopped: ${left === 0 ? "no request was in flight" : `${left} requests cut at the drain timeout`}`);
  heartbeats.stop();
  await events.stop();
  await agentServer.stop();
  await manager.detach();
  removeFaultHandlers();
  removeHeapStats();
  return 0;
}

/** The gateway of `up`: its one agent is `local` in region `local`, and health shows both halves' settings. */
function startUpGateway(
  settings: Settings,
  o: { port: number; host: string | undefined; dataDir: string; version: string; log: (m: string) => void },
  secrets: ReturnType<typeof loadSecrets>,
): Promise<RunningGateway> {
  const start = gatewayStart(settings);
  return startGateway({
    port: o.port,
    hostname: o.host ?? "127.0.0.1",
    dataDir: o.dataDir,
    ...(start.databaseUrl !== undefined ? { databaseUrl: start.databaseUrl } : {}),
    // `up`'s one scrape: the gateway's metrics (its agent is on loopback, unreachable from outside).
    ...(metricsToken(settings) !== undefined ? { metricsToken: metricsToken(settings) } : {}),
    ...(otlpEndpoint(settings) !== undefined ? { otlpEndpoint: otlpEndpoint(settings) } : {}),
    agentSecret: secrets.agentSecret,
    // The secrets the operator set (SANDBOXD_KEY_PEPPER, SANDBOXD_CONNECT_SECRET) win over the
    // data dir's, as for `up`'s operator commands: else a key made through them would not verify.
    ...(start.secrets !== undefined ? { secrets: start.secrets } : {}),
    config: {
      version: o.version,
      region: "local",
      ...(start.publicBaseUrl !== undefined ? { publicBaseUrl: start.publicBaseUrl } : {}),
      ...(start.e2bDomain !== undefined ? { e2bDomain: start.e2bDomain } : {}),
      limits: gatewayLimits(settings),
      settings: reportedSettings(settings, ["gateway", "agent"]),
    },
    log: o.log,
  });
}

/**
 * `up`'s agent on loopback (in the embedded deployment only our gateway calls it), enrolled with
 * the gateway like any other, and its heartbeats.
 */
async function serveLocalAgent(o: {
  gateway: RunningGateway;
  manager: Awaited<ReturnType<typeof openAgentManager>>;
  agentSecret: string;
  stateDir: string;
  diskReserveBytes: number;
  version: string;
  log: (m: string) => void;
  otlpEndpoint: string | undefined;
}) {
  const gatewayUrl = o.gateway.url.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//127.0.0.1:");
  const credentials = await ownAgentCredentials(o.gateway, o.agentSecret, gatewayUrl, o.stateDir);
  const agentServer = startAgentServer({
    manager: o.manager,
    credentials,
    uploadDir: join(o.stateDir, "uploads"),
    diskReserveBytes: o.diskReserveBytes,
    hostname: "127.0.0.1",
    port: 0,
    version: o.version,
    log: o.log,
    ...(o.otlpEndpoint !== undefined ? { otlpEndpoint: o.otlpEndpoint } : {}),
  });
  const heartbeats = startHeartbeats({
    gatewayUrl,
    credentials,
    region: "local",
    advertiseUrl: agentServer.url,
    capacity: () => o.manager.capacityNow(),
    templates: () => o.manager.readyTemplates(),
    disk: { dir: o.stateDir, reserveBytes: o.diskReserveBytes },
    log: o.log,
  });
  return { gatewayUrl, credentials, agentServer, heartbeats };
}

/** Resolves at the first SIGINT or SIGTERM. */
function untilStopSignal(): Promise<void> {
  return new Promise<void>((resolve) => {
    process.once("SIGINT", resolve);
    process.once("SIGTERM", resolve);
  });
}

/** The id of `up`'s own agent. */
const LOCAL_AGENT_ID = "local";
/** `up` redeems the token it makes at once: a minute is plenty. */
const LOCAL_ENROLL_TTL_S = 60;

/**
 * The stored key of `up`'s agent while the gateway still holds it; otherwise (first start,
 * revoked, or a new gateway secret) a fresh enrollment with a token bound to that id.
 */
async function ownAgentCredentials(
  gateway: RunningGateway,
  agentSecret: string,
  gatewayUrl: string,
  stateDir: string,
): Promise<AgentCredentials> {
  const stored = await readCredentials(stateDir);
  const current = await gateway.withDb((db) => enrolledAgent(db, agentSecret, LOCAL_AGENT_ID));
  if (stored && stored.id === LOCAL_AGENT_ID && current?.key === stored.key) return stored;
  const { token } = await gateway.withDb((db) =>
    createEnrollmentToken(db, agentSecret, { agentId: LOCAL_AGENT_ID, ttlS: LOCAL_ENROLL_TTL_S }),
  );
  return enroll({ gatewayUrl, token, id: LOCAL_AGENT_ID, stateDir });
}
