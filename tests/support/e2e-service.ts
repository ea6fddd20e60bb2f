/**
 * End-to-end helpers for the HTTP suites (tests/e2e/, tests/vm/, tests/perf/): a private data dir seeded from
 * the shared test cache, API keys made in-process as the CLI makes them, the real
 * service (`bin/sandboxd up`) as a subprocess, a small typed fetch, and leak checks by process
 * table. Test code only.
 *
 * Keys may be created before `up` starts or while it runs (the CLI then goes through its operator
 * socket, cli/operator.ts).
 */
import { spawn, spawnSync } from "node:child_process";
import { existsSync } from "node:fs";
import { mkdir, mkdtemp, readdir, readFile, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { basename, join, resolve } from "node:path";
import type { z } from "zod";
import { CATALOG_IMAGES, type CatalogImageId, ensureCatalogImage } from "../../agent/catalog/python.ts";
import { ensureGuestArtifacts } from "../../agent/guest/artifacts.ts";
import { operatorSocketPath, runOperatorOp } from "../../cli/operator.ts";
import { keyCreate, OPERATOR_OPS } from "../../cli/operator-ops.ts";
import { secretsFrom } from "../../cli/settings.ts";
import * as A from "../../contracts/api/sessions-api.ts";
import type { Tier } from "../../contracts/api/tiers.ts";
import { openDb } from "../../db/client.ts";
import { loadSecrets } from "../../gateway/auth/secrets.ts";
import { assertResponse } from "./openapi-check.ts";

export const REPO = resolve(import.meta.dir, "../..");

/** The file a guest's background counter writes ten times a second (in /root: on the disk). */
export const GUEST_COUNTER = "/root/counter";
/**
 * Starts that counter, detached by an exec (it outlives the exec, as a user's background job
 * does; not through the processes API, whose processes a suspend or a rollback ends): prints its
 * pid once the file holds a value. Each value is written whole to a temp file and renamed into
 * place, so a `cat` never reads it empty.
 */
export const START_GUEST_COUNTER =
  `nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > ${GUEST_COUNTER}.tmp; mv ${GUEST_COUNTER}.tmp ${GUEST_COUNTER}; sleep 0.1; done' >/dev/null 2>&1 & ` +
  `echo $!; until [ -s ${GUEST_COUNTER} ]; do sleep 0.05; done`;
const SANDBOXD = join(REPO, "bin/sandboxd");
/** Guest artifacts (kernel download) and the debootstrapped python layout are cached here. */
export const SHARED_DATA_DIR = process.env.SANDBOXD_TEST_DATA ?? join(REPO, ".data", "test");

/** The CLI checks the host, then PGlite migrates on every open: a few seconds per key. */
const CLI_TIMEOUT_MS = 120_000;
/** `up` prints `listening URL` once the gateway serves (the catalog build runs after that). */
const LISTEN_TIMEOUT_MS = 120_000;

export function childEnv(): NodeJS.ProcessEnv {
  const env: NodeJS.ProcessEnv = { ...process.env };
  delete env.DATABASE_URL; // PGlite in the data dir, never a developer's database
  delete env.SANDBOXD_DATA_DIR;
  // The suites count QEMUs as their sandboxes' (none left after a delete, none while suspended):
  // no pre-launched ones beside them. tests/vm/agent-prelaunch.test.ts covers the pool.
  env.SANDBOXD_PRELAUNCH = "0";
  return env;
}

/** Every catalog template (`up`'s default: python, and base, E2B's default template). */
export const ALL_CATALOG = Object.keys(CATALOG_IMAGES) as CatalogImageId[];

/**
 * A fresh data dir under /tmp (short: VM sockets live under it) seeded with the guest artifacts
 * and the catalog's OCI layouts and imported images from the shared cache, so `up` neither
 * downloads a kernel nor runs debootstrap nor imports. Both are built in the shared dir first
 * when missing (~45 s each, once). `catalog`: the images seeded (default all of them, as `up`
 * builds; `python: false`: none).
 */
export async function prepareDataDir(
  prefix = "sbx-e2e-",
  opts: { python?: boolean; catalog?: readonly CatalogImageId[] } = {},
): Promise<string> {
  await ensureGuestArtifacts({ dataDir: SHARED_DATA_DIR });
  // Without the catalog (`up --no-catalog` suites) there is no debootstrap to wait for.
  const catalog = opts.python === false ? [] : (opts.catalog ?? ALL_CATALOG);
  const images = [];
  for (const id of catalog) {
    images.push(
      await ensureCatalogImage(id, {
        dataDir: SHARED_DATA_DIR,
        ...(process.env.SANDBOXD_DEBIAN_MIRROR ? { mirror: process.env.SANDBOXD_DEBIAN_MIRROR } : {}),
      }),
    );
  }
  const dir = await mkdtemp(join(tmpdir(), prefix));
  const copy = (src: string, dst: string) => {
    // -a keeps the qcow2's holes (sparse) and times; a copy, never a link: an agent owns its files.
    const r = spawnSync("cp", ["-a", src, dst], { encoding: "utf8" });
    if (r.status !== 0) throw new Error(`cp -a ${src} failed: ${r.stderr}`);
  };
  for (const sub of ["guest", "catalog"]) {
    const src = join(SHARED_DATA_DIR, sub);
    if (existsSync(src)) copy(src, join(dir, sub));
  }
  // The catalog images already imported: `up`'s catalog build finds them by digest and goes
  // straight to the templates' boot and snapshot (an import of a ~180 MB rootfs saved in each suite).
  if (images.length > 0) await mkdir(join(dir, "images"), { recursive: true });
  for (const image of images) copy(image.dir, join(dir, "images", basename(image.dir)));
  return dir;
}

interface CliResult {
  code: number | null;
  stdout: string;
  stderr: string;
}

/** Runs bin/sandboxd with `args` (env: the suites' own by default); never throws on exit codes. */
export function runCli(
  args: string[],
  env: NodeJS.ProcessEnv = childEnv(),
  timeoutMs = CLI_TIMEOUT_MS,
): Promise<CliResult> {
  return runCommand(SANDBOXD, args, { env, timeoutMs });
}

/**
 * Runs `cmd` with `args` (no stdin), collecting its output; SIGKILL after `timeoutMs` (a harness
 * bound: a hung program fails its test instead of hanging the suite). Never throws on exit codes.
 */
export function runCommand(
  cmd: string,
  args: string[],
  opts: { env: NodeJS.ProcessEnv; timeoutMs: number; cwd?: string },
): Promise<CliResult> {
  const { env, timeoutMs, cwd } = opts;
  return new Promise((done, fail) => {
    const child = spawn(cmd, args, { env, cwd, stdio: ["ignore", "pipe", "pipe"] });
    let stdout = "";
    let stderr = "";
    child.stdout.on("data", (b: Buffer) => {
      stdout += b.toString();
    });
    child.stderr.on("data", (b: Buffer) => {
      stderr += b.toString();
    });
    const timer = setTimeout(() => child.kill("SIGKILL"), timeoutMs);
    child.once("error", fail);
    child.once("close", (code) => {
      clearTimeout(timer);
      done({ code, stdout, stderr });
    });
  });
}

/**
 * One API key for the data dir's gateway, made in this process: through the running service's
 * operator socket while `up` runs (milliseconds), else on the data dir's PGlite. What the CLI does
 * (`bin/sandboxd key create`, tested by tests/integration/key-cli.test.ts and tests/e2e/key-cli-live.test.ts) without paying a process start
 * and a PGlite migration for each key.
 */
export async function createKey(dataDir: string, tenant: string, tier: Tier): Promise<string> {
  return (await createKeys(dataDir, { key: [tenant, tier] })).key;
}

/**
 * Keys named by the caller, e.g. `{ live: ["a", "live"], other: ["b", "pro"] }`, in order; the
 * database is opened once for all of them when no service runs.
 */
export async function createKeys<K extends string>(
  dataDir: string,
  wanted: Record<K, readonly [tenant: string, tier: Tier]>,
): Promise<Record<K, string>> {
  const out = {} as Record<K, string>;
  const names = Object.keys(wanted) as K[];
  const check = (name: K, key: string) => {
    const [tenant, tier] = wanted[name];
    if (!key.startsWith(`svc_${tier}_`)) throw new Error(`key create ${tenant}/${tier} gave ${key}`);
    out[name] = key;
  };
  if (existsSync(operatorSocketPath(dataDir))) {
    for (const name of names) {
      const [tenant, tier] = wanted[name];
      check(name, (await runOperatorOp(dataDir, OPERATOR_OPS, "key.create", { tenant, tier })).key);
    }
    return out;
  }
  // As the CLI would on this data dir: its PGlite (never a developer's DATABASE_URL, childEnv)
  // and its secrets, made here when `up` has not made them yet.
  const handle = await openDb({ dataDir });
  try {
    const secrets = loadSecrets(dataDir, secretsFrom(childEnv()));
    for (const name of names) {
      const [tenant, tier] = wanted[name];
      check(name, (await keyCreate.run({ db: handle.db, secrets }, { tenant, tier })).key);
    }
  } finally {
    await handle.close();
  }
  return out;
}

// ---- typed fetch -------------------------------------------------------------------------------

export interface ApiResponse<T = unknown> {
  status: number;
  headers: Headers;
  /** Parsed JSON when the response is JSON, else undefined. */
  body: T;
  text: string;
  /** Wall time of the request as the client saw it, ms. */
  ms: number;
}

export interface RequestOptions {
  /** API key, sent as `Authorization: Bearer`; omit for an anonymous request. */
  key?: string;
  /** A JSON value (serialised), or raw bytes / string sent as given. */
  json?: unknown;
  raw?: Uint8Array | string;
  headers?: Record<string, string>;
  query?: Record<string, string>;
  timeoutMs?: number;
}

/** Every response is checked against openapi.yaml (tests/support/openapi-check.ts); a mismatch throws. */
export class Api {
  constructor(readonly baseUrl: string) {}

  async request<T = unknown>(
    method: string,
    path: string,
    opts: RequestOptions = {},
  ): Promise<ApiResponse<T>> {
    const url = new URL(path, this.baseUrl);
    for (const [k, v] of Object.entries(opts.query ?? {})) url.searchParams.set(k, v);
    const headers: Record<string, string> = { ...opts.headers };
    if (opts.key !== undefined) headers.authorization = `Bearer ${opts.key}`;
    let body: string | Uint8Array | undefined;
    if (opts.json !== undefined) {
      headers["content-type"] ??= "application/json";
      body = JSON.stringify(opts.json);
    } else if (opts.raw !== undefined) {
      body = opts.raw;
    }
    const t0 = performance.now();
    const res = await fetch(url, {
      method,
      headers,
      body,
      signal: AbortSignal.timeout(opts.timeoutMs ?? 120_000),
    });
    const text = await res.text();
    const ms = performance.now() - t0;
    assertResponse({
      method,
      path: url.pathname,
      status: res.status,
      contentType: res.headers.get("content-type"),
      text,
    });
    let parsed: unknown;
    if ((res.headers.get("content-type") ?? "").includes("application/json") && text.length > 0) {
      parsed = JSON.parse(text);
    }
    return { status: res.status, headers: res.headers, body: parsed as T, text, ms };
  }

  get<T = unknown>(path: string, opts?: RequestOptions) {
    return this.request<T>("GET", path, opts);
  }
  post<T = unknown>(path: string, opts?: RequestOptions) {
    return this.request<T>("POST", path, opts);
  }
  put<T = unknown>(path: string, opts?: RequestOptions) {
    return this.request<T>("PUT", path, opts);
  }
  delete<T = unknown>(path: string, opts?: RequestOptions) {
    return this.request<T>("DELETE", path, opts);
  }
}

/**
 * Asserts the status (with the body in the message, so a failure says what the service said)
 * and parses the body with a contract schema: the typed value for the rest of the test.
 */
export function expectOk<S extends z.ZodType>(res: ApiResponse, status: number, schema: S): z.output<S> {
  if (res.status !== status) {
    throw new Error(`expected HTTP ${status}, got ${res.status}: ${res.text.slice(0, 500)}`);
  }
  const r = schema.safeParse(res.body);
  if (!r.success) throw new Error(`body does not match the contract: ${r.error.message}\n${res.text}`);
  return r.data;
}

/** Asserts an error response: status and the `{code, message}` envelope. */
export function expectError(res: ApiResponse, status: number, code?: string): void {
  const got = res.body as { code?: unknown; message?: unknown } | undefined;
  const ok =
    res.status === status &&
    typeof got?.message === "string" &&
    typeof got.code === "string" &&
    (code === undefined || got.code === code);
  if (!ok) {
    throw new Error(`expected HTTP ${status} ${code ?? ""}, got ${res.status}: ${res.text.slice(0, 500)}`);
  }
}

// ---- the service -------------------------------------------------------------------------------

export interface RunningService {
  url: string;
  api: Api;
  dataDir: string;
  pid: number;
  /** The last lines `up` logged (stderr), for failure messages. */
  logTail(lines?: number): string;
  /** SIGTERM, then wait for the exit (SIGKILL after `graceMs`); returns the exit code. */
  stop(graceMs?: number): Promise<number | null>;
}

/**
 * Starts `bin/sandboxd up` on 127.0.0.1 (the OS picks a free port) and waits for `listening`;
 * `extraArgs` are added to its command line (e.g. `--no-catalog`), `extraEnv` to its environment
 * (operator settings such as `SANDBOXD_EGRESS_ALLOW_INTERNAL`).
 */
export function startUp(
  dataDir: string,
  extraArgs: string[] = [],
  extraEnv: Record<string, string> = {},
): Promise<RunningService> {
  // A suite that names no catalog gets python's alone: each catalog template is a boot and a
  // snapshot under TCG at the start of `up`, and a suite counts its QEMUs. The E2B suites ask
  // for base (`--catalog python,base`).
  const catalog = extraArgs.some((a) => a === "--no-catalog" || a === "--catalog")
    ? []
    : ["--catalog", "python"];
  const args = ["up", "--host", "127.0.0.1", "--port", "0", "--data-dir", dataDir, ...catalog, ...extraArgs];
  return startServing(args, dataDir, { ...childEnv(), ...extraEnv });
}

/**
 * Starts a serving `bin/sandboxd` command (`up`, `gateway`, `agent`) with `args` and the whole
 * environment `env`, and waits for the `listening URL` line it prints once it serves.
 */
export async function startServing(
  args: string[],
  dataDir: string,
  env: NodeJS.ProcessEnv,
  /** A command that runs it (`ip netns exec NS`): its program and arguments before bin/sandboxd. */
  wrap: string[] = [],
): Promise<RunningService> {
  const [program, ...argv] = [...wrap, SANDBOXD, ...args] as [string, ...string[]];
  // No readiness delay at a stop unless the suite asks for one: nothing balances load in front
  // of a test's service, and every suite's teardown would wait for it.
  const child = spawn(program, argv, {
    env: { SANDBOXD_DRAIN_DELAY: "0", ...env },
    stdio: ["ignore", "pipe", "pipe"],
  });
  let log = "";
  child.stderr.on("data", (b: Buffer) => {
    log = (log + b.toString()).slice(-200_000);
  });
  let exit: { code: number | null } | undefined;
  const exited = new Promise<number | null>((done) =>
    child.once("exit", (code) => {
      exit = { code };
      done(code);
    }),
  );
  const url = await new Promise<string>((done, fail) => {
    let out = "";
    const timer = setTimeout(
      () =>
        fail(
          new Error(`sandboxd ${args[0]} did not listen in ${LISTEN_TIMEOUT_MS} ms:\n${log.slice(-4000)}`),
        ),
      LISTEN_TIMEOUT_MS,
    );
    child.stdout.on("data", (b: Buffer) => {
      out += b.toString();
      const m = /^listening (http:\/\/\S+)$/m.exec(out);
      if (m) {
        clearTimeout(timer);
        done(m[1]!);
      }
    });
    void exited.then((code) => {
      clearTimeout(timer);
      fail(new Error(`sandboxd ${args[0]} exited ${code} before listening:\n${log.slice(-4000)}`));
    });
  });
  const pid = child.pid!;
  return {
    url,
    api: new Api(url),
    dataDir,
    pid,
    logTail: (lines = 40) => log.trimEnd().split("\n").slice(-lines).join("\n"),
    async stop(graceMs = 30_000) {
      if (exit) return exit.code;
      child.kill("SIGTERM");
      const timer = setTimeout(() => child.kill("SIGKILL"), graceMs);
      const code = await exited;
      clearTimeout(timer);
      return code;
    },
  };
}

/**
 * A suite's teardown: stops `up` (if still running), waits up to 10 s for its QEMUs to go, kills
 * any left (ours: that `up` started them) and removes the data dir.
 */
export async function stopAndClean(svc: RunningService | undefined, dataDir: string): Promise<void> {
  await svc?.stop();
  if (dataDir) await reapDataDir(dataDir);
}

/** Polls `GET /v1/health` (no key) until `templates[id].ready` or the deadline. */
export async function waitForTemplate(svc: RunningService, id: string, timeoutMs: number): Promise<void> {
  const deadline = performance.now() + timeoutMs;
  let last = "";
  while (performance.now() < deadline) {
    const h = await svc.api.get<{ templates?: Record<string, { ready?: boolean }> }>("/v1/health");
    last = h.text;
    if (h.status === 200 && h.body?.templates?.[id]?.ready === true) return;
    if (/catalog: python template failed/.test(svc.logTail(200))) break;
    await Bun.sleep(500);
  }
  throw new Error(`template ${id} not ready after ${timeoutMs} ms; health ${last}\n${svc.logTail()}`);
}

/**
 * Registers an uploaded sessions API template (`POST /v1/templates?id=`, the image archive as the
 * body) with a scale `key`, then polls `GET /v1/templates/{id}` until it leaves `building`.
 * Throws unless it ends `ready`; returns the registration's answer.
 */
export async function uploadTemplate(
  svc: RunningService,
  key: string,
  id: string,
  image: Uint8Array,
  timeoutMs: number,
): Promise<z.output<typeof A.RegisterTemplateResponse>> {
  const res = await svc.api.post("/v1/templates", {
    key,
    query: { id },
    raw: image,
    headers: { "content-type": "application/octet-stream" },
  });
  const registered = expectOk(res, 202, A.RegisterTemplateResponse);
  let t: A.TemplateA = { id, status: "building" };
  const deadline = performance.now() + timeoutMs;
  while (t.status === "building" && performance.now() < deadline) {
    await Bun.sleep(500);
    t = expectOk(await svc.api.get(`/v1/templates/${id}`, { key }), 200, A.TemplateA);
  }
  if (t.status !== "ready") throw new Error(`template ${id}: ${JSON.stringify(t)}\n${svc.logTail()}`);
  return registered;
}

// ---- leak checks -------------------------------------------------------------------------------

/** Pids of processes whose command line mentions `dir` (like `pgrep -f dir`), by name filter. */
export async function pidsMentioning(dir: string, filter: (cmd: string) => boolean = () => true) {
  const out: { pid: number; cmd: string }[] = [];
  for (const p of await readdir("/proc")) {
    if (!/^\d+$/.test(p) || Number(p) === process.pid) continue;
    try {
      const cmd = (await readFile(`/proc/${p}/cmdline`, "utf8")).replaceAll("\0", " ").trim();
      if (cmd.includes(dir) && filter(cmd)) out.push({ pid: Number(p), cmd });
    } catch {
      // raced with an exiting process
    }
  }
  return out;
}

/**
 * QEMU processes of `dir`: the program itself is qemu-system-*. The jail's wrappers (setpriv,
 * unshare, its shell) carry QEMU's argv in theirs and are not counted as QEMUs.
 */
export const qemusUnder = (dir: string) =>
  pidsMentioning(dir, (cmd) => /(^|\/)qemu-system-[^/ ]*$/.test(cmd.split(" ", 1)[0] ?? ""));

/** Polls until `cond` holds or `timeoutMs` passes; returns whether it held. */
export async function waitFor(cond: () => boolean | Promise<boolean>, timeoutMs: number): Promise<boolean> {
  const deadline = performance.now() + timeoutMs;
  while (performance.now() < deadline) {
    if (await cond()) return true;
    await Bun.sleep(50);
  }
  return cond();
}

/**
 * After the service stopped: waits up to 10 s for its QEMUs to exit and kills (by pid) any left
 * for `dir` (ours: started by our `up`). Returns the pids it had to kill.
 */
export async function reapQemus(dir: string): Promise<number[]> {
  await waitFor(async () => (await qemusUnder(dir)).length === 0, 10_000);
  const left = (await qemusUnder(dir)).map((q) => q.pid);
  for (const pid of left) process.kill(pid, "SIGKILL");
  return left;
}

/** `reapQemus`, then removes the dir. Returns the pids it had to kill. */
export async function reapDataDir(dir: string): Promise<number[]> {
  const left = await reapQemus(dir);
  await removeDataDir(dir);
  return left;
}

/** Removes a data dir made by `prepareDataDir` (and only such a dir). */
export async function removeDataDir(dir: string): Promise<void> {
  if (!dir.startsWith(join(tmpdir(), "sbx-e2e"))) throw new Error(`refusing to remove ${dir}`);
  await rm(dir, { recursive: true, force: true });
}

// ---- latency -----------------------------------------------------------------------------------

/** Nearest-rank percentile of `samples` (ms). */
export function percentile(samples: number[], p: number): number {
  const s = [...samples].sort((a, b) => a - b);
  if (s.length === 0) return Number.NaN;
  const rank = Math.min(s.length, Math.max(1, Math.ceil((p / 100) * s.length)));
  return s[rank - 1]!;
}

export function latencySummary(samples: number[]) {
  const r = (x: number) => Math.round(x * 10) / 10;
  return {
    n: samples.length,
    p50_ms: r(percentile(samples, 50)),
    p95_ms: r(percentile(samples, 95)),
    min_ms: r(Math.min(...samples)),
    max_ms: r(Math.max(...samples)),
  };
}
