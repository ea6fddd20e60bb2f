/**
 * `sandboxd gateway` and `sandboxd agent`: the two halves of `up` as separate processes, for a
 * deployment with several host agents. Agents register and heartbeat to the gateway over HTTP
 * (contracts/agent/heartbeat.ts); the gateway routes each sandbox to one of them
 * (gateway/agents/router.ts).
 * Each agent has its own key: it enrolls once with a one-time token from
 * `sandboxd agent-token create` (`--enroll TOKEN`) and keeps the key in its data dir.
 */
import { mkdir } from "node:fs/promises";
import { hostname } from "node:os";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { startDialer } from "../agent/api/dial.ts";
import { loadOrEnroll } from "../agent/api/enroll.ts";
import { EventReporter } from "../agent/api/events.ts";
import { roomChanged, startHeartbeats } from "../agent/api/heartbeat.ts";
import {
  CATALOG_IMAGES,
  type CatalogImageId,
  catalogLayoutDir,
  ensureCatalogImage,
} from "../agent/catalog/python.ts";
import { EgressFence } from "../agent/egress/fence.ts";
import { registryConfigFromEnv } from "../agent/image/pull.ts";
import { limitVmMemory } from "../agent/qemu/cgroup.ts";
import { protectAgentFromOom } from "../agent/qemu/oom.ts";
import { hostCapacity } from "../agent/sandbox/capacity.ts";
import { fencedRegistry, SnapshotDriver } from "../agent/sandbox/drivers/snapshot.ts";
import { SandboxManager } from "../agent/sandbox/manager.ts";
import { startAgentServer } from "../agent/server.ts";
import type { AgentCapacity } from "../contracts/agent/api.ts";
import { dialUrl } from "../contracts/agent/dial.ts";
import { TCG_BOUNDARY } from "../contracts/api/health.ts";
import { describeError, SandboxdError } from "../contracts/errors.ts";
import { loadSecrets } from "../gateway/auth/secrets.ts";
import { upsertPublicTemplate } from "../gateway/core/templates.ts";
import { type RunningGateway, startGateway } from "../gateway/server.ts";
import { lockDownDataDir } from "./data-dir.ts";
import { installFaultHandlers } from "./faults.ts";
import { serveOperatorCommands } from "./operator-ops.ts";
import {
  type AgentSettings,
  agentSettings,
  dataDirOf,
  drainOptions,
  firstStartEnrollToken,
  gatewayLimits,
  gatewayStart,
  metricsToken,
  otlpEndpoint,
  settingFlags,
  settingsOf,
  settingsOrRefuse,
} from "./settings.ts";

/**
 * The catalog (docs/templates.md "The public catalog"): `python`, and `base`, the template E2B's
 * SDK creates when given none. Each is an image of agent/catalog/python.ts's CATALOG_IMAGES.
 */
export const CATALOG: readonly { id: CatalogImageId; name: string; description: string }[] = [
  {
    id: "python",
    name: "Python 3",
    description: "Debian 12 with python3; code runs as `python3` reading the program on stdin",
  },
  {
    id: "base",
    name: "Base",
    description:
      "Debian 12 with bash, sudo and python3, as the user `user` in /home/user (E2B's default template)",
  },
];

/**
 * The catalog templates named by `--catalog ID,...` (all when unset), in catalog order; an unknown
 * id is a usage error.
 */
export function catalogOf(value: string | undefined): readonly (typeof CATALOG)[number][] {
  if (value === undefined) return CATALOG;
  const ids = value.split(",").map((s) => s.trim());
  for (const id of ids) {
    if (!CATALOG.some((t) => t.id === id)) {
      throw new SandboxdError(
        "bad_request",
        `--catalog: unknown template ${JSON.stringify(id)} (known: ${CATALOG.map((t) => t.id).join(", ")})`,
      );
    }
  }
  return CATALOG.filter((t) => ids.includes(t.id));
}

/** `--NAME` as a port number (0: any free port); anything else is a usage error. */
export function parsePort(value: string | undefined, def: number, name = "port"): number {
  const n = Number(value ?? def);
  if (!Number.isInteger(n) || n < 0 || n > 65535) {
    throw new SandboxdError("bad_request", `--${name} must be 0-65535, got ${value}`);
  }
  return n;
}

/**
 * The agent's manager as `up` and `agent` open it: the snapshot driver over `dataDir`'s caches,
 * egress default, idle pause and pre-launched QEMUs from the environment; its state changes go
 * to `events` (sent to the gateway once the reporter is started).
 */
/**
 * The operator's two fences: what sandboxes may reach (SANDBOXD_EGRESS_ALLOW_INTERNAL) and what
 * registry pulls may reach (SANDBOXD_REGISTRY_ALLOW_INTERNAL) are separate grants, so allowing a
 * private registry for bakes does not open it to every tenant's code, nor the reverse.
 */
export function agentFences(settings: Pick<AgentSettings, "egressAllowInternal" | "registryAllowInternal">): {
  sandboxes: EgressFence;
  registries: EgressFence;
} {
  return {
    sandboxes: EgressFence.fromSetting(settings.egressAllowInternal),
    registries: EgressFence.fromSetting(settings.registryAllowInternal),
  };
}

export async function openAgentManager(
  dataDir: string,
  stateDir: string,
  log: (msg: string) => void,
  events: EventReporter,
  slots: number | undefined,
  settings: AgentSettings,
): Promise<SandboxManager> {
  const { sandboxes: fence, registries: registryFence } = agentFences(settings);
  const driver = await SnapshotDriver.create({
    cacheDir: dataDir,
    stateDir,
    log,
    timeouts: settings.timeouts,
    forkMethod: settings.forkMethod,
    // A malformed registry list (or egress range) stops the agent here, not a bake later.
    registry: {
      ...registryConfigFromEnv(settings.registry),
      checkDestination: fencedRegistry(registryFence),
      fence: registryFence,
    },
    imageCacheBytes: settings.imageCacheBytes,
    accelSetting: settings.accel,
    host: settings.host,
  });
  // The agent outlives any VM in an OOM; the VMs together stay within the budget admission uses.
  const oom = await protectAgentFromOom();
  if (oom.refused !== undefined) log(`${oom.refused}; it stays ${oom.adj}`);
  const capacity = hostCapacity({
    ...(slots !== undefined ? { slots } : {}),
    ...(settings.vmMemoryBytes > 0 ? { memMib: Math.floor(settings.vmMemoryBytes / 2 ** 20) } : {}),
  });
  await limitVmMemory(capacity.memMib * 2 ** 20);
  return SandboxManager.open({
    driver,
    stateDir,
    log,
    egressDefault: settings.egressDefault,
    fence,
    prelaunch: settings.prelaunch,
    onEvent: (e) => events.push(e),
    capacity,
    idlePauseMs: settings.idlePauseMs,
    buildSlots: settings.buildSlots,
  });
}

function untilSignal(): Promise<void> {
  return new Promise<void>((resolve) => {
    process.once("SIGINT", resolve);
    process.once("SIGTERM", resolve);
  });
}

/** A capacity with no room left (a draining agent's). */
function noRoom(c: AgentCapacity): AgentCapacity {
  return { ...c, slotsFree: 0, vcpusFree: 0, memMibFree: 0 };
}

/** Lists the catalog templates (status `building`: the agents report when theirs is ready). */
export async function registerCatalog(
  gateway: RunningGateway,
  catalog: readonly (typeof CATALOG)[number][] = CATALOG,
): Promise<void> {
  for (const t of catalog) {
    await gateway.withDb((db) => upsertPublicTemplate({ db, clock: Date.now }, { ...t, status: "building" }));
  }
}

/**
 * Starts the catalog build in the background with its own stop: `stop()` aborts it (debootstrap
 * and the image tools are killed with their process groups) and resolves once it has ended, so
 * a stopped agent leaves no build running behind it.
 */
export function startCatalogBuild(
  dataDir: string,
  manager: SandboxManager,
  log: (m: string) => void,
  settings: CatalogSettings,
  before: () => Promise<void> = async () => {},
  catalog: readonly (typeof CATALOG)[number][] = CATALOG,
): { stop(): Promise<void> } {
  const abort = new AbortController();
  const done = before()
    .then(() => buildCatalogOnAgent(dataDir, manager, log, settings, abort.signal, catalog))
    .catch((err) => {
      if (!abort.signal.aborted) log(`catalog: build failed: ${describeError(err)}`);
    });
  return {
    async stop() {
      abort.abort();
      await done;
    },
  };
}

/** The settings the catalog build obeys: the Debian mirror, the disk reserve. */
export type CatalogSettings = Pick<AgentSettings, "debianMirror" | "host">;

/**
 * Builds the catalog's templates on this agent once (cached in its data dir), one after the
 * other; one that fails is logged and the next is built.
 */
export async function buildCatalogOnAgent(
  dataDir: string,
  manager: SandboxManager,
  log: (m: string) => void,
  settings: CatalogSettings,
  signal?: AbortSignal,
  catalog: readonly (typeof CATALOG)[number][] = CATALOG,
): Promise<void> {
  for (const t of catalog) {
    let status: string | undefined;
    try {
      status = manager.templates.status(t.id).status;
    } catch {
      status = undefined; // never built on this host
    }
    if (status === "ready" || status === "building") continue;
    try {
      await ensureCatalogImage(t.id, {
        dataDir,
        log,
        ...(signal ? { signal } : {}),
        ...(settings.debianMirror ? { mirror: settings.debianMirror } : {}),
        diskReserveBytes: settings.host.diskReserveBytes,
      });
      if (signal?.aborted) return;
      manager.buildTemplate(t.id, {
        kind: "archive",
        path: catalogLayoutDir(dataDir, t.id),
        readyCmd: [...CATALOG_IMAGES[t.id].readyCmd],
      });
    } catch (err) {
      if (signal?.aborted) return;
      // A copy from another agent of the fleet arrived while the image was made: it serves.
      if (err instanceof SandboxdError && err.code === "conflict") continue;
      log(`catalog: ${t.id} template failed: ${describeError(err)}`);
      continue;
    }
    log(`catalog: building template ${t.id}`);
  }
}

export async function cmdGateway(args: string[], version: string, log: (m: string) => void): Promise<number> {
  const { values } = parseArgs({
    args,
    options: {
      port: { type: "string" },
      host: { type: "string" },
      "data-dir": { type: "string" },
      "public-url": { type: "string" },
      region: { type: "string" },
      "no-catalog": { type: "boolean" },
      catalog: { type: "string" },
      ...settingFlags(),
    },
  });
  const settings = settingsOrRefuse(values);
  if (!settings) return 2;
  const start = gatewayStart(settings);
  const dataDir = values["data-dir"] ?? dataDirOf(settings);
  await lockDownDataDir(dataDir, log);
  const removeFaultHandlers = installFaultHandlers(log);
  const gateway = await startGateway({
    port: parsePort(values.port, 8080),
    hostname: values.host ?? "127.0.0.1",
    dataDir,
    ...(start.databaseUrl !== undefined ? { databaseUrl: start.databaseUrl } : {}),
    ...(start.databaseListenUrl !== undefined ? { databaseListenUrl: start.databaseListenUrl } : {}),
    migrate: start.migrate,
    ...(metricsToken(settings) !== undefined ? { metricsToken: metricsToken(settings) } : {}),
    ...(otlpEndpoint(settings) !== undefined ? { otlpEndpoint: otlpEndpoint(settings) } : {}),
    secrets: start.secrets,
    ...(start.peerUrl !== undefined ? { peerUrl: start.peerUrl } : {}),
    config: {
      version,
      region: values.region ?? "local",
      ...(start.publicBaseUrl !== undefined ? { publicBaseUrl: start.publicBaseUrl } : {}),
      ...(start.e2bDomain !== undefined ? { e2bDomain: start.e2bDomain } : {}),
      limits: gatewayLimits(settings),
      settings: settingsOf(settings, "gateway"),
    },
    log,
  });
  const secrets = loadSecrets(dataDir, start.secrets);
  // `sandboxd key` / `agent-token` while this runs: through this socket, on this process's db.
  const operator = await serveOperatorCommands(dataDir, gateway, secrets, log);
  if (!values["no-catalog"]) await registerCatalog(gateway, catalogOf(values.catalog));
  log(`gateway ${gateway.url} (${gateway.runtime}), region ${gateway.config.region}, data ${dataDir}`);
  process.stdout.write(`listening ${gateway.url}\n`);
  await untilSignal();
  await operator?.stop();
  const left = await gateway.drainAndStop(drainOptions(settings));
  log(`stopping: ${left === 0 ? "no request was in flight" : `${left} requests cut at the drain timeout`}`);
  removeFaultHandlers();
  return 0;
}

export async function cmdAgent(args: string[], version: string, log: (m: string) => void): Promise<number> {
  const { values } = parseArgs({
    args,
    options: {
      "data-dir": { type: "string" },
      listen: { type: "string" },
      region: { type: "string" },
      gateway: { type: "string" },
      advertise: { type: "string" },
      // BYOC: dial out to these gateways (comma-separated) instead of being reached at a URL.
      dial: { type: "string" },
      id: { type: "string" },
      slots: { type: "string" },
      enroll: { type: "string" },
      "no-catalog": { type: "boolean" },
      catalog: { type: "string" },
      ...settingFlags(),
    },
  });
  const settings = settingsOrRefuse(values);
  if (!settings) return 2;
  if (!values.gateway)
    throw new SandboxdError("bad_request", "agent needs --gateway URL (where it registers)");
  const dataDir = values["data-dir"] ?? dataDirOf(settings);
  await lockDownDataDir(dataDir, log);
  const removeFaultHandlers = installFaultHandlers(log);
  const m = /^(.*):(\d+)$/.exec(values.listen ?? "127.0.0.1:7070");
  if (!m) throw new SandboxdError("bad_request", `--listen must be HOST:PORT, got ${values.listen}`);
  const listenHost = m[1]!.replace(/^\[(.*)\]$/, "$1");
  const stateDir = join(dataDir, "agent");
  await mkdir(stateDir, { recursive: true });
  const listenPort = parsePort(m[2], 7070, "listen");
  const credentials = await loadOrEnroll({
    gatewayUrl: values.gateway,
    stateDir,
    ...(values.enroll !== undefined ? { token: values.enroll } : {}),
    ...(firstStartEnrollToken(settings) !== undefined
      ? { firstStartToken: firstStartEnrollToken(settings) }
      : {}),
    ...(values.id !== undefined ? { id: values.id } : {}),
    defaultId: `${hostname()}-${listenPort}`,
  });
  const id = credentials.id;
  const slots = values.slots === undefined ? undefined : parsePort(values.slots, 64, "slots");
  const events = new EventReporter({ log });
  const agent = agentSettings(settings);
  const manager = await openAgentManager(dataDir, stateDir, log, events, slots, agent);
  const server = startAgentServer({
    manager,
    credentials,
    uploadDir: join(stateDir, "uploads"),
    diskReserveBytes: agent.host.diskReserveBytes,
    hostname: listenHost,
    port: listenPort,
    version,
    log,
    ...(metricsToken(settings) !== undefined ? { metricsToken: metricsToken(settings) } : {}),
    ...(otlpEndpoint(settings) !== undefined ? { otlpEndpoint: otlpEndpoint(settings) } : {}),
  });
  const dialTo = values.dial
    ?.split(",")
    .map((u) => u.trim())
    .filter(Boolean);
  if (dialTo !== undefined && values.advertise !== undefined)
    throw new SandboxdError(
      "bad_request",
      "--dial and --advertise exclude each other: a dial-out agent has no URL",
    );
  // Streams from the gateways are bridged to the agent's own listener, on loopback.
  const dialer =
    dialTo === undefined
      ? undefined
      : startDialer({
          gatewayUrls: dialTo,
          credentials,
          target: { host: listenHost, port: Number(new URL(server.url).port) },
          log,
        });
  const heartbeats = startHeartbeats({
    gatewayUrl: values.gateway,
    credentials,
    region: values.region ?? "local",
    advertiseUrl: dialTo !== undefined ? dialUrl(id) : (values.advertise ?? server.url),
    // Draining (SIGTERM): no room offered, so the gateways place new VMs elsewhere.
    capacity: () => (server.draining ? noRoom(manager.capacityNow()) : manager.capacityNow()),
    templates: () => manager.readyTemplates(),
    disk: { dir: stateDir, reserveBytes: agent.host.diskReserveBytes },
    log,
  });
  events.onPush = (e) => roomChanged(e) && heartbeats.soon();
  events.start({ gatewayUrl: values.gateway, credentials });
  log(
    `agent ${id} ${server.url}, region ${values.region ?? "local"}, reporting to ${values.gateway}${dialTo ? `, dialing out to ${dialTo.join(" ")}` : ""}, ${manager.driverName}`,
  );
  log(`settings ${JSON.stringify(settingsOf(settings, "agent"))}`);
  if (manager.accel === "tcg") log(`WARNING: ${TCG_BOUNDARY}`);
  process.stdout.write(`listening ${server.url}\n`);
  const catalog = values["no-catalog"]
    ? undefined
    : startCatalogBuild(dataDir, manager, log, agent, undefined, catalogOf(values.catalog));
  await untilSignal();
  await catalog?.stop();
  // The gateway's calls in flight end first (their VMs keep running: the next start re-adopts
  // them); the heartbeats meanwhile say there is no room here.
  heartbeats.soon();
  const left = await server.drainAndStop(drainOptions(settings));
  log(`stopping: ${left === 0 ? "no call was in flight" : `${left} calls cut at the drain timeout`}`);
  heartbeats.stop();
  dialer?.stop();
  await events.stop();
  await manager.detach();
  removeFaultHandlers();
  return 0;
}
