/**
 * The states of a sandbox/session RECORD (the gateway's `sandboxes` row) and the ONE table of what
 * each action needs. The record says what the gateway has decided and recorded; the VM's own,
 * finer states (paused, busy, forking, ...) are the agent's `AgentSandboxState`
 * (agent/sandbox/states.ts), and one QEMU's are the engine's `EngineVmState` (agent/snapshot/states.ts). A request
 * that the record's state does not allow is a clean 409 `conflict`, decided here before the agent
 * is asked.
 *
 * | state     | meaning                                                                   |
 * |-----------|---------------------------------------------------------------------------|
 * | starting  | reserved against the tenant's quota; the agent is creating the VM         |
 * | running   | the VM runs on the agent named by the record                              |
 * | suspended | the VM is on disk only (sandboxes API suspend)                                 |
 * | destroyed | gone (deleted, reaped or failed: `end_reason`); the row is kept for 410s  |
 *
 *   (none) --create--> starting --started--> running --suspend--> suspended --resume--> running
 *   starting --failed--> destroyed;  starting|running|suspended --destroy--> destroyed
 *   starting|running|suspended --lost--> destroyed (its agent went silent past the lost bound:
 *   end_reason `host_lost`, gateway/core/host-loss.ts)
 *   exec, fork and connect need running.
 *
 * Every write of a row's state takes its action's entry (`recordChange`): the new state and,
 * as the UPDATE's condition, the states it may come from.
 *
 * A suspend or resume in flight does not change the state until the agent has answered; it holds
 * the record meanwhile (`hold`, sandboxes.ts: it counts toward the quota of the state it goes
 * to, and a second suspend or resume of it is refused).
 */
import { inArray, type SQL } from "drizzle-orm";
import { SandboxdError } from "../../contracts/errors.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";

export const RecordState = [
  "starting",
  "running",
  "suspended",
  "destroyed",
] as const satisfies readonly (typeof sandboxes.$inferSelect)["state"][];
export type RecordState = (typeof RecordState)[number];

export type RecordAction =
  | "exec"
  | "fork"
  | "suspend"
  | "resume"
  | "destroy"
  | "connect"
  | "started"
  | "failed"
  | "lost";

/** Per action: the states it may start from, and the state it leads to when it changes one. */
export const RECORD_TRANSITIONS = {
  exec: { from: ["running"] },
  fork: { from: ["running"] },
  connect: { from: ["running"] },
  suspend: { from: ["running"], to: "suspended" },
  resume: { from: ["suspended"], to: "running" },
  destroy: { from: ["starting", "running", "suspended"], to: "destroyed" },
  /** The agent made the VM (a create, a fork child). */
  started: { from: ["starting"], to: "running" },
  /** The VM was never made, or its call was lost (a one-shot exec whose gateway died). */
  failed: { from: ["starting"], to: "destroyed" },
  /**
   * Its agent is lost (silent past the lost bound): whatever the row said, nothing of it can be
   * reached or proven to run any more. The agent, if it comes back, destroys the VM.
   */
  lost: { from: ["starting", "running", "suspended"], to: "destroyed" },
} as const satisfies Record<RecordAction, { from: readonly RecordState[]; to?: RecordState }>;

/** The actions that change the record's state. */
export type RecordChange = "suspend" | "resume" | "destroy" | "started" | "failed" | "lost";

export function nextState(action: RecordChange): RecordState {
  return RECORD_TRANSITIONS[action].to;
}

/**
 * A state change as an UPDATE writes it: `state` for its SET and `from` for its WHERE (the row is
 * in a state the action may start from), so a row another writer moved meanwhile is left alone.
 */
export function recordChange(action: RecordChange): { state: RecordState; from: SQL } {
  return { state: nextState(action), from: inArray(sandboxes.state, [...RECORD_TRANSITIONS[action].from]) };
}

export type RecordCheck = { ok: true } | { ok: false; error: SandboxdError };

/** Checks one action against the table; the refusal is a value (`conflict`), never thrown here. */
export function checkRecordAction(id: string, state: RecordState, action: RecordAction): RecordCheck {
  const from: readonly RecordState[] = RECORD_TRANSITIONS[action].from;
  if (from.includes(state)) return { ok: true };
  return {
    ok: false,
    error: new SandboxdError("conflict", `cannot ${action} ${id}: it is ${state}`, {
      details: { state, action },
    }),
  };
}
