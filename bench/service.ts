/**
 * A real `sandboxd up` as a child process, driven from outside the way a client would: a fresh
 * data dir seeded with guest artifacts, keys made by the real CLI, HTTP calls with a key, a sessions-API
 * template uploaded and waited for, and the stop that removes everything it made. What the
 * through-the-service benchmarks and the soak measure is then the service alone.
 */
import { type ChildProcess, type ChildProcessByStdio, spawn, spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import type { Readable } from "node:stream";
import { ensureGuestArtifacts } from "../agent/guest/artifacts.ts";
import { ownerFileOf } from "../agent/snapshot/shm.ts";
import { defaultShmRoot } from "../agent/snapshot/template.ts";
import { childEnv } from "../cli/settings.ts";
import { awaitedLater, bestEffort } from "../contracts/best-effort.ts";
import { SandboxdError } from "../contracts/errors.ts";

const SANDBOXD = resolve(import.meta.dir, "..", "bin", "sandboxd");
/** `up` prints `listening URL` once it serves; the first start may build the guest artifacts. */
const LISTEN_TIMEOUT_MS = 180_000;
/** The uploaded template boots once and is frozen: well under a minute under TCG. */
const TEMPLATE_TIMEOUT_MS = 300_000;

export function cli(args: string[]): string {
  const r = spawnSync(SANDBOXD, args, { encoding: "utf8", env: soakChildEnv() });
  if (r.status !== 0) throw new SandboxdError("internal", `sandboxd ${args[0]} failed: ${r.stderr.trim()}`);
  return r.stdout;
}

export function soakChildEnv(): NodeJS.ProcessEnv {
  // PGlite in the soak's own data dir.
  return childEnv({}, ["DATABASE_URL", "SANDBOXD_DATA_DIR"]);
}

export async function call(
  base: string,
  key: string,
  method: string,
  path: string,
  body?: unknown,
  raw?: Uint8Array,
): Promise<unknown> {
  const headers: Record<string, string> = { authorization: `Bearer ${key}` };
  if (body !== undefined) headers["content-type"] = "application/json";
  if (raw !== undefined) headers["content-type"] = "application/octet-stream";
  const res = await fetch(new URL(path, base), {
    method,
    headers,
    body: raw ?? (body === undefined ? undefined : JSON.stringify(body)),
  });
  const text = await res.text();
  if (res.status >= 300)
    throw new SandboxdError("internal", `${method} ${path}: ${res.status} ${text.slice(0, 300)}`);
  return text === "" ? undefined : JSON.parse(text);
}

/** A fresh data dir under the temp dir, seeded with `cacheDir`'s guest artifacts (built if missing). */
export async function seededDataDir(
  prefix: string,
  cacheDir: string,
  log: (m: string) => void,
): Promise<string> {
  const dataDir = await mkdtemp(join(tmpdir(), prefix));
  await ensureGuestArtifacts({ dataDir: cacheDir, log });
  spawnSync("cp", ["-a", join(cacheDir, "guest"), join(dataDir, "guest")]);
  return dataDir;
}

/** The URL a child `up` prints once it serves; its exit or LISTEN_TIMEOUT_MS fails it. */
export function listeningUrl(up: ChildProcess, stderrTail: () => string): Promise<string> {
  return new Promise<string>((ok, fail) => {
    let out = "";
    const timer = setTimeout(() => fail(new Error(`up did not listen: ${stderrTail()}`)), LISTEN_TIMEOUT_MS);
    up.stdout?.on("data", (b: Buffer) => {
      out += b.toString();
      const m = /listening (\S+)/.exec(out);
      if (m) {
        clearTimeout(timer);
        ok(m[1]!);
      }
    });
    up.once("exit", (code) => {
      clearTimeout(timer);
      fail(new Error(`up exited ${code}: ${stderrTail()}`));
    });
  });
}

/** Uploads the image at `image` as sessions API template `id` with a scale `key`; waits until ready. */
export async function uploadTemplateAndWait(
  base: string,
  key: string,
  id: string,
  image: string | Uint8Array,
  query = "",
): Promise<void> {
  const bytes = typeof image === "string" ? readFileSync(image) : image;
  await call(base, key, "POST", `/v1/templates?id=${id}${query}`, undefined, bytes);
  const deadline = Date.now() + TEMPLATE_TIMEOUT_MS;
  for (;;) {
    const st = (await call(base, key, "GET", `/v1/templates/${id}`)) as { status: string };
    if (st.status === "ready") return;
    if (st.status === "failed" || Date.now() > deadline)
      throw new SandboxdError("internal", `template ${id}: ${JSON.stringify(st)}`);
    await Bun.sleep(250);
  }
}

/** Stops the child `up` (SIGTERM) and waits for it, also when it has already exited or was killed. */
export async function stopUp(up: ChildProcess): Promise<void> {
  up.kill("SIGTERM");
  await new Promise((r) =>
    up.exitCode !== null || up.signalCode !== null ? r(undefined) : up.once("exit", r),
  );
}

/** Removes a child `up`'s data dir and its template RAM files, which live on /dev/shm outside it. */
export async function removeDataDir(dataDir: string): Promise<void> {
  const shm = defaultShmRoot(join(dataDir, "agent"));
  // `force` makes a missing path no error; any other failure is a leak, said on stderr (stdout
  // carries the run's JSON) without hiding the run's own result.
  const log = (m: string) => process.stderr.write(`${m}\n`);
  await bestEffort(log, `removing ${shm}`, rm(shm, { recursive: true, force: true }));
  await bestEffort(log, `removing ${ownerFileOf(shm)}`, rm(ownerFileOf(shm), { force: true }));
  await bestEffort(log, `removing ${dataDir}`, rm(dataDir, { recursive: true, force: true }));
}

/** Stops the child `up` and removes its data dir and its RAM files. */
export async function stopAndRemove(up: ChildProcess, dataDir: string): Promise<void> {
  await stopUp(up);
  await removeDataDir(dataDir);
}

/** A key made by the real CLI on `dataDir` (the last line `key create` prints). */
export function createKey(dataDir: string, tenant: string, tier: string): string {
  return cli(["key", "create", "--data-dir", dataDir, "--tenant", tenant, "--tier", tier])
    .trim()
    .split("\n")
    .at(-1)!;
}

/**
 * Starts `sandboxd up` on `dataDir` (any port, no catalog) with `env` on top of soakChildEnv();
 * `listening` is the URL it serves, `stderrTail` the last 4,000 characters it logged (for error
 * messages), and `onLine` sees each whole line of its log.
 */
export function spawnUp(
  dataDir: string,
  env: Record<string, string>,
  onLine?: (line: string) => void,
): {
  up: ChildProcessByStdio<null, Readable, Readable>;
  listening: Promise<string>;
  stderrTail: () => string;
} {
  const up = spawn(SANDBOXD, ["up", "--port", "0", "--data-dir", dataDir, "--no-catalog"], {
    env: { ...soakChildEnv(), ...env },
    stdio: ["ignore", "pipe", "pipe"],
  });
  let tail = "";
  let partial = "";
  up.stderr.on("data", (b: Buffer) => {
    const text = b.toString();
    tail = (tail + text).slice(-4000);
    const lines = (partial + text).split("\n");
    partial = lines.pop() ?? "";
    if (onLine) for (const line of lines) onLine(line);
  });
  const stderrTail = () => tail;
  const listening = listeningUrl(up, stderrTail);
  // A caller that gave up waiting (an abort) must not see an unhandled rejection at the exit.
  awaitedLater(listening);
  return { up, listening, stderrTail };
}
