/**
 * What a child `sandboxd up` holds and leaves behind, read from outside it: its RSS (with the JIT's
 * share), open fds, RAM files on /dev/shm and data-dir size while it runs, and, once it has
 * stopped, the QEMU processes, VM directories, cgroups and jail uid locks its VMs left. The soak,
 * `bench --http` and `bench --density` report these.
 */
import { spawnSync } from "node:child_process";
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { cgroupName, vmCgroupDirs } from "../agent/qemu/cgroup.ts";
import { UID_LOCK_DIR } from "../agent/qemu/uids.ts";
import { defaultShmRoot } from "../agent/snapshot/template.ts";
import { qemuPidsNaming } from "../agent/vm/process.ts";
import { vmsRoot } from "../agent/vm/workdir.ts";

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

/** What the service's VMs left behind once it stopped; every list empty when it cleaned up. */
export interface Leftovers {
  qemu_processes: number[];
  vm_dirs: string[];
  cgroups: string[];
  uid_locks: string[];
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
export async function leftovers(dataDir: string): Promise<Leftovers> {
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
