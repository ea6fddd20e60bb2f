/**
 * Running a small gateway entry under Bun, Node and Deno, each in its own process (the gateway is
 * runtime-neutral: gateway/runtime/). Node and Deno run a bundle (`bun build --target=node`, npm
 * packages left external and resolved from the repo's node_modules, which the caller links into
 * the bundle's directory). Deno comes from the `deno` devDependency. The entry prints one JSON
 * line once it listens; `startRuntime` waits for it.
 */
import { type ChildProcess, spawn, spawnSync } from "node:child_process";
import { mkdtempSync, readFileSync, symlinkSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";

export const HAVE_NODE = spawnSync("node", ["--version"]).status === 0;
/** Cold start of a runtime plus PGlite's first migration; generous for a loaded CI machine. */
export const START_TIMEOUT_MS = 60_000;

/**
 * The native Deno binary of the `deno` devDependency, found by that package's own resolver (its
 * postinstall does the same; `trustedDependencies` lets it run). Not `node_modules/.bin/deno`
 * when that is still the package's Node wrapper: a signal to the wrapper would orphan Deno.
 */
export function denoBinary(): string {
  const api = createRequire(import.meta.url)("deno/install_api.cjs") as { runInstall(): string };
  return api.runInstall();
}

/** The arguments that run `bundled` under Deno (its cache: `DENO_DIR` in the env). */
export function denoArgs(bundled: string): string[] {
  // --node-modules-dir=manual: resolve npm imports from node_modules as Node does.
  return ["run", "-A", "--node-modules-dir=manual", "--no-lock", bundled];
}

/**
 * Bundles an entry for Node and Deno. db/client.ts locates its migrations relative to its own
 * file (`import.meta.dirname`); in a bundle that would be the bundle's directory, so the plugin
 * replaces it with each source file's directory at build time.
 */
export async function bundle(entry: string, outdir: string): Promise<string> {
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
  return join(outdir, entry.replace(/^.*\//, "").replace(/\.ts$/, ".js"));
}

export interface Started<T> {
  child: ChildProcess;
  /** The entry's JSON line. */
  line: T;
  readyMs: number;
  stderr: () => string;
}

/** Spawns a runtime on an entry (cwd `cwd`) and waits for its JSON line. */
export function startRuntime<T>(
  cmd: string,
  args: string[],
  opts: { cwd: string; env: Record<string, string>; children: Set<ChildProcess> },
): Promise<Started<T>> {
  const t0 = performance.now();
  const child = spawn(cmd, args, { cwd: opts.cwd, env: { ...process.env, ...opts.env }, stdio: "pipe" });
  opts.children.add(child);
  child.once("exit", () => opts.children.delete(child));
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
        const line = JSON.parse(out.slice(0, nl)) as T;
        resolveStart({ child, line, readyMs: performance.now() - t0, stderr: () => err });
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

/** SIGTERM, then the exit code. */
export function stopRuntime(child: ChildProcess): Promise<number | null> {
  return new Promise((resolveStop) => {
    if (child.exitCode !== null) return resolveStop(child.exitCode);
    child.once("exit", (code) => resolveStop(code));
    child.kill("SIGTERM");
  });
}

/**
 * The end of an entry: stops the gateway `gw` on SIGTERM/SIGINT after `cleanup` (statements),
 * exiting 0, or 1 with the error on stderr.
 */
export function entryStopOnSignal(cleanup: string): string {
  return `
let stopping = false;
const stop = () => {
  if (stopping) return;
  stopping = true;
  ${cleanup}
  gw.stop().then(() => process.exit(0), (err) => { console.error(err); process.exit(1); });
};
process.on("SIGTERM", stop);
process.on("SIGINT", stop);
`;
}

/**
 * A temp dir holding `entry.ts` (the source given) and its bundle for Node and Deno, which
 * resolve the bundle's npm imports (hono, drizzle, PGlite...) from the repo's node_modules,
 * linked there.
 */
export async function prepareEntry(
  prefix: string,
  source: string,
): Promise<{ root: string; bundled: string }> {
  const root = mkdtempSync(join(tmpdir(), prefix));
  writeFileSync(join(root, "entry.ts"), source);
  symlinkSync(resolve(import.meta.dir, "..", "..", "node_modules"), join(root, "node_modules"));
  return { root, bundled: await bundle(join(root, "entry.ts"), join(root, "out")) };
}
