import { describe, expect, test } from "bun:test";
import { SnapshotError } from "./errors.ts";
import { canVmTransition, checkVmTransition, EngineVmState, VM_TRANSITIONS } from "./states.ts";

describe("engine VM state table", () => {
  test("every target is a known state, no state goes to itself, dead is final", () => {
    for (const from of EngineVmState) {
      for (const to of VM_TRANSITIONS[from]) {
        expect(EngineVmState).toContain(to);
        expect(to).not.toBe(from);
      }
      if (from !== "dead") expect(canVmTransition(from, "dead")).toBe(true);
    }
    expect(VM_TRANSITIONS.dead).toEqual([]);
  });

  test("the engine's operations are paths through the table", () => {
    const paths: EngineVmState[][] = [
      ["starting", "running", "paused", "running", "forking", "running"], // spawn, pause, fork
      ["running", "suspending", "suspended", "resuming", "running"], // suspend + resume
      ["running", "suspending", "running"], // a failed save keeps the VM running
      ["suspended", "resuming", "suspended"], // a failed restore keeps the state file
      ["paused", "suspending", "suspended", "dead"],
    ];
    for (const p of paths)
      for (let i = 1; i < p.length; i++)
        expect([p[i - 1], p[i], canVmTransition(p[i - 1]!, p[i]!)]).toEqual([p[i - 1], p[i], true]);
  });

  test("a refusal is an invalid_state value naming the state, never a throw", () => {
    expect(checkVmTransition("vm-1", "running", "forking", ["running"])).toBeUndefined();
    // The table forbids it.
    const e = checkVmTransition("vm-1", "suspended", "forking");
    expect(e).toBeInstanceOf(SnapshotError);
    expect(e?.code).toBe("invalid_state");
    expect(e?.message).toBe("VM vm-1 is suspended; cannot go to forking");
    expect(e?.details).toEqual({ state: "suspended", wanted: "forking" });
    // The table allows paused -> suspending, but this operation starts only from running.
    expect(checkVmTransition("vm-1", "paused", "suspending", ["running"])?.code).toBe("invalid_state");
    // A suspend racing a fork.
    expect(checkVmTransition("vm-1", "forking", "suspending", ["running", "paused"])?.code).toBe(
      "invalid_state",
    );
  });
});
