/**
 * The gateway is runtime-neutral: `startGateway` (gateway/server.ts) serves `createApp` under
 * Bun (Bun.serve), Node (node:http through @hono/node-server) and Deno (its own node:http, the
 * same adapter: gateway/runtime/deno.ts says why not Deno.serve). Each
 * runtime runs the same small entry in its own process, on 127.0.0.1 with a free port and a
 * fresh PGlite data dir, with the in-memory stand-in agent (health needs no real VM). The test
 * reads the bound URL from the process, checks `GET /v1/health` (200, status, version,
 * templates), a 401 on `/v1/sandboxes` without a key and the runtime's WebSocket upgrade (a
 * connect relay to an echo server, `connectSmoke`), then stops it with SIGTERM.
 *
 * Node and Deno run a bundle (`bun build --target=node`, npm packages left external and
 * resolved from the repo's node_modules). Deno comes from the `deno` devDependency. Node is
 * skipped, with a message, only when no `node` binary is on PATH.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import type { ChildProcess } from "node:child_process";
import { mkdirSync, rmSync } from "node:fs";
import { join, resolve } from "node:path";
import WebSocket from "ws";
import {
  denoArgs,
  denoBinary,
  entryStopOnSignal,
  HAVE_NODE,
  prepareEntry,
  START_TIMEOUT_MS,
  startRuntime as startProcess,
  stopRuntime as stopProcess,
} from "../support/runtimes.ts";

const REPO = resolve(import.meta.dir, "../..");

let root = "";
const children = new Set<ChildProcess>();
const timings: Record<string, { readyMs: number; startGatewayMs: number }> = {};

// The entry each runtime runs: start the gateway, print one JSON line, stop on SIGTERM.
// It also sets up a connect relay's far end: a template exposing port 7000, whose tunnels the
// stand-in agent connects to an echo server in the same process, and a Pro key (printed).
const ENTRY = `
import { createServer } from "node:net";
import { startGateway } from ${JSON.stringify(join(REPO, "gateway/server.ts"))};
import { upsertPublicTemplate } from ${JSON.stringify(join(REPO, "gateway/core/templates.ts"))};
import { createKey } from ${JSON.stringify(join(REPO, "gateway/auth/keys.ts"))};
import { MemoryAgent } from ${JSON.stringify(join(REPO, "tests/support/memory-agent.ts"))};
const t0 = performance.now();
const agent = new MemoryAgent();
const gw = await startGateway({
  port: 0,
  hostname: "127.0.0.1",
  dataDir: process.env.GW_DATA_DIR,
  agent,
  config: { version: "runtime-smoke-1" },
  log: () => {},
});
const startGatewayMs = performance.now() - t0;
const echo = createServer((s) => s.pipe(s));
await new Promise((r) => echo.listen(0, "127.0.0.1", r));
agent.tunnelTargets.set(7000, echo.address().port);
agent.addReadyTemplate("web", [7000]);
const key = await gw.withDb(async (db) => {
  await upsertPublicTemplate({ db, clock: Date.now }, { id: "web", name: "web", description: "echo" });
  return (await createKey(db, gw.config.keyPepper, { tenant: "smoke", tier: "pro" })).key;
});
console.log(JSON.stringify({ url: gw.url, runtime: gw.runtime, startGatewayMs, key }));
${entryStopOnSignal("echo.close();")}`;

interface Started {
  child: ChildProcess;
  url: string;
  key: string;
  runtime: string;
  readyMs: number;
  startGatewayMs: number;
  stderr: () => string;
}

/** Spawns a runtime on the entry and waits for its JSON line (the bound URL). */
async function startRuntime(cmd: string, args: string[], env: Record<string, string>): Promise<Started> {
  const s = await startProcess<{ url: string; runtime: string; startGatewayMs: number; key: string }>(
    cmd,
    args,
    { cwd: root, env, children },
  );
  return { child: s.child, ...s.line, readyMs: s.readyMs, stderr: s.stderr };
}

function stopRuntime(s: Started): Promise<number | null> {
  return stopProcess(s.child);
}

async function smoke(name: string, cmd: string, args: string[], env: Record<string, string> = {}) {
  const dataDir = join(root, `data-${name}`);
  mkdirSync(dataDir);
  const s = await startRuntime(cmd, args, { GW_DATA_DIR: dataDir, ...env });
  try {
    expect(s.runtime).toBe(name);
    expect(s.url).toMatch(/^http:\/\/127\.0\.0\.1:\d+$/);
    timings[name] = { readyMs: Math.round(s.readyMs), startGatewayMs: Math.round(s.startGatewayMs) };

    const health = await fetch(`${s.url}/v1/health`);
    expect(health.status).toBe(200);
    const body = (await health.json()) as Record<string, unknown>;
    expect(body.status).toBe("ok");
    expect(body.version).toBe("runtime-smoke-1");
    expect(typeof body.templates).toBe("object");
    expect(body.templates).not.toBeNull();

    const noKey = await fetch(`${s.url}/v1/sandboxes`);
    expect(noKey.status).toBe(401);
    expect(((await noKey.json()) as { code: string }).code).toBe("unauthorized");

    // A key that does not exist goes through the db lookup (PGlite works in this runtime).
    const badKey = await fetch(`${s.url}/v1/sandboxes`, {
      headers: { authorization: `Bearer svc_pro_000000000000_${"x".repeat(40)}` },
    });
    expect(badKey.status).toBe(401);

    await connectSmoke(s);
  } finally {
    const code = await stopRuntime(s);
    expect({ code, stderr: s.stderr() }).toEqual({ code: 0, stderr: "" });
  }
}

/**
 * The runtime's WebSocket upgrade (gateway/runtime/): a connect URL minted for a sandbox, a
 * WebSocket through it to the echo server, one message there and back, a 401 without a token.
 */
async function connectSmoke(s: Started) {
  const auth = { authorization: `Bearer ${s.key}`, "content-type": "application/json" };
  const created = await fetch(`${s.url}/v1/sandboxes`, {
    method: "POST",
    headers: auth,
    body: JSON.stringify({ template: "web" }),
  });
  expect(created.status).toBe(201);
  const { id } = (await created.json()) as { id: string };
  const minted = await fetch(`${s.url}/v1/sandboxes/${id}/connect-url`, {
    method: "POST",
    headers: auth,
    body: JSON.stringify({ port: 7000, ttl_seconds: 60 }),
  });
  expect(minted.status).toBe(200);
  const issued = new URL(((await minted.json()) as { url: string }).url);
  const url = `${s.url.replace(/^http/, "ws")}${issued.pathname}${issued.search}`;
  const ws = new WebSocket(url, { perMessageDeflate: false });
  const echoed = await new Promise<string>((resolve, reject) => {
    ws.once("open", () => ws.send(Buffer.from("ping through the relay")));
    ws.once("message", (b: Buffer) => resolve(b.toString()));
    ws.once("error", reject);
  });
  expect(echoed).toBe("ping through the relay");
  const closed = new Promise<number>((resolve) => ws.once("close", (code) => resolve(code)));
  ws.close(1000);
  expect(await closed).toBe(1000);
  // Refused before the upgrade: the handshake gets the API's 401.
  const refused = await new Promise<number>((resolve, reject) => {
    const bad = new WebSocket(url.replace(/&t=[^&]*/, "&t=x"));
    bad.once("unexpected-response", (_req, res) => {
      res.resume();
      resolve(res.statusCode ?? 0);
    });
    bad.once("open", () => reject(new Error("upgraded without a valid token")));
    bad.once("error", reject);
  });
  expect(refused).toBe(401);
}

let bundled = "";

beforeAll(async () => {
  ({ root, bundled } = await prepareEntry("sandboxd-runtimes-", ENTRY));
});

afterAll(() => {
  for (const c of children) c.kill("SIGKILL");
  console.log(
    `gateway start per runtime (process spawn to listening / startGateway only), ms: ${JSON.stringify(timings)}`,
  );
  rmSync(root, { recursive: true, force: true });
});

describe("gateway under each runtime", () => {
  test(
    "bun (Bun.serve)",
    async () => {
      await smoke("bun", process.execPath, [join(root, "entry.ts")]);
    },
    START_TIMEOUT_MS + 15_000,
  );

  test.skipIf(!HAVE_NODE)(
    "node (@hono/node-server)",
    async () => {
      await smoke("node", "node", [bundled]);
    },
    START_TIMEOUT_MS + 15_000,
  );
  if (!HAVE_NODE) console.warn("gateway-runtimes: no `node` on PATH, skipping the Node smoke test");

  test(
    "deno (node:http)",
    async () => {
      const denoDir = join(root, "deno-cache");
      mkdirSync(denoDir);
      // DENO_DIR keeps Deno's cache inside the test's temp dir.
      await smoke("deno", denoBinary(), denoArgs(bundled), {
        DENO_DIR: denoDir,
        NO_COLOR: "1",
      });
    },
    START_TIMEOUT_MS + 15_000,
  );
});
