/**
 * Request ids and access lines of the public API (gateway/request-context.ts, docs/operations.md
 * "Logs"), through the real gateway app (answers checked against openapi.yaml): a client's plain
 * id is answered back and named by the access line; a hostile one (spaces, a newline, 129
 * characters) is replaced by a fresh id; the access line names tenant and sandbox and never the
 * query string. Then the JSON form of such a line as the CLI writes it.
 */
import { afterAll, expect, test } from "bun:test";
import { formatLogLine, type LogFields } from "../../contracts/log.ts";
import { makeHarness } from "../support/gateway-harness.ts";

const lines: Array<{ line: string; fields: LogFields | undefined }> = [];
const h = await makeHarness({ log: (line, fields) => lines.push({ line, fields }) });
afterAll(() => h.close());
const access = () => lines.filter((l) => l.fields?.kind === "access").map((l) => l.fields!);

test("a client's request id is kept, a hostile one replaced; the access line names tenant and sandbox", async () => {
  const key = await h.key("acme", "pro");
  const r = await h.req("GET", "/v1/sandboxes", { key, headers: { "x-request-id": "client-abc.123_X" } });
  expect(r.headers.get("x-request-id")).toBe("client-abc.123_X");
  expect(access().at(-1)).toMatchObject({
    request_id: "client-abc.123_X",
    method: "GET",
    path: "/v1/sandboxes",
    status: 200,
    tenant: expect.stringMatching(/^ten_/),
  });
  for (const bad of ["two words", "x".repeat(129), "a\u00e9b", "semi;colon"]) {
    const res = await h.req("GET", "/v1/health", { headers: { "x-request-id": bad } });
    const id = res.headers.get("x-request-id");
    expect(id).toMatch(/^[0-9a-f]{16}$/);
    expect(access().at(-1)?.request_id).toBe(id ?? "");
  }
  // No key: no tenant. A sandbox's path names it; the query string never shows.
  const missing = await h.req("GET", "/v1/sandboxes/sbx_nothere0123/files?path=/etc/secret-token", { key });
  expect(missing.status).toBe(404);
  const last = access().at(-1)!;
  expect(last).toMatchObject({
    sandbox: "sbx_nothere0123",
    status: 404,
    path: "/v1/sandboxes/sbx_nothere0123/files",
  });
  expect(JSON.stringify(lines.at(-1))).not.toContain("secret-token");
});

test("a JSON log line: time, level, message and fields; text logs leave access lines out", () => {
  const at = new Date("2026-11-28T08:00:00.000Z");
  const json = formatLogLine(
    "json",
    "GET /v1/sandboxes 200 3.1 ms",
    { kind: "access", request_id: "r1", tenant: "ten_a", sandbox: undefined },
    at,
  );
  expect(JSON.parse(json!)).toEqual({
    time: "2026-11-28T08:00:00.000Z",
    level: "info",
    msg: "GET /v1/sandboxes 200 3.1 ms",
    kind: "access",
    request_id: "r1",
    tenant: "ten_a",
  });
  expect(formatLogLine("text", "GET /v1/sandboxes 200 3.1 ms", { kind: "access" })).toBeUndefined();
  expect(formatLogLine("text", "gateway up")).toBe("sandboxd: gateway up");
  expect(JSON.parse(formatLogLine("json", "WARNING: TCG")!).level).toBe("warn");
  expect(JSON.parse(formatLogLine("json", "template t build failed [e1]")!).level).toBe("error");
  expect(JSON.parse(formatLogLine("json", "x", { level: "warn" })!).level).toBe("warn");
});
