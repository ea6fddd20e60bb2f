/**
 * One cgroup per VM, capping its QEMU's memory, number of tasks and CPU time, on cgroup v2 and on
 * v1 hosts.
 *
 * - v2 (`/sys/fs/cgroup/cgroup.controllers` present): `/sys/fs/cgroup/sandboxd/<name>` with
 *   `memory.max`, `pids.max`, `cpu.max`; the `sandboxd` parent holds no process and enables the
 *   three controllers for its children in `cgroup.subtree_control`.
 * - v1 (a hierarchy per controller, e.g. `/sys/fs/cgroup/memory`): `<hierarchy>/<the agent's own
 *   cgroup there>/sandboxd-<name>` with `memory.limit_in_bytes`, `pids.max` and
 *   `cpu.cfs_quota_us`/`cpu.cfs_period_us`. Nesting under the agent's own cgroup keeps the VMs
 *   inside whatever limits the agent's host gives the agent. Only the memory hierarchy has a
 *   common `sandboxd` parent (`<agent's memory cgroup>/sandboxd/sandboxd-<name>`): v1's CPU
 *   scheduler weighs a group as one task, so all VMs under one CPU parent would share the CPU
 *   weight an unconfined QEMU has alone.
 *
 * The memory parent (`sandboxd` on both layouts) carries the host's VM memory budget
 * (`limitVmMemory`), the figure admission hands out: should a VM's accounting be wrong, the VMs
 * together still cannot take the agent's or the host's memory; the kernel's OOM killer then
 * picks inside the parent. Pages a removed VM cgroup still holds (a template's RAM file on
 * tmpfs, written by the template's QEMU) stay charged to the parent.
 *
 * A VM's cgroup is named after its directory and removed when its QEMU is gone; `sweepCgroups`
 * removes the empty ones a crashed agent left.
 */

import { createHash } from "node:crypto";
import { existsSync, readFileSync } from "node:fs";
import { mkdir, readdir, readFile, rmdir, stat, writeFile } from "node:fs/promises";
import { basename, dirname, join } from "node:path";
import { JailError } from "./jail.ts";

export const CGROUP_ROOT = "/sys/fs/cgroup";
const PARENT = "sandboxd";

/**
 * QEMU's own memory beside guest RAM and the translation cache: heap, libraries, device state,
 * qcow2 caches, TCG's TB descriptors and hash tables, migration buffers. Measured on this 2-core
 * host by tests/vm/host-memory.test.ts (PSS of the QEMU less its guest RAM mapping, 128 MiB
 * busybox guests restored from a template, TCG): idle 37-38 MiB, busy 42-46 MiB (the guest filled
 * all the RAM it had free into its /dev/shm) under QEMU 10.0, each with its 14-22 MiB of
 * translated code; under QEMU 7.2 the busy VM's cgroup held at most guest RAM + 18 MiB
 * (`memory.max_usage_in_bytes`). 128 MiB is ~3x the busy figure: the cgroup limit is this exact
 * figure, and a well-behaved VM killed by its own cgroup would be the wrong trade.
 */
export const QEMU_OVERHEAD_BYTES = 128 * 1024 * 1024;
/**
 * What a standby QEMU (snapshot/standby.ts: launched ahead of a VM's next rollback, waiting with
 * `-incoming defer -S`) holds until it takes over: QEMU's own heap and TCG set-up, its guest RAM
 * the snapshot's image mapped private and untouched. Measured from /proc on a 256 MiB TCG guest:
 * 21 MiB PSS, 39 MiB RSS. It runs no guest code while it waits, so nothing a guest does grows
 * it; 64 MiB bounds the RSS with room. When it takes over, the VM's old QEMU has exited first.
 */
export const STANDBY_HELD_BYTES = 64 * 1024 * 1024;
/**
 * Under TCG, QEMU's translated-code buffer, given to QEMU as `-accel tcg,tb-size=` (args.ts):
 * unset, QEMU sizes it at min(1 GiB, host RAM / 8) and fills it as the guest runs new code, a
 * cost admission would have to reserve per VM. 256 MiB: an idle busybox guest translates ~14 MiB
 * and a busy one (Python, a browser) far more, and a buffer below a guest's working set costs
 * flushes and retranslation (8 MiB made exec p50 84-120 ms against 4-8 ms); 256 MiB is 18x the
 * idle working set and a quarter of the 1 GiB that a browser guest was seen to nearly fill.
 * KVM has no such buffer.
 */
export const TCG_TB_MIB = 256;
export const TCG_CODE_BUFFER_BYTES = TCG_TB_MIB * 1024 * 1024;
/**
 * Tasks: QEMU's main loop, RCU and signal threads, one thread per vCPU and its block I/O thread
 * pool (up to 64 workers), plus margin.
 */
export const PIDS_BASE = 96;
const CFS_PERIOD_US = 100_000;
/**
 * CPU beside the vCPUs: QEMU's main loop (device emulation, migration streams, block I/O) runs
 * alongside the vCPU threads. Capped at exactly its vCPUs, a spawn measured ~30% slower under TCG
 * (the restore and the first guest work compete); one extra core keeps it at par.
 */
const MAIN_LOOP_CPUS = 1;

export type CgroupVersion = 1 | 2;

export interface CgroupLimits {
  memoryBytes: number;
  pids: number;
  /** CPU time per period, in cores (vCPUs). */
  cpus: number;
}

/**
 * What one VM of `memMib` guest RAM can make the host hold besides files: guest RAM, QEMU's own
 * overhead and, under TCG, the translation cache. Admission counts exactly this per VM
 * (agent/sandbox/capacity.ts) and the VM's cgroup is limited to exactly this.
 */
export function vmMemoryBytes(memMib: number, tcg: boolean): number {
  return memMib * 1024 * 1024 + vmOverheadBytes(tcg);
}

/** The part of `vmMemoryBytes` that does not depend on the guest's size. */
export function vmOverheadBytes(tcg: boolean): number {
  return QEMU_OVERHEAD_BYTES + (tcg ? TCG_CODE_BUFFER_BYTES : 0);
}

export function vmLimits(memMib: number, vcpus: number, tcg: boolean): CgroupLimits {
  return {
    memoryBytes: vmMemoryBytes(memMib, tcg),
    pids: PIDS_BASE + vcpus,
    cpus: vcpus + MAIN_LOOP_CPUS,
  };
}

/** Which cgroup layout this host has; undefined when neither is usable. */
export function cgroupVersion(root = CGROUP_ROOT): CgroupVersion | undefined {
  if (existsSync(join(root, "cgroup.controllers"))) return 2;
  if (["memory", "pids", "cpu"].every((c) => existsSync(join(root, c, "cgroup.procs")))) return 1;
  return undefined;
}

/**
 * The controllers the jail needs that are missing: for v2 those absent from the root's
 * `cgroup.controllers`; for v1 the hierarchies not mounted.
 */
export function missingControllers(root = CGROUP_ROOT): string[] {
  const need = ["memory", "pids", "cpu"];
  const v = cgroupVersion(root);
  if (v === 2) {
    const have = readFileSync(join(root, "cgroup.controllers"), "utf8").trim().split(/\s+/);
    return need.filter((c) => !have.includes(c));
  }
  return need.filter((c) => !existsSync(join(root, c, "cgroup.procs")));
}

/** The agent's own cgroup path in v1 hierarchy `controller` (from /proc/self/cgroup). */
export function ownV1Path(controller: string, procSelfCgroup: string): string {
  for (const line of procSelfCgroup.split("\n")) {
    const [, ctrls, path] = line.split(":");
    if (ctrls !== undefined && path !== undefined && ctrls.split(",").includes(controller)) return path;
  }
  return "/";
}

/** A cgroup name for the VM directory `dir`: its basename and a hash of the whole path. */
export function cgroupName(dir: string): string {
  const h = createHash("sha256").update(dir).digest("hex").slice(0, 12);
  return `${basename(dir).replace(/[^A-Za-z0-9_.-]/g, "_")}-${h}`;
}

/** The files each backend writes for `limits`, relative to the VM's cgroup directories. */
export function limitFiles(
  version: CgroupVersion,
  l: CgroupLimits,
): { controller: string; file: string; value: string }[] {
  const quota = String(Math.max(1, Math.round(l.cpus * CFS_PERIOD_US)));
  if (version === 2)
    return [
      { controller: "", file: "memory.max", value: String(l.memoryBytes) },
      { controller: "", file: "memory.swap.max", value: "0" },
      { controller: "", file: "pids.max", value: String(l.pids) },
      { controller: "", file: "cpu.max", value: `${quota} ${CFS_PERIOD_US}` },
    ];
  return [
    { controller: "memory", file: "memory.limit_in_bytes", value: String(l.memoryBytes) },
    { controller: "pids", file: "pids.max", value: String(l.pids) },
    { controller: "cpu", file: "cpu.cfs_period_us", value: String(CFS_PERIOD_US) },
    { controller: "cpu", file: "cpu.cfs_quota_us", value: quota },
  ];
}

/** Where VM cgroups are made, one directory per hierarchy (one on v2), and their name prefix. */
function parents(version: CgroupVersion, root: string): string[] {
  if (version === 2) return [join(root, PARENT)];
  let self = "";
  try {
    self = readFileSync("/proc/self/cgroup", "utf8");
  } catch {
    // not Linux: the jail check fails later anyway
  }
  return ["memory", "pids", "cpu"].map((c) =>
    join(root, c, ownV1Path(c, self), c === "memory" ? PARENT : ""),
  );
}

/** The memory cgroup that holds every VM's; undefined when the host has no usable layout. */
export function vmMemoryParent(root = CGROUP_ROOT): string | undefined {
  const version = cgroupVersion(root);
  if (version === undefined) return undefined;
  return parents(version, root)[0];
}

/**
 * Caps the memory of all VMs together at `bytes` (the admission budget): the `sandboxd` parent's
 * `memory.max` (v2) or `memory.limit_in_bytes` (v1), made if missing. `undefined` lifts the cap
 * (a test's teardown). A cap below what the VMs hold now is refused by the kernel (EBUSY): a
 * JailError naming the figure.
 */
export async function limitVmMemory(bytes: number | undefined, root = CGROUP_ROOT): Promise<string> {
  const version = cgroupVersion(root);
  const parent = vmMemoryParent(root);
  if (version === undefined || parent === undefined)
    throw new JailError(`no cgroup v2 or v1 memory hierarchy under ${root}`);
  const file = join(parent, version === 2 ? "memory.max" : "memory.limit_in_bytes");
  const value = bytes === undefined ? (version === 2 ? "max" : "-1") : String(bytes);
  try {
    await mkdir(parent, { recursive: true });
    await writeFile(file, value);
  } catch (err) {
    throw new JailError(`cannot cap the VMs' memory at ${value} in ${file}: ${(err as Error).message}`, err);
  }
  return parent;
}

function prefix(version: CgroupVersion): string {
  return version === 2 ? "" : `${PARENT}-`;
}

export interface VmCgroup {
  version: CgroupVersion;
  /** The VM's cgroup directories (one on v2, one per controller on v1). */
  dirs: string[];
  /** The `cgroup.procs` files the jail writes itself into. */
  procs: string[];
}

/** The VM's cgroup directories, made or not. */
export function vmCgroupDirs(dir: string, root = CGROUP_ROOT): VmCgroup | undefined {
  const version = cgroupVersion(root);
  if (version === undefined) return undefined;
  const dirs = parents(version, root).map((p) => join(p, prefix(version) + cgroupName(dir)));
  return { version, dirs, procs: dirs.map((d) => join(d, "cgroup.procs")) };
}

/** Makes the VM's cgroup with `limits`; throws JailError naming what is missing. */
export async function createVmCgroup(
  dir: string,
  limits: CgroupLimits,
  root = CGROUP_ROOT,
): Promise<VmCgroup> {
  const cg = vmCgroupDirs(dir, root);
  if (!cg) throw new JailError(`no cgroup v2 or v1 memory/pids/cpu hierarchies under ${root}`);
  const missing = missingControllers(root);
  if (missing.length) throw new JailError(`cgroup controllers missing: ${missing.join(", ")}`);
  try {
    if (cg.version === 2) {
      const parent = join(root, PARENT);
      await mkdir(parent, { recursive: true });
      const sub = await readFile(join(parent, "cgroup.subtree_control"), "utf8");
      const want = ["memory", "pids", "cpu"].filter((c) => !sub.split(/\s+/).includes(c));
      if (want.length)
        await writeFile(join(parent, "cgroup.subtree_control"), want.map((c) => `+${c}`).join(" "));
    }
    // recursive: makes v1's memory `sandboxd` parent too when `limitVmMemory` has not run.
    for (const d of cg.dirs) await mkdir(d, { recursive: true });
    for (const f of limitFiles(cg.version, limits)) {
      const d =
        cg.version === 2 ? cg.dirs[0] : cg.dirs.find((x) => x.startsWith(join(root, f.controller, "/")));
      if (d === undefined) continue;
      // memory.swap.max exists only where swap accounting is on.
      if (f.file === "memory.swap.max" && !existsSync(join(d, f.file))) continue;
      await writeFile(join(d, f.file), f.value);
    }
  } catch (err) {
    await removeVmCgroup(dir, root);
    if (err instanceof JailError) throw err;
    throw new JailError(`cgroup setup failed: ${(err as Error).message}`, err);
  }
  return cg;
}

/**
 * Removes the VM's cgroup. Its QEMU must be gone; an exiting task may still be counted for a few
 * milliseconds, so a busy cgroup is retried briefly. Returns whether none is left.
 */
export async function removeVmCgroup(dir: string, root = CGROUP_ROOT): Promise<boolean> {
  const cg = vmCgroupDirs(dir, root);
  if (!cg) return true;
  let ok = true;
  for (const d of cg.dirs) ok = (await rmdirRetry(d)) && ok;
  return ok;
}

async function rmdirRetry(d: string): Promise<boolean> {
  for (let i = 0; i < 100; i++) {
    try {
      await rmdir(d);
      return true;
    } catch (err) {
      const code = (err as NodeJS.ErrnoException).code;
      if (code === "ENOENT") return true;
      if (code !== "EBUSY") return false;
      await Bun.sleep(10);
    }
  }
  return false;
}

/**
 * Removes the VM cgroups no process is in, made more than `minAgeMs` ago (a launch in flight
 * makes its cgroup a moment before its jail joins it): what a crashed agent left behind.
 */
export async function sweepCgroups(root = CGROUP_ROOT, minAgeMs = 60_000): Promise<string[]> {
  const version = cgroupVersion(root);
  if (version === undefined) return [];
  const removed: string[] = [];
  // v1 memory cgroups of VMs an earlier version made directly in the agent's own memory cgroup.
  const legacy = version === 1 ? [dirname(parents(version, root)[0] ?? "")] : [];
  for (const parent of [...parents(version, root), ...legacy]) {
    let names: string[];
    try {
      names = await readdir(parent);
    } catch {
      continue;
    }
    for (const name of names) {
      if (!name.startsWith(prefix(version))) continue;
      const d = join(parent, name);
      try {
        if (!(await stat(d)).isDirectory()) continue;
        if (Date.now() - (await stat(d)).mtimeMs < minAgeMs) continue;
        if ((await readFile(join(d, "cgroup.procs"), "utf8")).trim() !== "") continue;
        await rmdir(d);
        removed.push(d);
      } catch {
        // busy or gone: left for the next sweep
      }
    }
  }
  return removed;
}
