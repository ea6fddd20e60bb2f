/**
 * `sandboxd bench --soak N --image ARCHIVE [--data-dir DIR] [--json]`: N create -> exec -> delete
 * cycles of a sessions API session through the HTTP API of a real `sandboxd up` (a child process, so
 * what is measured is the service alone), on a fresh data dir seeded with the guest artifacts of
 * DIR. It prints the service's RSS, open fds, its RAM files on /dev/shm and its data dir's size at
 * the start (after one warm-up cycle: caches, the template's pages, the database's first pages),
 * the middle and the end, each right after a full GC of the service with its JS heap (heap-stats.ts),
 * a series of RSS and heap every SOAK_SAMPLE_EVERY cycles (a plateau is warm-up, a slope a leak),
 * the JS types that grew, and everything the runs leave behind once the service has stopped: QEMU
 * processes, VM directories, cgroups, jail uid locks. Not a timed benchmark: the figures say
 * whether the service leaks.
 */
import { type ChildProcess, type ChildProcessByStdio, spawn, spawnSync } from "node:child_process";
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import type { Readable } from "node:stream";
import { ensureGuestArtifacts } from "../agent/guest/artifacts.ts";
import { cgroupName, vmCgroupDirs } from "../agent/qemu/cgroup.ts";
import { UID_LOCK_DIR } from "../agent/qemu/uids.ts";
import { ownerFileOf } from "../agent/snapshot/shm.ts";
import { defaultShmRoot } from "../agent/snapshot/template.ts";
import { qemuPidsNaming } from "../agent/vm/process.ts";
import { vmsRoot } from "../agent/vm/workdir.ts";
import { SandboxdError } from "../contracts/errors.ts";
import { HEAP_STATS_ENV, type HeapStatsLine, parseHeapStatsLine } from "./heap-stats.ts";
import { childEnv } from "./settings.ts";

const SANDBOXD = resolve(import.meta.dir, "..", "bin", "sandboxd");
/** `up` prints `listening URL` once it serves; the first start may build the guest artifacts. */
const LISTEN_TIMEOUT_MS = 180_000;
/** The uploaded template boots once and is frozen: well under a minute under TCG. */
const TEMPLATE_TIMEOUT_MS = 300_000;
const TEMPLATE_ID = "soak";
/** Cycles between two points of the RSS/heap series: 20 points over 1,000 cycles. */
export const SOAK_SAMPLE_EVERY = 50;
/** A full collection of the service's heap takes tens of ms; 10 s means it does not answer. */
const HEAP_STATS_TIMEOUT_MS = 10_000;
/** Types whose live count grew most from start to end, reported. */
const GROWING_TYPES = 12;

export interface SoakSample {
  rss_kib: number;
  /** RSS split (/proc/<pid>/status): anonymous memory (heap, allocator, JIT code) ... */
  rss_anon_kib: number;
  /** ... and file pages (the Bun binary, shared libraries, mapped files). */
  rss_file_kib: number;
  /** The part of RSS in anonymous executable mappings: JIT-compiled code. */
  rss_jit_kib: number;
  open_fds: number;
  /** Bytes of this service's RAM files on /dev/shm (its shm root). */
  shm_bytes: number;
  /** Bytes under the data dir (what `du` counts). */
  data_dir_bytes: number;
}

/** The service's JS heap after a full GC (what each field is: HeapStatsLine in heap-stats.ts). */
export type SoakHeap = Pick<
  HeapStatsLine,
  "heap_bytes" | "external_bytes" | "heap_capacity_bytes" | "object_count"
>;

/** One point of the series: after `cycle` cycles, with a full GC first. */
export type SoakPoint = { cycle: number } & Pick<SoakSample, "rss_kib" | "rss_anon_kib" | "rss_jit_kib"> &
  SoakHeap;

export interface SoakResult {
  cycles: number;
  failures: number;
  /** Failures' first messages (at most 5). */
  errors: string[];
  /** Samples are taken after a full GC of the service (heap-stats.ts), so RSS is comparable. */
  start: SoakSample & SoakHeap;
  middle: SoakSample & SoakHeap;
  end: SoakSample & SoakHeap;
  /** RSS and live heap every SOAK_SAMPLE_EVERY cycles: a plateau is warm-up, a slope is a leak. */
  series: SoakPoint[];
  /** Live object counts per type that grew most from start to end (end - start). */
  growing_types: Record<string, number>;
  leftovers: {
    qemu_processes: number[];
    vm_dirs: string[];
    cgroups: string[];
    uid_locks: string[];
  };
  total_ms: number;
}

/** A sample of process `pid` and the service's files. */
export function sample(pid: number, dataDir: string): SoakSample {
  const status = readFileSync(`/proc/${pid}/status`, "utf8");
  const kib = (field: string) => Number(new RegExp(`^${field}:\\s+(\\d+)`, "m").exec(status)?.[1] ?? 0);
  return {
    rss_kib: kib("VmRSS"),
    rss_anon_kib: kib("RssAnon"),
    rss_file_kib: kib("RssFile"),
    rss_jit_kib: jitRssKib(pid),
    open_fds: readdirSync(`/proc/${pid}/fd`).length,
    shm_bytes: duBytes(defaultShmRoot(join(dataDir, "agent"))),
    data_dir_bytes: duBytes(dataDir),
  };
}

/** RSS of the anonymous executable mappings of `pid` (/proc/<pid>/smaps): the JIT's code. */
export function jitRssKib(pid: number): number {
  let smaps: string;
  try {
    smaps = readFileSync(`/proc/${pid}/smaps`, "utf8");
  } catch {
    return 0;
  }
  let total = 0;
  let jit = false;
  for (const line of smaps.split("\n")) {
    // A mapping's header: "start-end perms offset dev inode [path]"; anonymous ones have no path.
    const h = /^[0-9a-f]+-[0-9a-f]+ (\S{4}) \S+ \S+ \S+\s*(.*)$/.exec(line);
    if (h) jit = h[1]!.includes("x") && h[2] === "";
    else if (jit && line.startsWith("Rss:")) total += Number(/(\d+)/.exec(line)?.[1] ?? 0);
  }
  return total;
}

function duBytes(path: string): number {
  if (!existsSync(path)) return 0;
  const r = spawnSync("du", ["-sb", path], { encoding: "utf8" });
  return Number(r.stdout.split(/\s/)[0] ?? 0) || 0;
}

/** What the service's VMs may leave behind: by the VM directories of its data dir. */
export async function leftovers(dataDir: string): Promise<SoakResult["leftovers"]> {
  const root = vmsRoot(join(dataDir, "agent"));
  const vmDirs = existsSync(root) ? readdirSync(root) : [];
  const cgroups: string[] = [];
  // The cgroup parents (one on v2, one per controller on v1); a VM's cgroup is named after the
  // hash of its directory's path, so a name is ours when it matches a directory under `root`.
  for (const parent of new Set((vmCgroupDirs(join(root, "x"))?.dirs ?? []).map((d) => dirname(d)))) {
    let names: string[] = [];
    try {
      names = readdirSync(parent);
    } catch {
      continue;
    }
    for (const name of names) {
      const m = /^(?:sandboxd-)?(.+)-[0-9a-f]{12}$/.exec(name);
      if (m && name.endsWith(cgroupName(join(root, m[1]!)))) cgroups.push(join(parent, name));
    }
  }
  const uidLocks: string[] = [];
  for (const n of existsSync(UID_LOCK_DIR) ? readdirSync(UID_LOCK_DIR) : []) {
    try {
      if (readFileSync(join(UID_LOCK_DIR, n), "utf8").startsWith(`${root}/`)) uidLocks.push(n);
    } catch {
      // released meanwhile
    }
  }
  return {
    qemu_processes: await qemuPidsNaming([dataDir]),
    vm_dirs: vmDirs,
    cgroups,
    uid_locks: uidLocks,
  };
}

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
  if (res.status >= 300) throw new Error(`${method} ${path}: ${res.status} ${text.slice(0, 300)}`);
  return text === "" ? undefined : JSON.parse(text);
}

export async function runSoak(o: {
  cycles: number;
  image: string;
  /** The cache whose guest artifacts seed the soak's data dir. */
  cacheDir: string;
  signal?: AbortSignal;
  log: (m: string) => void;
}): Promise<SoakResult> {
  const t0 = performance.now();
  const dataDir = await seededDataDir("sbx-soak-", o.cacheDir, o.log);
  // The guest artifacts (kernel, initramfs) are built once in the cache and copied: each soak's
  // `up` then starts without a download.
  const live = createKey(dataDir, "soak", "live");
  const scale = createKey(dataDir, "soak", "scale");
  const heapWaiters: ((h: HeapStatsLine) => void)[] = [];
  // The service answers SIGUSR2 with its heap after a full GC (heap-stats.ts).
  const { up, listening } = spawnUp(dataDir, { [HEAP_STATS_ENV]: "1" }, (line) => {
    const h = parseHeapStatsLine(line);
    if (h) heapWaiters.shift()?.(h);
  });
  /** The service's heap after a full GC, and its RSS and files right after. */
  const measure = async (
    pid: number,
  ): Promise<{ s: SoakSample & SoakHeap; types: Record<string, number> }> => {
    const h = await new Promise<HeapStatsLine>((ok, fail) => {
      const timer = setTimeout(
        () => fail(new Error("the service printed no heap stats")),
        HEAP_STATS_TIMEOUT_MS,
      );
      heapWaiters.push((v) => {
        clearTimeout(timer);
        ok(v);
      });
      process.kill(pid, "SIGUSR2");
    });
    return {
      s: {
        ...sample(pid, dataDir),
        heap_bytes: h.heap_bytes,
        external_bytes: h.external_bytes,
        object_count: h.object_count,
        heap_capacity_bytes: h.heap_capacity_bytes,
      },
      types: h.types,
    };
  };
  try {
    const base = await listening;
    const pid = up.pid!;
    o.log(`soak: up ${base} (pid ${pid}), data ${dataDir}`);
    await uploadTemplateAndWait(base, scale, TEMPLATE_ID, o.image);
    const cycle = async () => {
      const s = (await call(base, live, "POST", "/v1/sessions", { template_id: TEMPLATE_ID })) as {
        session_id: string;
      };
      const r = (await call(base, live, "POST", `/v1/sessions/${s.session_id}/exec`, {
        commands: [["echo", "soak"]],
      })) as { stdout: string; exit_code: number };
      await call(base, live, "DELETE", `/v1/sessions/${s.session_id}`);
      if (r.exit_code !== 0 || r.stdout.trim() !== "soak")
        throw new Error(`exec answered ${JSON.stringify(r)}`);
    };
    await cycle(); // warm-up: not counted
    const first = await measure(pid);
    const start = first.s;
    const point = (cycle: number, m: SoakSample & SoakHeap): SoakPoint => ({
      cycle,
      rss_kib: m.rss_kib,
      rss_anon_kib: m.rss_anon_kib,
      rss_jit_kib: m.rss_jit_kib,
      heap_bytes: m.heap_bytes,
      external_bytes: m.external_bytes,
      heap_capacity_bytes: m.heap_capacity_bytes,
      object_count: m.object_count,
    });
    const series: SoakPoint[] = [point(0, start)];
    let middle = start;
    let failures = 0;
    const errors: string[] = [];
    let done = 0;
    for (; done < o.cycles && !o.signal?.aborted; done++) {
      try {
        await cycle();
      } catch (err) {
        failures++;
        if (errors.length < 5) errors.push(err instanceof Error ? err.message : String(err));
      }
      const n = done + 1;
      const half = n === Math.floor(o.cycles / 2);
      if ((n % SOAK_SAMPLE_EVERY === 0 || half) && n < o.cycles) {
        const m = (await measure(pid)).s;
        series.push(point(n, m));
        if (half) middle = m;
        o.log(`soak: ${n}/${o.cycles} rss ${m.rss_kib} KiB heap ${m.heap_bytes} B`);
      }
    }
    // Destroys finish in the background of the API's answer (the VM's directory, its cgroup).
    await Bun.sleep(1000);
    const last = await measure(pid);
    const end = last.s;
    series.push(point(done, end));
    // Leftovers are counted once the service has stopped: while it runs, the QEMUs it keeps
    // pre-launched for the template (agent/sandbox/prelaunch-pool.ts) are its own, and it frees
    // them at stop; a deleted sandbox's QEMU would outlive the stop and be counted.
    up.kill("SIGTERM");
    await new Promise((r) => (up.exitCode !== null ? r(undefined) : up.once("exit", r)));
    return {
      cycles: done,
      failures,
      errors,
      start,
      middle,
      end,
      series,
      growing_types: growingTypes(first.types, last.types),
      leftovers: await leftovers(dataDir),
      total_ms: Math.round(performance.now() - t0),
    };
  } finally {
    await stopAndRemove(up, dataDir);
  }
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
      throw new Error(`template ${id}: ${JSON.stringify(st)}`);
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
  await rm(shm, { recursive: true, force: true }).catch(() => {});
  await rm(ownerFileOf(shm), { force: true }).catch(() => {});
  await rm(dataDir, { recursive: true, force: true }).catch(() => {});
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
  listening.catch(() => {});
  return { up, listening, stderrTail };
}

/** The GROWING_TYPES types whose live count grew most from `a` to `b`, by growth. */
export function growingTypes(a: Record<string, number>, b: Record<string, number>): Record<string, number> {
  return Object.fromEntries(
    Object.entries(b)
      .map(([t, n]) => [t, n - (a[t] ?? 0)] as const)
      .filter(([, d]) => d > 0)
      .sort((x, y) => y[1] - x[1])
      .slice(0, GROWING_TYPES),
  );
}
