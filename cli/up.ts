/**
 * `sandboxd up`: the embedded deployment, the gateway and one host agent in one process. The
 * gateway reaches the agent over its real HTTP API on loopback (the same path a multi-host
 * deployment uses), so there is one code path, not an in-process shortcut.
 */
import { mkdir } from "node:fs/promises";
import { join } from "node:path";
import { parseArgs } from "node:util";
import { AgentHttpClient } from "../agent/api/client.ts";
import { ensurePythonImage, pythonLayoutDir } from "../agent/catalog/python.ts";
import { SandboxManager } from "../agent/sandbox/manager.ts";
import { SnapshotDriver } from "../agent/sandbox/snapshot-driver.ts";
import { startAgentServer } from "../agent/server.ts";
import { describeError, SandboxdError } from "../contracts/errors.ts";
import { upsertPublicTemplate } from "../gateway/core/templates.ts";
import { loadSecrets } from "../gateway/secrets.ts";
import { startGateway } from "../gateway/server.ts";
import { defaultDataDir } from "./config.ts";

/** The catalog (spec 2.4): only `python` ships publicly. */
const CATALOG = [
  {
    id: "python",
    name: "Python 3",
    description: "Debian 12 with python3; code runs as `python3` reading the program on stdin",
  },
] as const;

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
  const port = Number(values.port ?? 8080);
  if (!Number.isInteger(port) || port < 0 || port > 65535) {
    throw new SandboxdError("bad_request", `--port must be 0-65535, got ${values.port}`);
  }
  const dataDir = values["data-dir"] ?? defaultDataDir();
  const stateDir = join(dataDir, "agent");
  await mkdir(stateDir, { recursive: true });
  const secrets = loadSecrets(dataDir);

  const driver = await SnapshotDriver.create({ cacheDir: dataDir, stateDir, log });
  const manager = await SandboxManager.open({ driver, stateDir, log });
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
  const agent = new AgentHttpClient({ baseUrl: agentServer.url, secret: secrets.agentSecret });
  const gateway = await startGateway({
    port,
    hostname: values.host ?? "127.0.0.1",
    dataDir,
    databaseUrl: process.env.DATABASE_URL,
    agent,
    config: {
      version,
      ...(values["public-url"] ? { publicBaseUrl: values["public-url"] } : {}),
      agent: { id: "local", region: "local", url: agentServer.url },
    },
    log,
  });
  log(`gateway ${gateway.url} (${gateway.runtime}), agent ${agentServer.url}, data ${dataDir}`);
  // Machine-readable line for scripts and tests: the URL clients use.
  process.stdout.write(`listening ${gateway.url}\n`);

  if (!values["no-catalog"]) {
    void buildCatalog(dataDir, manager, gateway, log).catch((err) =>
      log(`catalog: python template failed: ${describeError(err)}`),
    );
  }

  await new Promise<void>((resolve) => {
    process.once("SIGINT", resolve);
    process.once("SIGTERM", resolve);
  });
  log("stopping: running sandboxes keep running and are re-adopted by the next `up`");
  await gateway.stop();
  await agentServer.stop();
  await manager.detach();
  return 0;
}

/** Builds the catalog's python template once (cached in the data dir) and lists it. */
async function buildCatalog(
  dataDir: string,
  manager: SandboxManager,
  gateway: Awaited<ReturnType<typeof startGateway>>,
  log: (m: string) => void,
): Promise<void> {
  for (const t of CATALOG) {
    await gateway.withDb((db) => upsertPublicTemplate({ db, clock: Date.now }, { ...t, status: "building" }));
    let status: string | undefined;
    try {
      status = manager.templates.status(t.id).status;
    } catch {
      status = undefined; // never built on this host
    }
    if (status === "ready" || status === "building") continue;
    await ensurePythonImage({ dataDir, log });
    manager.buildTemplate(t.id, {
      kind: "archive",
      path: pythonLayoutDir(dataDir),
      // Warm-up before the snapshot: python3 and its common modules are read from disk (and,
      // under TCG, translated) once at build time instead of in every sandbox's first exec.
      readyCmd: ["python3", "-c", "import json, os, re, subprocess, sys"],
    });
    log(`catalog: building template ${t.id}`);
  }
}
