/**
 * What the host kernel says about one QEMU process: its CPU time and its memory, read from
 * `/proc/<pid>/stat` and `/proc/<pid>/status`. These are the host's own figures about the process
 * that emulates the guest, so nothing the guest says or does can make them lie (a guest can only
 * use more or less of them); a sandbox's live metrics are built on them alone
 * (agent/sandbox/live-metrics.ts, docs/metrics.md).
 */
import { readFile } from "node:fs/promises";

/**
 * Clock ticks per second of `/proc/<pid>/stat`'s utime and stime: USER_HZ, which the kernel fixes
 * at 100 in its user ABI on x86-64 and arm64 whatever its internal HZ (sysconf(_SC_CLK_TCK)
 * answers 100 there), so it is a constant rather than a `getconf` call.
 */
export const USER_HZ = 100;

export interface ProcStats {
  /** utime + stime of every thread of the process (vCPUs, I/O thread), ms. */
  cpuMs: number;
  /** VmRSS: every page of the process in RAM, shared file pages included. */
  residentBytes: number;
  /**
   * RssAnon: the process's private memory: the guest pages it wrote (copied on write from the
   * template's or fork point's RAM file it maps), QEMU's heap and TCG's code buffer.
   */
  anonBytes: number;
}

/**
 * The stats of `pid`, or undefined when it is gone or is not a QEMU (its command name, which the
 * kernel keeps and the guest cannot touch, does not start with `qemu-system`): a pid the kernel
 * handed to another process after QEMU ended is never measured.
 */
export async function readProcStats(pid: number): Promise<ProcStats | undefined> {
  let stat: string;
  let status: string;
  try {
    [stat, status] = await Promise.all([
      readFile(`/proc/${pid}/stat`, "utf8"),
      readFile(`/proc/${pid}/status`, "utf8"),
    ]);
  } catch {
    return undefined; // gone
  }
  return parseProcStats(stat, status);
}

/** `/proc/<pid>/stat` and `/proc/<pid>/status` as text, parsed; undefined when not a QEMU's. */
export function parseProcStats(stat: string, status: string): ProcStats | undefined {
  // The command name is in parentheses and may hold spaces and ')': the fields follow the last ')'.
  const open = stat.indexOf("(");
  const close = stat.lastIndexOf(")");
  if (open < 0 || close < open) return undefined;
  if (!stat.slice(open + 1, close).startsWith("qemu-system")) return undefined;
  // After ")": field 3 (state) is index 0, so utime (field 14) is index 11 and stime index 12.
  const f = stat
    .slice(close + 2)
    .trim()
    .split(" ");
  const utime = Number(f[11]);
  const stime = Number(f[12]);
  if (!Number.isFinite(utime) || !Number.isFinite(stime)) return undefined;
  const kb = (name: string): number => {
    const m = new RegExp(`^${name}:\\s+(\\d+) kB$`, "m").exec(status);
    return m ? Number(m[1]) * 1024 : 0;
  };
  return {
    cpuMs: ((utime + stime) * 1000) / USER_HZ,
    residentBytes: kb("VmRSS"),
    anonBytes: kb("RssAnon"),
  };
}
