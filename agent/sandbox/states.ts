/**
 * The ONE list of the agent's sandbox states and the ONE table of allowed transitions (after
 * Cloud Hypervisor's `vm.rs` `valid_transition`). Every state change in the manager goes through
 * `checkTransition`, so a suspend racing a fork becomes a clean 409, never a VM in two operations.
 *
 * This is the middle of three state layers, each with its own name: the gateway's `RecordState`
 * (gateway/core/record-states.ts: what the public API reports), this one (what a VM on this host is doing), and the snapshot
 * engine's VM state (`EngineVmState`, agent/snapshot/states.ts: one QEMU process and its files).
 *
 * | state        | meaning                                                                    |
 * |--------------|----------------------------------------------------------------------------|
 * | creating     | the VM is being spawned; no caller may use it yet                          |
 * | running      | vCPUs running, nothing in flight (the idle-pause timer is armed)           |
 * | paused       | idle: vCPUs stopped (QMP `stop`), resumed transparently by the next call   |
 * | busy         | one exec in flight (docs/sessions.md "Rules of the sessions API": execs are serialized per sandbox)            |
 * | forking      | a fork of this sandbox is in flight (also excludes exec: docs/sessions.md "Rules of the sessions API")          |
 * | suspending   | memory being snapshotted to disk                                           |
 * | suspended    | on disk only: no QEMU, no metering of CPU/RAM                              |
 * | resuming     | being restored from disk                                                   |
 * | restoring    | rolled back in place to a kept snapshot (a new QEMU, the same sandbox)     |
 * | destroying   | being torn down (a normal destroy waits here for the in-flight exec)      |
 * | destroyed    | gone; the record is removed                                                |
 * | failed       | the VM died or an operation broke it; `reason` says why. Only destroy.     |
 * | lost         | after an agent restart the VM could not be re-adopted; only destroy.       |
 */
import { SandboxdError } from "../../contracts/errors.ts";

export const AgentSandboxState = [
  "creating",
  "running",
  "paused",
  "busy",
  "forking",
  "suspending",
  "suspended",
  "resuming",
  "restoring",
  "destroying",
  "destroyed",
  "failed",
  "lost",
] as const;
export type AgentSandboxState = (typeof AgentSandboxState)[number];

/** Allowed `from -> to` changes. Anything absent is refused by `checkTransition`. */
export const SANDBOX_TRANSITIONS: Readonly<Record<AgentSandboxState, readonly AgentSandboxState[]>> = {
  creating: ["running", "failed", "destroying"],
  // running -> paused is the idle pause; -> busy/forking start an exec/fork.
  running: ["paused", "busy", "forking", "suspending", "restoring", "destroying", "failed"],
  // paused -> busy/forking/suspending: the manager un-pauses the vCPUs as the first step of
  // the operation; paused -> running when it wakes for something else (e.g. adoption).
  paused: ["running", "busy", "forking", "suspending", "restoring", "destroying", "failed"],
  // busy -> destroying: a normal destroy waits for the exec in this state; a force destroy
  // aborts it (docs/sessions.md "Rules of the sessions API" "Delete session").
  busy: ["running", "destroying", "failed"],
  forking: ["running", "destroying", "failed"],
  // suspending -> running: the snapshot failed and the VM kept running.
  suspending: ["suspended", "running", "destroying", "failed"],
  suspended: ["resuming", "destroying"],
  // resuming -> suspended: the restore failed but the snapshot is intact.
  resuming: ["running", "suspended", "destroying", "failed"],
  // restoring -> running: rolled back, or refused before its QEMU stopped (nothing changed);
  // -> failed: the new QEMU did not come up after the old one stopped.
  restoring: ["running", "destroying", "failed"],
  destroying: ["destroyed", "failed"],
  destroyed: [],
  failed: ["destroying"],
  lost: ["destroying"],
};

/** States in which an exec or a fork is in flight: a second one gets `busy` (docs/sessions.md "Rules of the sessions API"; docs/api.md "Rules every route shares"). */
const IN_FLIGHT: ReadonlySet<AgentSandboxState> = new Set(["busy", "forking", "restoring"]);
/** States from which the sandbox is no longer usable; only destroy is accepted. */
const TERMINAL: ReadonlySet<AgentSandboxState> = new Set(["destroying", "destroyed", "failed", "lost"]);
/** States whose VM has a QEMU (for capacity and metering); suspended/terminal ones do not. */
const HAS_VM: ReadonlySet<AgentSandboxState> = new Set([
  "creating",
  "running",
  "paused",
  "busy",
  "forking",
  "suspending",
  "resuming",
  "restoring",
  "destroying",
]);

export function canTransition(from: AgentSandboxState, to: AgentSandboxState): boolean {
  return SANDBOX_TRANSITIONS[from].includes(to);
}

export function isInFlight(s: AgentSandboxState): boolean {
  return IN_FLIGHT.has(s);
}

export function isTerminal(s: AgentSandboxState): boolean {
  return TERMINAL.has(s);
}

export function holdsVm(s: AgentSandboxState): boolean {
  return HAS_VM.has(s);
}

/**
 * The error for a refused change, as a value (the caller throws it):
 * - `busy` (409) when an exec or fork is in flight: the API's code for exactly that case;
 * - `gone` (410) when the sandbox is being destroyed, destroyed, failed or lost: the VM is not
 *   coming back, which the gateway reports as sessions API's 410 (docs/api.md "Rules every route shares");
 * - `conflict` (409) for every other state that does not allow the action.
 */
export function transitionError(id: string, from: AgentSandboxState, to: AgentSandboxState): SandboxdError {
  const details = { id, from, to };
  if (isInFlight(from)) {
    const what = from === "busy" ? "an exec" : from === "restoring" ? "a restore" : "a fork";
    return new SandboxdError("busy", `sandbox ${id}: ${what} is in flight`, { details });
  }
  if (isTerminal(from)) {
    return new SandboxdError("gone", `sandbox ${id} is ${from}`, { details });
  }
  return new SandboxdError("conflict", `sandbox ${id} is ${from}; cannot go to ${to}`, { details });
}

export type TransitionCheck = { ok: true } | { ok: false; error: SandboxdError };

/** Checks one change against the table; the error is a value, never thrown here. */
export function checkTransition(id: string, from: AgentSandboxState, to: AgentSandboxState): TransitionCheck {
  return canTransition(from, to) ? { ok: true } : { ok: false, error: transitionError(id, from, to) };
}
