import { describe, expect, test } from "bun:test";
import { SandboxdError } from "../../contracts/errors.ts";
import {
  checkRecordAction,
  nextState,
  RECORD_TRANSITIONS,
  type RecordAction,
  RecordState,
} from "./record-states.ts";

const ACTIONS = Object.keys(RECORD_TRANSITIONS) as RecordAction[];

describe("record state table", () => {
  test("exec, fork and connect need running; each changes nothing", () => {
    for (const a of ["exec", "fork", "connect"] as const) {
      for (const s of RecordState)
        expect([a, s, checkRecordAction("sbx_x", s, a).ok]).toEqual([a, s, s === "running"]);
      expect("to" in RECORD_TRANSITIONS[a]).toBe(false);
    }
  });

  test("the lifecycle: running -suspend-> suspended -resume-> running -destroy-> destroyed", () => {
    expect(checkRecordAction("sbx_x", "running", "suspend").ok).toBe(true);
    expect(nextState("suspend")).toBe("suspended");
    expect(checkRecordAction("sbx_x", "suspended", "resume").ok).toBe(true);
    expect(nextState("resume")).toBe("running");
    for (const s of ["starting", "running", "suspended"] as const) {
      expect(checkRecordAction("sbx_x", s, "destroy").ok).toBe(true);
    }
    expect(nextState("destroy")).toBe("destroyed");
  });

  test("a start ends running (started) or destroyed (failed), from starting only", () => {
    for (const a of ["started", "failed"] as const) {
      for (const s of RecordState)
        expect([a, s, checkRecordAction("sbx_x", s, a).ok]).toEqual([a, s, s === "starting"]);
    }
    expect([nextState("started"), nextState("failed")]).toEqual(["running", "destroyed"]);
  });

  test("nothing is allowed on a destroyed record", () => {
    for (const a of ACTIONS) expect(checkRecordAction("sbx_x", "destroyed", a).ok).toBe(false);
  });

  test("a refusal is returned as a 409 conflict naming the record, the state and the action", () => {
    const r = checkRecordAction("sbx_abc", "suspended", "exec");
    if (r.ok) throw new Error("exec on a suspended record was allowed");
    expect(r.error).toBeInstanceOf(SandboxdError);
    expect(r.error.code).toBe("conflict");
    expect(r.error.message).toBe("cannot exec sbx_abc: it is suspended");
    expect(r.error.details).toEqual({ state: "suspended", action: "exec" });
  });
});
