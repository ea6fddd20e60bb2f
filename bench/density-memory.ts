/**
 * What the density benchmark reads of the host (density.ts): its free memory, the PSS of the
 * service's QEMUs split by whether they run a guest, and the template RAM files on tmpfs.
 */
import { readFileSync } from "node:fs";
import { readdir, stat } from "node:fs/promises";
import { join } from "node:path";
import { defaultShmRoot } from "../agent/snapshot/template.ts";
import { qemuPidsNaming } from "../agent/vm/process.ts";
import { ifExists } from "../contracts/best-effort.ts";
import { qemuMemory } from "./rss.ts";
import { round1 } from "./stats.ts";

/** `MemAvailable` and `MemTotal` of /proc/meminfo, MiB. */
export function hostMemory(): { totalMib: number; availableMib: number } {
  const text = readFileSync("/proc/meminfo", "utf8");
  const kib = (f: string) => Number(new RegExp(`^${f}:\\s+(\\d+)`, "m").exec(text)?.[1] ?? 0);
  return {
    totalMib: Math.round(kib("MemTotal") / 1024),
    availableMib: Math.round(kib("MemAvailable") / 1024),
  };
}

/** KiB as MiB, rounded to 0.1. */
export const mib = (kib: number) => round1(kib / 1024);

/** The RAM file a QEMU maps (its `mem-path=`), from its command line. */
function memPathOf(pid: number): string | undefined {
  try {
    return /mem-path=([^,\0]+)/.exec(readFileSync(`/proc/${pid}/cmdline`, "utf8"))?.[1];
  } catch {
    return undefined;
  }
}

export interface QemuMemorySummary {
  /** QEMU processes of the service: its sandboxes' and the ones pre-launched for the template. */
  qemu_processes: number;
  /** Of those, the ones running a restored guest (their guest RAM has pages): the sandboxes. */
  running_vms: number;
  /** Mean PSS of a running VM's QEMU, MiB: what one more idle sandbox costs the host. */
  pss_per_vm_mib: number;
  /** The same, split: outside guest RAM (QEMU's heap, TCG's code cache) ... */
  qemu_own_per_vm_mib: number;
  /** ... and the guest RAM mapping (its copy-on-write copies plus its share of template pages). */
  guest_ram_per_vm_mib: number;
  /** Mean PSS of a pre-launched QEMU (no guest restored yet), MiB; 0 when there is none. */
  pss_per_prelaunched_mib: number;
  /** PSS of all the service's QEMUs together, MiB. */
  pss_total_mib: number;
}

/** PSS of the QEMUs of `dataDir`, split by whether they run a guest. */
export async function measureQemus(dataDir: string): Promise<QemuMemorySummary> {
  const mems: Awaited<ReturnType<typeof qemuMemory>>[] = [];
  for (const pid of await qemuPidsNaming([dataDir])) {
    const path = memPathOf(pid);
    if (!path) continue;
    // A QEMU that exited between the listing and the read has no memory left to count.
    const m = await qemuMemory(pid, path).catch(() => undefined);
    if (m) mems.push(m);
  }
  const running = mems.filter((m) => m.guestRam.rss > 0);
  const pooled = mems.filter((m) => m.guestRam.rss === 0);
  const avg = (xs: typeof mems, f: (m: (typeof mems)[number]) => number) =>
    xs.length === 0 ? 0 : mib(xs.reduce((s, m) => s + f(m), 0) / xs.length);
  return {
    qemu_processes: mems.length,
    running_vms: running.length,
    pss_per_vm_mib: avg(running, (m) => m.total.pss),
    qemu_own_per_vm_mib: avg(running, (m) => m.total.pss - m.guestRam.pss),
    guest_ram_per_vm_mib: avg(running, (m) => m.guestRam.pss),
    pss_per_prelaunched_mib: avg(pooled, (m) => m.total.pss),
    pss_total_mib: mib(mems.reduce((s, m) => s + m.total.pss, 0)),
  };
}

/** KiB allocated by the template RAM files (`tpl-*.mem`) of the service's shm root. */
export async function templateRamKib(dataDir: string): Promise<number> {
  const root = defaultShmRoot(join(dataDir, "agent"));
  let kib = 0;
  for (const name of (await ifExists(readdir(root))) ?? [])
    if (name.startsWith("tpl-")) kib += ((await ifExists(stat(join(root, name))))?.blocks ?? 0) / 2;
  return kib;
}
