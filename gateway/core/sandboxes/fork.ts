/** Forking a running VM into copy-on-write children, each its own record under the tenant's cap. */
import type { CreatedVm } from "../../../contracts/agent/api.ts";
import { SandboxdError } from "../../../contracts/errors.ts";
import type { Principal } from "../../auth/keys.ts";
import type { Deps } from "../../deps.ts";
import { idleDeadlineMs, noteDeadline } from "../deadlines.ts";
import { type AbsoluteLifetime, type IdleLifetime, markFailed, markStarted, reserve } from "./create.ts";
import { beginActivity, endActivity } from "./exec.ts";
import { agentOf, getOwned, inTermsOf, type Kind, requireAllowed, type SandboxRow } from "./records.ts";

export async function forkVm(
  deps: Deps,
  p: Principal,
  id: string,
  count: number,
  childLabels: (string | undefined)[],
): Promise<{ parent: SandboxRow; children: { id: string; vm: CreatedVm }[] }> {
  const parent = await getOwned(deps, p, id);
  requireAllowed(id, parent.state, "fork");
  const cap = deps.config.limits.forkCapByTier[p.tier];
  if (count > cap) {
    throw new SandboxdError(
      "bad_request",
      `count ${count} is over the per-call fork cap of ${cap} for ${p.tier} keys; call again for more`,
    );
  }
  const items = Array.from({ length: count }, (_, i) => {
    const labels = { ...parent.labels };
    const own = childLabels[i];
    if (own !== undefined) labels.label = own;
    // A child is a copy of its parent: it keeps the parent's idle lifetime, and its absolute
    // lifetime counted from the fork (as a resume counts it again).
    return {
      labels,
      parentId: parent.id,
      idle: { timeoutS: parent.idleTimeoutS, action: parent.idleAction },
      lifetime: { timeoutS: parent.timeoutS, onTimeout: parent.onTimeout },
    };
  });
  const kind = parent.kind;
  // A fork uses the parent like an exec: the reaper leaves it alone until the fork has ended.
  await beginActivity(deps, p, parent, "fork");
  try {
    return await forkMarked(deps, p, parent, kind, count, items);
  } finally {
    await endActivity(deps, parent, false);
  }
}

async function forkMarked(
  deps: Deps,
  p: Principal,
  parent: SandboxRow,
  kind: Kind,
  count: number,
  items: {
    labels: Record<string, string>;
    parentId: string;
    idle: IdleLifetime;
    lifetime: AbsoluteLifetime;
  }[],
): Promise<{ parent: SandboxRow; children: { id: string; vm: CreatedVm }[] }> {
  // Children share the parent's memory: they live on the parent's agent.
  const ids = await reserve(
    deps,
    p,
    kind,
    { pk: parent.templatePk, id: parent.templateId },
    items,
    parent.agentId,
  );
  let vms: CreatedVm[];
  try {
    vms = await inTermsOf(parent, agentOf(deps, parent).fork(parent.vmId!, count));
    if (vms.length !== count) {
      throw new SandboxdError("internal", `agent returned ${vms.length} children for a fork of ${count}`);
    }
  } catch (err) {
    await markFailed(deps, ids);
    throw err;
  }
  const children = ids.map((cid, i) => ({ id: cid, vm: vms[i]! }));
  for (const ch of children) await markStarted(deps, ch.id, p.tenantId, ch.vm, parent.agentId);
  // The children's deadlines: the parent's lifetimes counted from their reservation.
  const now = deps.clock();
  if (parent.timeoutS !== null) noteDeadline(deps, now + parent.timeoutS * 1000);
  noteDeadline(deps, idleDeadlineMs(deps, parent, now));
  return { parent, children };
}
