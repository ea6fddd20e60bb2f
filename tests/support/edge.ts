/**
 * Running the edge (edge/) as it ships: bundled for an isolate (`bun build --target=browser`), under
 * the real workerd of the `workerd` devDependency with edge/workerd.capnp as it is, or under Deno.
 * Test code only.
 */
import { type ChildProcess, spawn } from "node:child_process";
import { copyFileSync, mkdtempSync } from "node:fs";
import { createRequire } from "node:module";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";

export const REPO = resolve(import.meta.dir, "../..");

/**
 * The native workerd binary of the `workerd` devDependency, found by that package's own resolver.
 * Not `node_modules/.bin/workerd`, a Node wrapper: a signal to the wrapper would orphan workerd.
 */
export function workerdBinary(): string {
  return (createRequire(import.meta.url)("workerd") as { default: string }).default;
}

/** Bundles an edge entry as an isolate loads it: one ES module, browser target, nothing external. */
export async function bundleEdge(entry: string, outfile: string): Promise<string> {
  const result = await Bun.build({
    entrypoints: [join(REPO, entry)],
    target: "browser",
    format: "esm",
  });
  if (!result.success) throw new Error(`bun build ${entry} failed: ${result.logs.join("\n")}`);
  await Bun.write(outfile, await result.outputs[0]!.text());
  return outfile;
}

/** Waits until something answers HTTP at `url` (any status); throws past `ms`. */
export async function answering(url: string, ms: number, child: ChildProcess, stderr: () => string) {
  const t0 = performance.now();
  for (;;) {
    if (child.exitCode !== null) throw new Error(`exited ${child.exitCode} before serving: ${stderr()}`);
    try {
      await (await fetch(url)).arrayBuffer();
      return;
    } catch {
      // not listening yet: try again below until the bound
    }
    if (performance.now() - t0 > ms)
      throw new Error(`nothing answered at ${url} within ${ms} ms: ${stderr()}`);
    await Bun.sleep(50);
  }
}

export interface RunningEdge {
  url: string;
  child: ChildProcess;
  stderr: () => string;
  stop(): Promise<void>;
}

/** Cold start of workerd or Deno on a loaded 2-core host: generous. */
const START_MS = 30_000;

function started(child: ChildProcess, url: string): Promise<RunningEdge> {
  let err = "";
  child.stderr!.on("data", (b: Buffer) => {
    err += b.toString();
  });
  child.stdout!.on("data", (b: Buffer) => {
    err += b.toString();
  });
  const stderr = () => err;
  const edge: RunningEdge = {
    url,
    child,
    stderr,
    stop: () =>
      new Promise((done) => {
        if (child.exitCode !== null || child.signalCode !== null) return done();
        child.once("exit", () => done());
        child.kill("SIGTERM");
      }),
  };
  return answering(`${url}/livez`, START_MS, child, stderr).then(
    () => edge,
    async (e: unknown) => {
      await edge.stop();
      throw e;
    },
  );
}

/** workerd serving edge/workerd.capnp on 127.0.0.1:`port`, its bindings from `env`. */
export async function startWorkerdEdge(port: number, env: Record<string, string>): Promise<RunningEdge> {
  const dir = mkdtempSync(join(tmpdir(), "sbx-edge-workerd-"));
  await bundleEdge("edge/worker.ts", join(dir, "worker.js"));
  copyFileSync(join(REPO, "edge/workerd.capnp"), join(dir, "workerd.capnp"));
  const child = spawn(
    workerdBinary(),
    ["serve", join(dir, "workerd.capnp"), "--socket-addr", `http=127.0.0.1:${port}`],
    { cwd: dir, env: { ...process.env, ...env }, stdio: ["ignore", "pipe", "pipe"] },
  );
  return started(child, `http://127.0.0.1:${port}`);
}

/** `deno run edge/deno.ts` (the source, as Deno Deploy runs it) on 127.0.0.1:`port`. */
export async function startDenoEdge(
  deno: string,
  port: number,
  env: Record<string, string>,
): Promise<RunningEdge> {
  const child = spawn(
    deno,
    ["run", "--allow-net", "--allow-env", "--node-modules-dir=manual", "--no-lock", "edge/deno.ts"],
    {
      cwd: REPO,
      env: { ...process.env, ...env, SANDBOXD_EDGE_HOST: "127.0.0.1", SANDBOXD_EDGE_PORT: String(port) },
      stdio: ["ignore", "pipe", "pipe"],
    },
  );
  return started(child, `http://127.0.0.1:${port}`);
}
