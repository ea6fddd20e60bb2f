/**
 * How a fork copies its running parent's memory (fork.ts), chosen by the operator
 * (`SANDBOXD_FORK_METHOD`, cli/settings.ts) once per agent:
 *
 * - `snapshot` (default): a QEMU background snapshot. The guest is stopped only while QEMU saves
 *   the device state and write-protects the RAM with userfaultfd (~10-40 ms under TCG); then the
 *   guest runs while QEMU streams the RAM as it was at the stop, copying a page out first when
 *   the guest writes it. Correct by construction like stop-and-copy: the state is one instant's,
 *   no dirty tracking is involved.
 * - `stop-copy`: the guest is stopped for the whole copy (~70-210 ms for 256 MiB under TCG,
 *   growing with the RAM). Needs nothing from the host kernel.
 * - `precopy`: a live precopy with dirty tracking; the shortest stall, but under TCG about one
 *   child in ten started with corrupted memory on a loaded host (a guest write the dirty tracking
 *   missed; the cause was not found). Kept for KVM hosts, where the kernel tracks dirty pages.
 *
 * A background snapshot needs userfaultfd in QEMU, which runs jailed as an unprivileged uid:
 * the kernel gives unprivileged processes userfaultfd only with `vm.unprivileged_userfaultfd=1`
 * (QEMU 7.2 does not use /dev/userfaultfd). The agent sets it at start (it runs as root); where it
 * cannot, or where QEMU refuses the capability (a kernel without write-protect support), forks
 * fall back to stop-and-copy and say so in the log. The trade-off (any host process may then use
 * userfaultfd) is written down in docs/snapshots-and-forks.md "Fork by background snapshot".
 */
import { readFile, writeFile } from "node:fs/promises";

export const FORK_METHODS = ["snapshot", "stop-copy", "precopy"] as const;
export type ForkMethod = (typeof FORK_METHODS)[number];
export const DEFAULT_FORK_METHOD: ForkMethod = "snapshot";

export function isForkMethod(v: unknown): v is ForkMethod {
  return typeof v === "string" && (FORK_METHODS as readonly string[]).includes(v);
}

const UNPRIVILEGED_USERFAULTFD = "/proc/sys/vm/unprivileged_userfaultfd";

/**
 * The method forks will use: `wanted`, once what it needs from the host is in place, or
 * `stop-copy` with the reason when it cannot be. `sysctlPath` is for tests.
 */
export async function readyForkMethod(
  wanted: ForkMethod,
  log: (m: string) => void = () => {},
  sysctlPath = UNPRIVILEGED_USERFAULTFD,
): Promise<ForkMethod> {
  if (wanted !== "snapshot") return wanted;
  try {
    if ((await readFile(sysctlPath, "utf8")).trim() !== "1") await writeFile(sysctlPath, "1\n");
    return "snapshot";
  } catch (err) {
    log(
      `fork: background snapshots need ${sysctlPath}=1 and it could not be set (${String(err)}); forks stop their parent for the whole copy instead`,
    );
    return "stop-copy";
  }
}
