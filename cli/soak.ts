/**
 * `sandboxd bench --soak N --image ARCHIVE [--data-dir DIR] [--json]`: N create -> exec -> delete
 * cycles of a Family A session through the HTTP API of a real `sandboxd up` (a child process, so
 * what is measured is the service alone), on a fresh data dir seeded with the guest artifacts of
 * DIR. It prints the service's RSS, open fds, its RAM files on /dev/shm and its data dir's size at
 * the start (after one warm-up cycle: caches, the template's pages, the database's first pages)
 * and at the end, and everything the runs leave behind once the service has stopped: QEMU
 * processes, VM directories, cgroups, jail uid locks. Not a timed benchmark: the figures say whether the service leaks.
 */
import { spawn, spawnSync } from "node:child_process";
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { ensureGuestArtifacts } from "../agent/guest/artifacts.ts";
import { cgroupName, vmCgroupDirs } from "../agent/qemu/cgroup.ts";
import { UID_LOCK_DIR } from "../agent/qemu/uids.ts";
import { ownerFileOf } from "../agent/snapshot/shm.ts";
import { defaultShmRoot } from "../agent/snapshot/template.ts";
import { qemuPidsNaming } from "../agent/vm/process.ts";
import { vmsRoot } from "../agent/vm/workdir.ts";
import { SandboxdError } from "../contracts/errors.ts";

const SANDBOXD = resolve(import.meta.dir, "..", "bin", "sandboxd");
/** `up` prints `listening URL` once it serves; the first start may build the guest artifacts. */
const LISTEN_TIMEOUT_MS = 180_000;
/** The uploaded template boots once and is frozen: well under a minute under TCG. */
const TEMPLATE_TIMEOUT_MS = 300_000;
const TEMPLATE_ID = "soak";

export interface SoakSample {
  rss_kib: number;
  open_fds: number;
  /** Bytes of this service's RAM files on /dev/shm (its shm root). */
  shm_bytes: number;
  /** Bytes under the data dir (what `du` counts). */
  data_dir_bytes: number;
}

export interface SoakResult {
  cycles: number;
  failures: number;
  /** Failures' first messages (at most 5). */
  errors: string[];
  start: SoakSample;
  end: SoakSample;
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
  const rss = Number(/^VmRSS:\s+(\d+)/m.exec(status)?.[1] ?? 0);
  return {
    rss_kib: rss,
    open_fds: readdirSync(`/proc/${pid}/fd`).length,
    shm_bytes: duBytes(defaultShmRoot(join(dataDir, "agent"))),
    data_dir_bytes: duBytes(dataDir),
  };
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

function cli(args: string[]): string {
  const r = spawnSync(SANDBOXD, args, { encoding: "utf8", env: childEnv() });
  if (r.status !== 0) throw new SandboxdError("internal", `sandboxd ${args[0]} failed: ${r.stderr.trim()}`);
  return r.stdout;
}

function childEnv(): NodeJS.ProcessEnv {
  const env = { ...process.env };
  delete env.DATABASE_URL; // PGlite in the soak's own data dir
  delete env.SANDBOXD_DATA_DIR;
  return env;
}

async function call(
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
  const dataDir = await mkdtemp(join(tmpdir(), "sbx-soak-"));
  // The guest artifacts (kernel, initramfs) are built once in the cache and copied: each soak's
  // `up` then starts without a download.
  await ensureGuestArtifacts({ dataDir: o.cacheDir, log: o.log });
  spawnSync("cp", ["-a", join(o.cacheDir, "guest"), join(dataDir, "guest")]);
  const live = cli(["key", "create", "--data-dir", dataDir, "--tenant", "soak", "--tier", "live"])
    .trim()
    .split("\n")
    .at(-1)!;
  const scale = cli(["key", "create", "--data-dir", dataDir, "--tenant", "soak", "--tier", "scale"])
    .trim()
    .split("\n")
    .at(-1)!;
  const up = spawn(SANDBOXD, ["up", "--port", "0", "--data-dir", dataDir, "--no-catalog"], {
    env: childEnv(),
    stdio: ["ignore", "pipe", "pipe"],
  });
  let stderrTail = "";
  up.stderr.on("data", (b: Buffer) => {
    stderrTail = (stderrTail + b.toString()).slice(-4000);
  });
  try {
    const base = await new Promise<string>((ok, fail) => {
      let out = "";
      const timer = setTimeout(() => fail(new Error(`up did not listen: ${stderrTail}`)), LISTEN_TIMEOUT_MS);
      up.stdout.on("data", (b: Buffer) => {
        out += b.toString();
        const m = /listening (\S+)/.exec(out);
        if (m) {
          clearTimeout(timer);
          ok(m[1]!);
        }
      });
      up.once("exit", (code) => fail(new Error(`up exited ${code}: ${stderrTail}`)));
    });
    const pid = up.pid!;
    o.log(`soak: up ${base} (pid ${pid}), data ${dataDir}`);
    await call(base, scale, "POST", `/v1/templates?id=${TEMPLATE_ID}`, undefined, readFileSync(o.image));
    const deadline = Date.now() + TEMPLATE_TIMEOUT_MS;
    for (;;) {
      const st = (await call(base, scale, "GET", `/v1/templates/${TEMPLATE_ID}`)) as { status: string };
      if (st.status === "ready") break;
      if (st.status === "failed" || Date.now() > deadline)
        throw new Error(`template ${TEMPLATE_ID}: ${JSON.stringify(st)}`);
      await Bun.sleep(250);
    }
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
    const start = sample(pid, dataDir);
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
      if ((done + 1) % 100 === 0) o.log(`soak: ${done + 1}/${o.cycles}`);
    }
    // Destroys finish in the background of the API's answer (the VM's directory, its cgroup).
    await Bun.sleep(1000);
    const end = sample(pid, dataDir);
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
      end,
      leftovers: await leftovers(dataDir),
      total_ms: Math.round(performance.now() - t0),
    };
  } finally {
    up.kill("SIGTERM");
    await new Promise((r) => (up.exitCode !== null ? r(undefined) : up.once("exit", r)));
    // The RAM files of its template live on /dev/shm, outside the data dir.
    const shm = defaultShmRoot(join(dataDir, "agent"));
    await rm(shm, { recursive: true, force: true }).catch(() => {});
    await rm(ownerFileOf(shm), { force: true }).catch(() => {});
    await rm(dataDir, { recursive: true, force: true }).catch(() => {});
  }
}
