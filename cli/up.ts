/**
 * `sandboxd up`: the embedded deployment, the gateway and one host agent in one process. The
 * gateway reaches the agent over its real HTTP API on loopback (the same path a multi-host
 * deployment uses), so there is one code path, not an in-process shortcut.
 */
import { mkdir } from "node:fs/promises";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { startHeartbeats } from "../agent/api/heartbeat.ts";
import { SnapshotDriver } from "../agent/sandbox/drivers/snapshot.ts";
import { SandboxManager } from "../agent/sandbox/manager.ts";
import { startAgentServer } from "../agent/server.ts";
import { TCG_BOUNDARY } from "../contracts/api/health.ts";
import { describeError } from "../contracts/errors.ts";
import { loadSecrets } from "../gateway/auth/secrets.ts";
import { startGateway } from "../gateway/server.ts";
import { defaultDataDir } from "./config.ts";
import { buildCatalogOnAgent, egressDefaultFromEnv, parsePort, registerCatalog } from "./serve.ts";

export async function cmdUp(args: string[], version: string, log: (m: string) => void): Promise<number> {
  const { values } = parseArgs({
    args,
    options: {
      port: { type: "string" },
      host: { type: "string" },
      "data-dir": { type: "string" },
      "public-url": { type: "string" },
      "no-catalog": { type: "boolean" },
    },
  });
  const port = parsePort(values.port, 8080);
  const dataDir = values["data-dir"] ?? defaultDataDir();
  const stateDir = join(dataDir, "agent");
  await mkdir(stateDir, { recursive: true });
  const secrets = loadSecrets(dataDir);

  const driver = await SnapshotDriver.create({ cacheDir: dataDir, stateDir, log });
  const manager = await SandboxManager.open({ driver, stateDir, log, egressDefault: egressDefaultFromEnv() });
  const agentServer = startAgentServer({
    manager,
    secret: secrets.agentSecret,
    uploadDir: join(stateDir, "uploads"),
    // The agent listens on loopback only: in the embedded deployment only our gateway calls it.
    hostname: "127.0.0.1",
    port: 0,
    version,
    log,
  });
  // The gateway routes to registered agents (gateway/agents/router.ts); its one agent registers
  // by heartbeat like any other, as agent `local` in region `local`.
  const gateway = await startGateway({
    port,
    hostname: values.host ?? "127.0.0.1",
    dataDir,
    databaseUrl: process.env.DATABASE_URL,
    agentSecret: secrets.agentSecret,
    config: {
      version,
      region: "local",
      ...(values["public-url"] ? { publicBaseUrl: values["public-url"] } : {}),
    },
    log,
  });
  const heartbeats = startHeartbeats({
    gatewayUrl: gateway.url.replace("//0.0.0.0:", "//127.0.0.1:").replace("//[::]:", "//127.0.0.1:"),
    secret: secrets.agentSecret,
    id: "local",
    region: "local",
    advertiseUrl: agentServer.url,
    capacity: () => manager.capacityNow(),
    log,
  });
  await heartbeats.first.catch(() => {}); // logged; the next beat retries
  log(
    `gateway ${gateway.url} (${gateway.runtime}), agent ${agentServer.url}, data ${dataDir}, ${manager.driverName}`,
  );
  if (manager.accel === "tcg") log(`WARNING: ${TCG_BOUNDARY}`);
  // Machine-readable line for scripts and tests: the URL clients use.
  process.stdout.write(`listening ${gateway.url}\n`);

  if (!values["no-catalog"]) {
    void registerCatalog(gateway)
      .then(() => buildCatalogOnAgent(dataDir, manager, log))
      .catch((err) => log(`catalog: python template failed: ${describeError(err)}`));
  }

  await new Promise<void>((resolve) => {
    process.once("SIGINT", resolve);
    process.once("SIGTERM", resolve);
  });
  log("stopping: running sandboxes keep running and are re-adopted by the next `up`");
  heartbeats.stop();
  await gateway.stop();
  await agentServer.stop();
  await manager.detach();
  return 0;
}
