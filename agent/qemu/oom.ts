/**
 * Who the kernel's OOM killer picks when the host runs out of memory: a QEMU, never the agent.
 * The kernel scores each process by its share of memory (0-1000) plus its `oom_score_adj`
 * (-1000..1000) and kills the highest.
 *
 * - The agent: -900. Its own share (a few hundred MiB of many GiB) minus 900 leaves it below any
 *   other process, so it is picked only when nothing else is left; not -1000, which exempts it
 *   outright: a leaking agent would then hang the host instead of being killed and restarted.
 * - Each QEMU: +500 (jail.ts writes it before QEMU is exec'd): every VM ranks ahead of the host's
 *   own processes (sshd, the gateway, a database) of the same size, while a host process that has
 *   taken half the host more than a VM still ranks ahead of it. A QEMU inherits the agent's -900
 *   without this.
 *
 * Most OOMs never reach this: each VM's cgroup and their common parent (cgroup.ts) are limited to
 * what admission counts, so the kernel picks within them first.
 */
import { readFile, writeFile } from "node:fs/promises";
import { SandboxdError } from "../../contracts/errors.ts";

export const AGENT_OOM_SCORE_ADJ = -900;
export const QEMU_OOM_SCORE_ADJ = 500;

/**
 * Sets this process's `oom_score_adj` to AGENT_OOM_SCORE_ADJ and returns the value in force.
 * Lowering it needs CAP_SYS_RESOURCE, which a container's root may lack: then the value stays
 * (the QEMUs' +500 still ranks them first) and `refused` says why, for the caller's log; the
 * agent does not refuse to start over a preference.
 */
export async function protectAgentFromOom(
  path = "/proc/self/oom_score_adj",
): Promise<{ adj: number; refused?: string }> {
  let refused: string | undefined;
  try {
    await writeFile(path, String(AGENT_OOM_SCORE_ADJ));
  } catch (err) {
    refused = `cannot lower the agent's oom_score_adj to ${AGENT_OOM_SCORE_ADJ} (it needs CAP_SYS_RESOURCE): ${(err as Error).message}`;
  }
  try {
    const adj = Number((await readFile(path, "utf8")).trim());
    return refused === undefined ? { adj } : { adj, refused };
  } catch (err) {
    throw new SandboxdError("internal", `cannot read the agent's oom_score_adj: ${(err as Error).message}`, {
      cause: err,
    });
  }
}
