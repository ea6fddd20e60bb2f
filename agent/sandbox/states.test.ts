import { describe, expect, test } from "bun:test";
import { SandboxdError } from "../../contracts/errors.ts";
import { phaseOf } from "./accounting.ts";
import {
  AgentSandboxState,
  canTransition,
  checkTransition,
  holdsVm,
  isInFlight,
  isTerminal,
  SANDBOX_TRANSITIONS,
  transitionError,
} from "./states.ts";

describe("sandbox state table", () => {
  test("every target in the table is a known state, and no state goes to itself", () => {
    for (const from of AgentSandboxState) {
      for (const to of SANDBOX_TRANSITIONS[from]) {
        expect(AgentSandboxState).toContain(to);
        expect(to).not.toBe(from);
      }
    }
  });

  test("the lifecycle paths of docs/sessions.md#rules-of-the-sessions-api are allowed", () => {
    const paths: AgentSandboxState[][] = [
      ["creating", "running", "busy", "running", "paused", "busy", "running", "destroying", "destroyed"],
      ["creating", "running", "forking", "running", "suspending", "suspended", "resuming", "running"],
      ["running", "paused", "forking", "running"],
      ["running", "paused", "suspending", "suspended", "destroying", "destroyed"],
      ["running", "busy", "failed", "destroying", "destroyed"],
      ["running", "busy", "destroying", "destroyed"],
      ["suspended", "resuming", "suspended"],
      ["lost", "destroying", "destroyed"],
    ];
    for (const p of paths) {
      for (let i = 1; i < p.length; i++)
        expect([p[i - 1], p[i], canTransition(p[i - 1]!, p[i]!)]).toEqual([p[i - 1], p[i], true]);
    }
  });

  test("a second exec or a fork while an exec or fork is in flight is busy, never queued", () => {
    for (const from of ["busy", "forking"] as const) {
      for (const to of ["busy", "forking", "suspending", "paused"] as const) {
        const c = checkTransition("vm-1", from, to);
        expect(c.ok).toBe(false);
        if (!c.ok) {
          expect(c.error).toBeInstanceOf(SandboxdError);
          expect(c.error.code).toBe("busy");
          expect(c.error.details).toEqual({ id: "vm-1", from, to });
        }
      }
    }
  });

  test("terminal states refuse everything but destroy, with `gone`", () => {
    for (const from of ["failed", "lost"] as const) {
      expect(canTransition(from, "destroying")).toBe(true);
      for (const to of ["running", "busy", "forking", "suspending", "resuming"] as const) {
        expect(transitionError("x", from, to).code).toBe("gone");
      }
    }
    expect(SANDBOX_TRANSITIONS.destroyed).toEqual([]);
    expect(transitionError("x", "destroyed", "busy").code).toBe("gone");
    expect(transitionError("x", "destroying", "busy").code).toBe("gone");
  });

  test("other refusals are `conflict`", () => {
    expect(transitionError("x", "suspended", "busy").code).toBe("conflict");
    expect(transitionError("x", "suspended", "forking").code).toBe("conflict");
    expect(transitionError("x", "creating", "busy").code).toBe("conflict");
    expect(transitionError("x", "running", "resuming").code).toBe("conflict");
    expect(transitionError("x", "suspending", "busy").code).toBe("conflict");
  });

  test("the table is exactly what checkTransition enforces", () => {
    for (const from of AgentSandboxState) {
      for (const to of AgentSandboxState) {
        const allowed = SANDBOX_TRANSITIONS[from].includes(to);
        const c = checkTransition("x", from, to);
        expect(c.ok).toBe(allowed);
        if (!c.ok) {
          const want = isInFlight(from) ? "busy" : isTerminal(from) ? "gone" : "conflict";
          expect(c.error.code).toBe(want);
        }
      }
    }
  });

  test("destroy is reachable from every state but destroyed and destroying", () => {
    for (const from of AgentSandboxState) {
      if (from === "destroyed" || from === "destroying") continue;
      expect([from, canTransition(from, "destroying")]).toEqual([from, true]);
    }
  });

  test("metering phases and VM holding agree", () => {
    for (const s of AgentSandboxState) {
      const phase = phaseOf(s);
      if (phase === "running" || phase === "paused") expect(holdsVm(s)).toBe(true);
      if (phase === "suspended") expect(holdsVm(s)).toBe(false);
    }
  });
});
