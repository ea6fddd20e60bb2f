/**
 * Sessions (sessions API) and sandboxes (sandboxes API) without HTTP: the gateway records where each VM
 * runs, its state and its metering; the agent runs it. Every state change goes through
 * record-states.ts and updates the db only with a compare-and-set on the old state, so two racing
 * requests cannot both apply. One module per concern, under sandboxes/:
 *
 * - records.ts: the record of a tenant's own sandbox, its state check, its agent, its usage intervals
 * - create.ts: creating sandboxes and sessions, and one-shot execs, under the tenant's cap
 * - exec.ts: execs and other calls on a live VM, and the activity they leave on the record
 * - fork.ts: forking a running VM into children
 * - transitions.ts: a record's compare-and-set state change
 * - quota.ts: what counts against the caps, and the quota holds of suspend and resume
 * - lifecycle.ts: suspend, resume, destroy
 * - reaping.ts: idle lifetimes, relayed activity, execs that never ended
 */

export {
  type CreateInput,
  createVm,
  execOneShots,
  type IdleLifetime,
  type OneShotOutcome,
  publicEndpoints,
} from "./sandboxes/create.ts";
export { beginUse, beginUseOf, execIn } from "./sandboxes/exec.ts";
export { forkVm } from "./sandboxes/fork.ts";
export { destroyVm, resumeVm, suspendVm } from "./sandboxes/lifecycle.ts";
export { countInStates, HOLD_TTL_MS } from "./sandboxes/quota.ts";
export { endStaleExecs, idleClaimable, reapIdleSessions, touchRelayed } from "./sandboxes/reaping.ts";
export {
  agentOf,
  ages,
  getOwned,
  inTermsOf,
  type KeyApi,
  type ListFilter,
  listOwnedPage,
  requireAllowed,
  type SandboxRow,
  switchInterval,
  type Tier,
} from "./sandboxes/records.ts";
export { applyTransition } from "./sandboxes/transitions.ts";
