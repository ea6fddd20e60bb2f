/**
 * `PUT /v1/sandboxes/{id}/egress` (docs/egress.md "Changing a sandbox's egress"): a new allow-list
 * for the caller's own sandbox (another tenant's id is 404, as everywhere), checked here with the
 * create's rules before the agent is asked, then set by the agent that holds it. The allow-list
 * lives in that agent's record of the VM (agent/sandbox/records.ts), the one place the proxy
 * reads it and forks, resumes and agent restarts take it from; the gateway's row does not hold
 * it, so there is no second copy to keep in step.
 */
import type { z } from "zod";
import type { SetEgressResponse } from "../../contracts/api/sandboxes-api.ts";
import { parseAllowList } from "../../contracts/egress.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import type { Principal } from "../auth/keys.ts";
import type { Deps } from "../deps.ts";
import { agentOf, getOwned, inTermsOf } from "./sandboxes.ts";

export async function setSandboxEgress(
  deps: Deps,
  p: Principal,
  id: string,
  allow: string[],
): Promise<z.infer<typeof SetEgressResponse>> {
  const row = await getOwned(deps, p, id);
  // A malformed entry is a 400 here, as at create: a typo must not silently allow nothing.
  parseAllowList(allow);
  // Running or suspended (a suspended sandbox's agent keeps the list for its resume); one still
  // starting has no VM to set it on yet.
  if ((row.state !== "running" && row.state !== "suspended") || row.vmId === null) {
    throw new SandboxdError("conflict", `cannot change the egress of ${id}: it is ${row.state}`, {
      details: { state: row.state },
    });
  }
  const set = await inTermsOf(row, agentOf(deps, row).setEgress(row.vmId, allow));
  return { id: row.id, egress: { allow: set.egressAllow } };
}
