/**
 * Background processes of a sandbox or session (docs/api.md "Background processes"): each call
 * finds the caller's own record (another tenant's id is 404), resumes a sandbox its idle lifetime
 * suspended (`wakeIfIdle`), needs a record an exec could run in (a user-suspended sandbox is 409
 * as for exec), counts as use for the idle lifetime, and goes to the sandbox's agent. Processes
 * never count as the foreground exec: they are not `execs_in_flight`, so they are never `busy`.
 */
import { eq } from "drizzle-orm";
import type { AgentApi } from "../../contracts/agent/api.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import type { Principal } from "../auth/keys.ts";
import type { Deps } from "../deps.ts";
import { wakeIfIdle } from "./idle.ts";
import { checkRecordAction } from "./record-states.ts";
import { agentOf, getOwned, inTermsOf } from "./sandboxes.ts";

export async function processCall<T>(
  deps: Deps,
  p: Principal,
  id: string,
  fn: (agent: AgentApi, vmId: string) => Promise<T>,
): Promise<T> {
  await wakeIfIdle(deps, p, id);
  const row = await getOwned(deps, p, id);
  const check = checkRecordAction(id, row.state, "exec");
  if (!check.ok) throw check.error;
  await deps.db
    .update(sandboxes)
    .set({ lastExecAt: new Date(deps.clock()) })
    .where(eq(sandboxes.id, id));
  return inTermsOf(row, fn(agentOf(deps, row), row.vmId!));
}
