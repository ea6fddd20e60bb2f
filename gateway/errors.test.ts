import { expect, test } from "bun:test";
import { Hono } from "hono";
import { SandboxdError } from "../contracts/errors.ts";
import { errorResponse, mapError } from "./errors.ts";

test("an agent that does not answer is a 503 the client may retry, not a 500", () => {
  const m = mapError(new SandboxdError("agent_unavailable", "agent local did not answer within 30000 ms"));
  expect(m.status).toBe(503);
  expect(m.body).toEqual({
    code: "agent_unavailable",
    message: `the sandbox's host agent did not answer; retry with backoff (error id ${m.errorId})`,
  });
});

test("a host's words (QEMU stderr, an agent's address) never reach the client; the log has them by id", () => {
  const lines: string[] = [];
  const app = new Hono();
  app.get("/x/:what", (c) => {
    const what = c.req.param("what");
    if (what === "tunnel")
      throw new SandboxdError(
        "agent_unavailable",
        "agent tunnel ws://10.0.0.3:7070/vms/vm-1/tunnel did not open",
      );
    throw new SandboxdError(
      "spawn_failed",
      "restoring VM vm-1 failed: qemu-system-x86_64: -drive file=/var/lib/sandboxd/agent/storage/o.qcow2: Permission denied",
    );
  });
  app.onError((err, c) => errorResponse(err, c, (l) => lines.push(l)));
  return (async () => {
    for (const [what, code, status] of [
      ["tunnel", "agent_unavailable", 503],
      ["spawn", "spawn_failed", 503],
    ] as const) {
      const res = await app.request(`/x/${what}`);
      expect(res.status).toBe(status);
      const body = (await res.json()) as { code: string; message: string };
      expect(body.code).toBe(code);
      expect(body.message).not.toMatch(/10\.0\.0\.3|ws:|\/var|qemu|qcow2/);
      const id = /error id (err-[0-9a-f]{12})/.exec(body.message)?.[1];
      expect(id).toBeDefined();
      expect(lines.find((l) => l.includes(`[${id}]`))).toMatch(/10\.0\.0\.3|Permission denied/);
    }
  })();
});

test("an internal 'unsupported' becomes 501 not_implemented; unknown codes stay a bare 500", () => {
  expect(mapError(new SandboxdError("unsupported", "tunnels are not offered")).status).toBe(501);
  expect(mapError(new SandboxdError("unsupported", "x")).body.code).toBe("not_implemented");
  const hidden = mapError(new SandboxdError("qmp_timeout", "secret internals"));
  expect(hidden).toEqual({ status: 500, body: { code: "internal", message: "internal error" }, headers: {} });
  expect(mapError(new Error("boom")).status).toBe(500);
});
