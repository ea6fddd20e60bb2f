/** Suspend, resume and destroy of a live record: each under its state check, and a quota hold where the cap changes. */
import type { AgentVmApi } from "../../../contracts/agent/api.ts";
import { bestEffort } from "../../../contracts/best-effort.ts";
import type { sandboxes } from "../../../db/schema/sandboxes.ts";
import type { Principal } from "../../auth/keys.ts";
import type { Deps } from "../../deps.ts";
import { logOf } from "../../deps.ts";
import { idleDeadlineMs, noteDeadline } from "../deadlines.ts";
import { holdForQuota, type QuotaHold, releaseHold } from "./quota.ts";
import {
  agentOf,
  getOwned,
  inTermsOf,
  requireAllowed,
  running,
  type SandboxRow,
  type switchInterval,
} from "./records.ts";
import { applyTransition } from "./transitions.ts";

export async function suspendVm(deps: Deps, p: Principal, id: string): Promise<{ memBytes: number }> {
  // Suspended sandboxes keep a RAM image on the host's disk: their own quota bounds them.
  const quota = { cap: deps.config.limits.suspendedQuotaByTier[p.tier], what: "suspended sandboxes" };
  return changeUnderHold(deps, p, id, "suspend", quota, async (agent, vmId) => {
    const r = await agent.suspend(vmId);
    const interval = { state: "suspended" as const, vcpus: 0, memMib: 0, diskBytes: r.snapshotBytes };
    // The user's suspend: calls stay refused until a resume (only the reaper's wakes itself).
    return { result: { memBytes: r.memBytes }, set: { suspendedBy: "user" as const }, interval };
  });
}

export async function resumeVm(deps: Deps, p: Principal, id: string): Promise<{ memBytes: number }> {
  // Resuming makes the sandbox count against the running quota again.
  const quota = { cap: deps.config.limits.sandboxQuotaByTier[p.tier], what: "running sandboxes" };
  return changeUnderHold(deps, p, id, "resume", quota, async (agent, vmId, row) => {
    const r = await agent.resume(vmId);
    const { vcpus, memMib, diskBytes } = r.resources;
    // A resume of a sandbox with an idle lifetime counts as activity: it gets a whole timeout
    // before the reaper may suspend it again (else the call that woke it could lose it at once).
    const now = deps.clock();
    const touched = row.idleTimeoutS !== null ? { lastExecAt: new Date(now) } : {};
    // A resume starts the absolute lifetime again (`timeout_s` from now): one suspended at its
    // deadline would otherwise be past it the moment it runs.
    const expires = row.timeoutS !== null ? { expiresAt: new Date(now + row.timeoutS * 1000) } : {};
    noteDeadline(deps, expires.expiresAt?.getTime());
    noteDeadline(deps, idleDeadlineMs(deps, row, now));
    return {
      result: { memBytes: r.memBytes },
      set: { vcpus, memMib, diskBytes, suspendedBy: null, ...touched, ...expires },
      interval: running(r.resources),
    };
  });
}

/**
 * A suspend or resume: the record must allow it, the quota of the state it leads to must have
 * room (`holdForQuota` reserves it), then the agent is asked and the change recorded, clearing
 * the hold; any failure releases it.
 */
async function changeUnderHold<T>(
  deps: Deps,
  p: Principal,
  id: string,
  action: QuotaHold,
  quota: { cap: number; what: string },
  call: (
    agent: AgentVmApi,
    vmId: string,
    row: SandboxRow,
  ) => Promise<{
    result: T;
    set: Partial<typeof sandboxes.$inferInsert>;
    interval: Parameters<typeof switchInterval>[2];
  }>,
): Promise<T> {
  const row = await getOwned(deps, p, id);
  requireAllowed(id, row.state, action);
  await holdForQuota(deps, p, row, action, quota);
  try {
    const done = await inTermsOf(row, call(agentOf(deps, row), row.vmId!, row));
    await applyTransition(deps, row, action, { ...done.set, hold: null, holdUntil: null }, done.interval);
    return done.result;
  } catch (err) {
    await bestEffort(logOf(deps), `releasing the ${action} hold of ${id}`, releaseHold(deps, id, action));
    throw err;
  }
}

export async function destroyVm(
  deps: Deps,
  row: SandboxRow,
  opts: { force: boolean; reason: "deleted" | "reaped" },
): Promise<void> {
  requireAllowed(row.id, row.state, "destroy");
  if (row.vmId !== null) await inTermsOf(row, agentOf(deps, row).destroy(row.vmId, { force: opts.force }));
  await applyTransition(
    deps,
    row,
    "destroy",
    // Its deadline goes with it: the timer's index walk skips no ended rows.
    { endReason: opts.reason, destroyedAt: new Date(deps.clock()), expiresAt: null },
    null,
  );
  // Its connect tokens are refused from now on (the record is destroyed); relays already open on
  // it end too, with 1001 going away (gateway/relay/).
  deps.relays?.closeSandbox(row.id, 1001, `sandbox ${opts.reason}`);
}
