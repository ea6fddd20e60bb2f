/**
 * Background processes of a sandbox or session (docs/processes-and-pty.md "Background processes"): each call
 * finds the caller's own record (another tenant's id is 404), resumes a sandbox its idle lifetime
 * suspended (`wakeIfIdle`), needs a record an exec could run in (a user-suspended sandbox is 409
 * as for exec), and goes to the sandbox's agent. Each call is counted in flight for as long as it
 * lasts, as a file call is (`beginUse`: the one compare-and-set every use takes), so the idle
 * lifetime counts it as use, and a followed log keeps the sandbox from the idle reaper while it
 * is open. Processes never count as the foreground exec (that is the agent's `busy`): a process
 * call is never `busy`.
 */
import type { AgentVmApi } from "../../contracts/agent/api.ts";
import type { Principal } from "../auth/keys.ts";
import type { Deps } from "../deps.ts";
import { wakeIfIdle } from "./idle.ts";
import { beginUse, inTermsOf } from "./sandboxes.ts";

export async function processCall<T>(
  deps: Deps,
  p: Principal,
  id: string,
  fn: (agent: AgentVmApi, vmId: string) => Promise<T>,
): Promise<T> {
  await wakeIfIdle(deps, p, id);
  const use = await beginUse(deps, p, id);
  try {
    return await inTermsOf(use.row, fn(use.agent, use.row.vmId!));
  } finally {
    await use.end();
  }
}
