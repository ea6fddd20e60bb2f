/**
 * The ONE list of engine VM states and the ONE table of allowed transitions of the snapshot
 * engine's VMs (`SandboxVm` in vm.ts). Every engine operation first asks `begin` (vm.ts), which
 * checks here, so a suspend racing a fork on the same VM gets `invalid_state` instead of two
 * migrations on one QEMU.
 *
 * This is the lowest of three state layers, each with its own name: the gateway's `RecordState`
 * (gateway/core/record-states.ts: what the public API reports), the agent's `AgentSandboxState`
 * (agent/sandbox/states.ts: a sandbox's whole life, execs and loss included), and this
 * `EngineVmState`: what one QEMU of the engine is doing right now.
 *
 * | state        | meaning                                                                  |
 * |--------------|--------------------------------------------------------------------------|
 * | starting     | QEMU being launched and its state restored; nobody may use it yet        |
 * | running      | vCPUs running, guest agent connected                                     |
 * | paused       | vCPUs stopped (QMP `stop`)                                               |
 * | forking      | a fork of this VM is in flight                                           |
 * | suspending   | its RAM and device state being saved to a state file                     |
 * | suspended    | only its state file and disk remain: no QEMU                             |
 * | resuming     | a new QEMU is being restored from the state file                         |
 * | restoring    | rolled back in place: its QEMU replaced by one restored from a snapshot  |
 * | dead         | QEMU gone, files released; final                                         |
 */
import { SnapshotError } from "./errors.ts";

export const EngineVmState = [
  "starting",
  "running",
  "paused",
  "forking",
  "suspending",
  "suspended",
  "resuming",
  "restoring",
  "dead",
] as const;
export type EngineVmState = (typeof EngineVmState)[number];

/** Allowed `from -> to` changes. Anything absent is refused. */
export const VM_TRANSITIONS: Readonly<Record<EngineVmState, readonly EngineVmState[]>> = {
  starting: ["running", "dead"],
  running: ["paused", "forking", "suspending", "restoring", "dead"],
  paused: ["running", "suspending", "restoring", "dead"],
  forking: ["running", "dead"],
  // suspending -> running: the save failed and the VM kept running.
  suspending: ["suspended", "running", "dead"],
  suspended: ["resuming", "dead"],
  // resuming -> suspended: the restore failed but the state file is intact.
  resuming: ["running", "suspended", "dead"],
  // restoring -> running: also when it failed before the old QEMU was stopped (nothing lost);
  // -> dead when the new one failed after it (the sandbox then fails, saying so).
  restoring: ["running", "dead"],
  dead: [],
};

export function canVmTransition(from: EngineVmState, to: EngineVmState): boolean {
  return VM_TRANSITIONS[from].includes(to);
}

/**
 * The refusal of `from -> to` for VM `id` as a value (never thrown here), or undefined when it
 * is allowed: `invalid_state` when the table forbids it, or when `from` is not one of the states
 * the operation starts from (`startsFrom`, e.g. a fork only from `running`).
 */
export function checkVmTransition(
  id: string,
  from: EngineVmState,
  to: EngineVmState,
  startsFrom: readonly EngineVmState[] = EngineVmState,
): SnapshotError | undefined {
  if (startsFrom.includes(from) && canVmTransition(from, to)) return undefined;
  return new SnapshotError("invalid_state", `VM ${id} is ${from}; cannot go to ${to}`, {
    details: { state: from, wanted: to },
  });
}
