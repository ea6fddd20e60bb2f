/**
 * `Retry-After` passes from an agent to the client: the agent's refusal (its capacity check's
 * real `at_capacity`, sent by the agent's own error mapping) crosses real HTTP to the gateway's
 * agent client, which keeps the header, and the gateway's error mapping sends it on. The server
 * here answers every call the way agent/api/app.ts answers a failed one.
 */
import { afterAll, expect, test } from "bun:test";
import { mapAgentError } from "../../agent/api/errors.ts";
import { Capacity } from "../../agent/sandbox/capacity.ts";
import { AgentHttpClient } from "../../gateway/agents/client.ts";
import { mapError } from "../../gateway/errors.ts";

const full = new Capacity({ slots: 1, vcpus: 1, memMib: 256 }, () => ({ count: 1, vcpus: 1, memMib: 256 }));
let refusal: unknown;
try {
  full.admit({ vcpus: 1, memMib: 256 }, 1);
} catch (err) {
  refusal = err;
}

const server = Bun.serve({
  port: 0,
  hostname: "127.0.0.1",
  fetch: () => {
    const { status, body, headers } = mapAgentError(refusal);
    return Response.json(body, { status, headers });
  },
});
afterAll(() => server.stop(true));

test("an agent's at_capacity keeps its Retry-After through the gateway", async () => {
  const direct = await fetch(`http://127.0.0.1:${server.port}/`);
  expect(direct.status).toBe(503);
  const agentRetry = direct.headers.get("retry-after");
  expect(agentRetry).toMatch(/^[1-9]\d*$/);

  const client = new AgentHttpClient({
    baseUrl: `http://127.0.0.1:${server.port}`,
    agentId: "a1",
    key: "k".repeat(32),
  });
  const err = await client.createSandbox("tpl", { kind: "sandbox" }).catch((e: unknown) => e);
  const mapped = mapError(err);
  expect(mapped.status).toBe(503);
  expect(mapped.body.code).toBe("at_capacity");
  expect(mapped.headers["Retry-After"]).toBe(agentRetry!);
});

test("an error without Retry-After gets none, and a malformed one is dropped", async () => {
  const { headers } = mapAgentError(new Error("boom"));
  expect(headers).toEqual({});
  const { errorFromAgentAnswer } = await import("../../contracts/agent/schemas.ts");
  const body = JSON.stringify({ code: "at_capacity", message: "full" });
  expect(mapError(errorFromAgentAnswer(503, body, "x", "soon")).headers).toEqual({});
  expect(mapError(errorFromAgentAnswer(503, body, "x", null)).headers).toEqual({});
  expect(mapError(errorFromAgentAnswer(503, body, "x", "12")).headers).toEqual({ "Retry-After": "12" });
});
