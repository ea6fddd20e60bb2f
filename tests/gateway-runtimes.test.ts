/**
 * The gateway is runtime-neutral: `startGateway` (gateway/server.ts) serves `createApp` under
 * Bun (Bun.serve), Node (node:http through @hono/node-server) and Deno (Deno.serve). Each
 * runtime runs the same small entry in its own process, on 127.0.0.1 with a free port and a
 * fresh PGlite data dir, with the in-memory stand-in agent (health needs no real VM). The test
 * reads the bound URL from the process, checks `GET /v1/health` (200, status, version,
 * templates) and a 401 on `/v1/sandboxes` without a key, then stops it with SIGTERM.
 *
 * Node and Deno run a bundle (`bun build --target=node`, npm packages left external and
 * resolved from the repo's node_modules). Deno comes from the `deno` devDependency. Node is
 * skipped, with a message, only when no `node` binary is on PATH.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { type ChildProcess, spawn, spawnSync } from "node:child_process";
import { mkdirSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";

const REPO = resolve(import.meta.dir, "..");
const HAVE_NODE = spawnSync("node", ["--version"]).status === 0;
/** Cold start of a runtime plus PGlite's first migration; generous for a loaded CI machine. */
const START_TIMEOUT_MS = 60_000;

/**
 * The native Deno binary of the `deno` devDependency, found by that package's own resolver (its
 * postinstall does the same; `trustedDependencies` lets it run). Not `node_modules/.bin/deno`
 * when that is still the package's Node wrapper: a signal to the wrapper would orphan Deno.
 */
function denoBinary(): string {
  const api = createRequire(import.meta.url)("deno/install_api.cjs") as { runInstall(): string };
  return api.runInstall();
}

let root = "";
const children = new Set<ChildProcess>();
const timings: Record<string, { readyMs: number; startGatewayMs: number }> = {};

// The entry each runtime runs: start the gateway, print one JSON line, stop on SIGTERM.
const ENTRY = `
import { startGateway } from ${JSON.stringify(join(REPO, "gateway/server.ts"))};
import { MemoryAgent } from ${JSON.stringify(join(REPO, "gateway/testing/memory-agent.ts"))};
const t0 = performance.now();
const gw = await startGateway({
  port: 0,
  hostname: "127.0.0.1",
  dataDir: process.env.GW_DATA_DIR,
  agent: new MemoryAgent(),
  config: { version: "runtime-smoke-1" },
  log: () => {},
});
console.log(JSON.stringify({ url: gw.url, runtime: gw.runtime, startGatewayMs: performance.now() - t0 }));
let stopping = false;
const stop = () => {
  if (stopping) return;
  stopping = true;
  gw.stop().then(() => process.exit(0), (err) => { console.error(err); process.exit(1); });
};
process.on("SIGTERM", stop);
process.on("SIGINT", stop);
`;

/**
 * Bundles the entry for Node and Deno. db/client.ts locates its migrations relative to its own
 * file (`import.meta.dirname`); in a bundle that would be the bundle's directory, so the plugin
 * replaces it with each source file's directory at build time.
 */
async function bundle(entry: string, outdir: string): Promise<string> {
  const result = await Bun.build({
    entrypoints: [entry],
    outdir,
    target: "node",
    packages: "external",
    plugins: [
      {
        name: "import-meta-dirname",
        setup(build) {
          build.onLoad({ filter: /\.ts$/ }, (args) => ({
            contents: readFileSync(args.path, "utf8").replace(
              /import\.meta\.dirname\b/g,
              JSON.stringify(dirname(args.path)),
            ),
            loader: "ts",
          }));
        },
      },
    ],
  });
  if (!result.success) throw new Error(`bun build failed: ${result.logs.join("\n")}`);
  return join(outdir, "entry.js");
}

interface Started {
  child: ChildProcess;
  url: string;
  runtime: string;
  readyMs: number;
  startGatewayMs: number;
  stderr: () => string;
}

/** Spawns a runtime on the entry and waits for its JSON line (the bound URL). */
function startRuntime(cmd: string, args: string[], env: Record<string, string>): Promise<Started> {
  const t0 = performance.now();
  const child = spawn(cmd, args, { cwd: root, env: { ...process.env, ...env }, stdio: "pipe" });
  children.add(child);
  child.once("exit", () => children.delete(child));
  let out = "";
  let err = "";
  child.stderr!.on("data", (b: Buffer) => {
    err += b.toString();
  });
  return new Promise((resolveStart, reject) => {
    const timer = setTimeout(() => {
      child.kill("SIGKILL");
      reject(new Error(`${cmd} did not start in ${START_TIMEOUT_MS} ms; stderr:\n${err}`));
    }, START_TIMEOUT_MS);
    child.stdout!.on("data", (b: Buffer) => {
      out += b.toString();
      const nl = out.indexOf("\n");
      if (nl < 0) return;
      clearTimeout(timer);
      try {
        const line = JSON.parse(out.slice(0, nl)) as { url: string; runtime: string; startGatewayMs: number };
        resolveStart({ child, ...line, readyMs: performance.now() - t0, stderr: () => err });
      } catch {
        reject(new Error(`unexpected output from ${cmd}: ${out}\nstderr:\n${err}`));
      }
    });
    child.once("exit", (code, signal) => {
      clearTimeout(timer);
      reject(new Error(`${cmd} exited (${code ?? signal}) before listening; stderr:\n${err}`));
    });
  });
}

function stopRuntime(s: Started): Promise<number | null> {
  return new Promise((resolveStop) => {
    if (s.child.exitCode !== null) return resolveStop(s.child.exitCode);
    s.child.once("exit", (code) => resolveStop(code));
    s.child.kill("SIGTERM");
  });
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
  } finally {
    const code = await stopRuntime(s);
    expect({ code, stderr: s.stderr() }).toEqual({ code: 0, stderr: "" });
  }
}

let bundled = "";

beforeAll(async () => {
  root = mkdtempSync(join(tmpdir(), "sandboxd-runtimes-"));
  writeFileSync(join(root, "entry.ts"), ENTRY);
  // Node and Deno resolve the bundle's npm imports (hono, drizzle, PGlite...) from here.
  symlinkSync(join(REPO, "node_modules"), join(root, "node_modules"));
  bundled = await bundle(join(root, "entry.ts"), join(root, "out"));
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
    "deno (Deno.serve)",
    async () => {
      const denoDir = join(root, "deno-cache");
      mkdirSync(denoDir);
      // --node-modules-dir=manual: resolve npm imports from node_modules as Node does; DENO_DIR
      // keeps Deno's cache inside the test's temp dir.
      await smoke("deno", denoBinary(), ["run", "-A", "--node-modules-dir=manual", "--no-lock", bundled], {
        DENO_DIR: denoDir,
        NO_COLOR: "1",
      });
    },
    START_TIMEOUT_MS + 15_000,
  );
});
