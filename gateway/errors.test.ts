import { expect, test } from "bun:test";
import { SandboxdError } from "../contracts/errors.ts";
import { mapError } from "./errors.ts";

test("an agent that does not answer is a 503 the client may retry, not a 500", () => {
  const m = mapError(new SandboxdError("agent_unavailable", "agent local did not answer within 30000 ms"));
  expect(m.status).toBe(503);
  expect(m.body).toEqual({
    code: "agent_unavailable",
    message: "agent local did not answer within 30000 ms",
  });
});

test("an internal 'unsupported' becomes 501 not_implemented; unknown codes stay a bare 500", () => {
  expect(mapError(new SandboxdError("unsupported", "tunnels are not offered")).status).toBe(501);
  expect(mapError(new SandboxdError("unsupported", "x")).body.code).toBe("not_implemented");
  const hidden = mapError(new SandboxdError("qmp_timeout", "secret internals"));
  expect(hidden).toEqual({ status: 500, body: { code: "internal", message: "internal error" }, headers: {} });
  expect(mapError(new Error("boom")).status).toBe(500);
});
