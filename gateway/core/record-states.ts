/**
 * The allowed state changes of a sandbox/session record (style.md habit 2). A request that the
 * current state does not allow is a clean 409 `conflict`, decided here before the agent is asked.
 *
 *   (none) --create--> starting --started--> running --suspend--> suspended --resume--> running
 *   starting --failed--> destroyed;  starting|running|suspended --destroy--> destroyed
 *   exec and fork need running.
 */
import { SandboxdError } from "../../contracts/errors.ts";

export type SandboxState = "starting" | "running" | "suspended" | "destroyed";
export type SandboxAction = "exec" | "fork" | "suspend" | "resume" | "destroy" | "connect";

const ALLOWED: Readonly<Record<SandboxAction, readonly SandboxState[]>> = {
  exec: ["running"],
  fork: ["running"],
  connect: ["running"],
  suspend: ["running"],
  resume: ["suspended"],
  destroy: ["starting", "running", "suspended"],
};

/** The state after `action` succeeds. */
export const NEXT_STATE: Readonly<Record<SandboxAction, SandboxState | null>> = {
  exec: null,
  fork: null,
  connect: null,
  suspend: "suspended",
  resume: "running",
  destroy: "destroyed",
};

export function checkTransition(id: string, state: SandboxState, action: SandboxAction): void {
  if (ALLOWED[action].includes(state)) return;
  throw new SandboxdError("conflict", `cannot ${action} ${id}: it is ${state}`, {
    details: { state, action },
  });
}
