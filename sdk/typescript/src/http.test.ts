/**
 * The SDK's HTTP boundary against a tiny real HTTP server on loopback (not a stand-in for the
 * service: what is tested is what the SDK does with answers any server can give): 429 and 503
 * are retried with backoff, `Retry-After` is waited exactly (and a too-long one is not waited at
 * all), non-idempotent calls are not retried unless asked, and error answers become
 * `SandboxdError` with the envelope's code, the status and `retryAfterSeconds`. The waits are
 * recorded rather than slept.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { Sandboxd } from "./client.ts";
import { parseRetryAfter, SandboxdError } from "./errors.ts";
import { DEFAULT_RETRY, Transport } from "./http.ts";

interface Answer {
  status: number;
  body?: unknown;
  headers?: Record<string, string>;
}

/** The server answers from a script: each request takes the next answer. */
let script: Answer[] = [];
const seen: { method: string; path: string; auth: string | null; body: string }[] = [];
let server: ReturnType<typeof Bun.serve>;

beforeAll(() => {
  server = Bun.serve({
    hostname: "127.0.0.1",
    port: 0,
    async fetch(req) {
      const url = new URL(req.url);
      seen.push({
        method: req.method,
        path: url.pathname + url.search,
        auth: req.headers.get("authorization"),
        body: await req.text(),
      });
      const a = script.shift() ?? { status: 500, body: { code: "internal", message: "script ran out" } };
      const body = typeof a.body === "string" ? a.body : JSON.stringify(a.body ?? {});
      return new Response(body, {
        status: a.status,
        headers: { "content-type": "application/json", ...a.headers },
      });
    },
  });
});
afterAll(() => server.stop(true));

function transport(retry: Partial<typeof DEFAULT_RETRY> | false = {}) {
  const waits: number[] = [];
  const t = new Transport({
    baseUrl: `http://127.0.0.1:${server.port}`,
    apiKey: "svc_pro_abcdefgh_0123456789abcdefghij",
    timeoutMs: 10_000,
    retry: retry === false ? false : { ...DEFAULT_RETRY, ...retry },
    fetch: (u, i) => fetch(u, i),
    sleep: async (ms) => {
      waits.push(ms);
    },
    random: () => 0.5,
  });
  return { t, waits };
}

function run(answers: Answer[]) {
  script = [...answers];
  seen.length = 0;
}

const busy = (status: number, retryAfter?: string): Answer => ({
  status,
  body: { code: status === 429 ? "rate_limited" : "at_capacity", message: "later" },
  headers: retryAfter === undefined ? {} : { "retry-after": retryAfter },
});

describe("retries", () => {
  test("a GET answered 429 with Retry-After waits exactly that long, then succeeds", async () => {
    const { t, waits } = transport();
    run([busy(429, "2"), { status: 200, body: { ok: 1 } }]);
    expect(await t.json("GET", "/v1/sandboxes")).toEqual({ ok: 1 });
    expect(waits).toEqual([2000]);
    expect(seen.map((s) => s.auth)).toEqual([
      "Bearer svc_pro_abcdefgh_0123456789abcdefghij",
      "Bearer svc_pro_abcdefgh_0123456789abcdefghij",
    ]);
  });

  test("503 without Retry-After backs off exponentially (jitter 0.5): 250, 500, 1000 ms", async () => {
    const { t, waits } = transport();
    run([busy(503), busy(503), busy(503), { status: 200, body: [] }]);
    expect(await t.json("DELETE", "/v1/sandboxes/sbx_1")).toEqual([]);
    expect(waits).toEqual([250, 500, 1000]);
  });

  test("after maxRetries the last error is thrown with its code, status and retryAfterSeconds", async () => {
    const { t, waits } = transport({ maxRetries: 2 });
    run([busy(429, "1"), busy(429, "1"), busy(429, "1"), { status: 200 }]);
    const err = await t.json("GET", "/v1/usage").catch((e: unknown) => e);
    expect(err).toBeInstanceOf(SandboxdError);
    expect(err).toMatchObject({ code: "rate_limited", status: 429, retryAfterSeconds: 1, message: "later" });
    expect(waits).toEqual([1000, 1000]);
    expect(seen.length).toBe(3);
  });

  test("a Retry-After longer than maxDelayMs is not waited: the error comes at once", async () => {
    const { t, waits } = transport({ maxDelayMs: 5000 });
    run([busy(503, "60"), { status: 200 }]);
    const err = (await t.json("GET", "/v1/sandboxes").catch((e: unknown) => e)) as SandboxdError;
    expect(err.retryAfterSeconds).toBe(60);
    expect(waits).toEqual([]);
    expect(seen.length).toBe(1);
  });

  test("a POST is not retried by default; with retry: true (or nonIdempotent) it is", async () => {
    const { t, waits } = transport();
    run([busy(503, "1"), { status: 201, body: { id: "sbx_x" } }]);
    const err = (await t
      .json("POST", "/v1/sandboxes", { json: {} })
      .catch((e: unknown) => e)) as SandboxdError;
    expect(err.code).toBe("at_capacity");
    expect(seen.length).toBe(1);

    run([busy(503, "1"), { status: 201, body: { id: "sbx_x" } }]);
    expect(await t.json("POST", "/v1/sandboxes", { json: { a: 1 }, retry: true })).toEqual({ id: "sbx_x" });
    expect(seen.map((s) => s.body)).toEqual(['{"a":1}', '{"a":1}']);
    expect(waits).toEqual([1000]);

    const all = transport({ nonIdempotent: true });
    run([busy(429, "1"), { status: 200, body: { id: "sbx_y" } }]);
    expect(await all.t.json("POST", "/v1/sandboxes/sbx_1/fork", { json: {} })).toEqual({ id: "sbx_y" });
  });

  test("retry: false never retries; other statuses (409, 500) are never retried", async () => {
    const off = transport(false);
    run([busy(429, "1"), { status: 200 }]);
    expect(((await off.t.json("GET", "/x").catch((e: unknown) => e)) as SandboxdError).status).toBe(429);
    expect(off.waits).toEqual([]);

    const { t, waits } = transport();
    run([{ status: 409, body: { code: "busy", message: "an exec is running" } }, { status: 200 }]);
    expect(await t.json("GET", "/x").catch((e: unknown) => e)).toMatchObject({ code: "busy", status: 409 });
    run([{ status: 500, body: { code: "internal", message: "internal error" } }, { status: 200 }]);
    expect(await t.json("GET", "/x").catch((e: unknown) => e)).toMatchObject({
      code: "internal",
      status: 500,
    });
    expect(waits).toEqual([]);
  });
});

describe("error mapping", () => {
  test("a body that is not the envelope gets a code from its status and a snippet", async () => {
    const { t } = transport(false);
    run([{ status: 502, body: "<html>Bad Gateway</html>" }]);
    expect(await t.json("GET", "/x").catch((e: unknown) => e)).toMatchObject({
      code: "internal",
      status: 502,
      message: "HTTP 502: <html>Bad Gateway</html>",
    });
    run([{ status: 404, body: "" }]);
    expect(await t.json("GET", "/x").catch((e: unknown) => e)).toMatchObject({
      code: "not_found",
      status: 404,
    });
  });

  test("a 2xx that is not JSON is a protocol error; no server is a network error (status 0)", async () => {
    const { t } = transport(false);
    run([{ status: 200, body: "not json" }]);
    expect(await t.json("GET", "/x").catch((e: unknown) => e)).toMatchObject({
      code: "protocol",
      status: 200,
    });

    const dead = new Sandboxd({ baseUrl: "http://127.0.0.1:9", apiKey: "k", retry: false });
    expect(await dead.sandboxes.list().catch((e: unknown) => e)).toMatchObject({
      code: "network",
      status: 0,
    });
  });

  test("a create's size class goes in the body; size_unavailable carries the service's details.sizes", async () => {
    const client = new Sandboxd({ baseUrl: `http://127.0.0.1:${server.port}`, apiKey: "k", retry: false });
    const sizes = [{ vcpus: 1, memory_mib: 256 }];
    run([{ status: 400, body: { code: "size_unavailable", message: "no such class", details: { sizes } } }]);
    const err = await client.sandboxes
      .create({ template: "t", vcpus: 2, memoryMib: 512 })
      .catch((e: unknown) => e);
    expect(JSON.parse(seen[0]!.body)).toMatchObject({ template: "t", vcpus: 2, memory_mib: 512 });
    expect(err).toBeInstanceOf(SandboxdError);
    expect(err).toMatchObject({ code: "size_unavailable", status: 400, details: { sizes } });
  });

  test("Retry-After as seconds or as an HTTP date", () => {
    const now = Date.parse("2026-01-01T00:00:00Z");
    expect(parseRetryAfter("7", now)).toBe(7);
    expect(parseRetryAfter("Thu, 01 Jan 2026 00:00:30 GMT", now)).toBe(30);
    expect(parseRetryAfter("soon", now)).toBeUndefined();
    expect(parseRetryAfter(null, now)).toBeUndefined();
  });

  test("no URL at all is a clear error; SANDBOXD_URL and SANDBOXD_API_KEY are read", async () => {
    const saved = { url: process.env.SANDBOXD_URL, key: process.env.SANDBOXD_API_KEY };
    try {
      delete process.env.SANDBOXD_URL;
      expect(() => new Sandboxd()).toThrow(/SANDBOXD_URL/);
      process.env.SANDBOXD_URL = `http://127.0.0.1:${server.port}`;
      process.env.SANDBOXD_API_KEY = "svc_demo_fromenv_0123456789abcdefghij";
      run([{ status: 200, body: { sandboxes: [] } }]);
      expect(await new Sandboxd().sandboxes.list()).toEqual([]);
      expect(seen[0]?.auth).toBe("Bearer svc_demo_fromenv_0123456789abcdefghij");
    } finally {
      if (saved.url === undefined) delete process.env.SANDBOXD_URL;
      else process.env.SANDBOXD_URL = saved.url;
      if (saved.key === undefined) delete process.env.SANDBOXD_API_KEY;
      else process.env.SANDBOXD_API_KEY = saved.key;
    }
  });
});
