/**
 * The edge app (edge/app.ts) under Bun, in front of real HTTP servers on loopback that answer what
 * they received: the headers it forwards and strips, which requests it retries, how it routes,
 * and its configuration's checks. The runtimes it ships on, with real gateways:
 * tests/integration/edge-workerd.test.ts.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { e2bKeyOf } from "../contracts/e2b/ids.ts";
import { createEdgeApp, type EdgeDeps, REGION_HEADER, routeOf } from "./app.ts";
import { type EdgeConfig, parseEdgeConfig } from "./config.ts";

const ID = "abcdefghij12";
const SECRET = "0123456789abcdefABCDEF0123456789abcdefAB";
const key = (region?: string) => `svc_pro_${region ? `${region}_` : ""}${ID}_${SECRET}`;

/** One upstream: answers with its name, the request's method, path, headers and body. */
function upstream(name: string) {
  return Bun.serve({
    port: 0,
    hostname: "127.0.0.1",
    async fetch(req) {
      const url = new URL(req.url);
      if (url.pathname === "/redirect")
        return new Response(null, { status: 302, headers: { location: "/x" } });
      return Response.json(
        {
          name,
          method: req.method,
          path: `${url.pathname}${url.search}`,
          headers: Object.fromEntries(req.headers),
          body: await req.text(),
        },
        {
          headers: {
            connection: "keep-alive, x-hop",
            "x-hop": "1",
            "keep-alive": "timeout=5",
            "x-end": "kept",
          },
        },
      );
    },
  });
}

let eu: ReturnType<typeof upstream>;
let us: ReturnType<typeof upstream>;
/** A loopback port nothing listens on any more: a gateway that is down. */
let dead = "";

beforeAll(async () => {
  eu = upstream("eu");
  us = upstream("us");
  const gone = Bun.serve({ port: 0, hostname: "127.0.0.1", fetch: () => new Response() });
  dead = `http://127.0.0.1:${gone.port}`;
  await gone.stop(true);
});
afterAll(() => {
  eu.stop(true);
  us.stop(true);
});

function config(): EdgeConfig {
  const parsed = parseEdgeConfig({
    SANDBOXD_EDGE_REGIONS: JSON.stringify({
      eu: [`http://127.0.0.1:${eu.port}/`],
      "us_east.1": [dead, `http://127.0.0.1:${us.port}`],
    }),
    SANDBOXD_EDGE_DEFAULT_REGION: "eu",
  });
  if (!parsed.ok) throw new Error(parsed.message);
  return parsed.config;
}

function edge(over: Partial<EdgeDeps> = {}) {
  const lines: string[] = [];
  const app = createEdgeApp({
    config: config(),
    fetch: (req) => fetch(req),
    random: () => 0,
    clientAddress: () => "198.51.100.9",
    newRequestId: () => "new-id",
    log: (l) => lines.push(l),
    ...over,
  });
  return { app, lines };
}

async function seen(res: Response) {
  return (await res.json()) as {
    name: string;
    method: string;
    path: string;
    headers: Record<string, string>;
    body: string;
  };
}

describe("forwarding", () => {
  test("hop-by-hop headers stay behind, both ways; the client's address, scheme and request id go on", async () => {
    const { app } = edge();
    const res = await app.request("https://edge.example/v1/sandboxes?x=1", {
      headers: {
        authorization: `Bearer ${key()}`,
        connection: "keep-alive, x-private",
        "x-private": "secret of the hop",
        "keep-alive": "timeout=5",
        te: "trailers",
        "proxy-authorization": "Basic abc",
        "x-forwarded-for": "203.0.113.1",
        "x-forwarded-host": "claimed.example",
        "x-request-id": "client-id.1",
      },
    });
    expect(res.status).toBe(200);
    const got = await seen(res);
    expect(got.name).toBe("eu");
    expect(got.path).toBe("/v1/sandboxes?x=1");
    for (const h of ["x-private", "keep-alive", "te", "proxy-authorization"])
      expect(got.headers[h]).toBeUndefined();
    expect(got.headers.authorization).toBe(`Bearer ${key()}`);
    expect(got.headers.host).toBe(`127.0.0.1:${eu.port}`);
    expect(got.headers["x-forwarded-for"]).toBe("203.0.113.1, 198.51.100.9");
    expect(got.headers["x-forwarded-proto"]).toBe("https");
    // The host the client asked the edge for (an E2B data-plane call is named by it), not a claim.
    expect(got.headers["x-forwarded-host"]).toBe("edge.example");
    expect(got.headers["x-request-id"]).toBe("client-id.1");
    // The answer: the upstream's own headers, less those its Connection named.
    expect(res.headers.get("x-end")).toBe("kept");
    expect(res.headers.get("x-hop")).toBeNull();
    expect(res.headers.get("keep-alive")).toBeNull();
    expect(res.headers.get(REGION_HEADER)).toBe("eu");
  });

  test("a request id the gateway would not keep is replaced, so both name the same one", async () => {
    const { app } = edge();
    const got = await seen(
      await app.request("http://edge/v1/health", { headers: { "x-request-id": "bad id!" } }),
    );
    expect(got.headers["x-request-id"]).toBe("new-id");
  });

  test("a body streams to the gateway; a redirect is the client's to follow", async () => {
    const { app } = edge();
    const body = "x".repeat(300_000);
    const got = await seen(await app.request("http://edge/v1/exec", { method: "POST", body }));
    expect(got.method).toBe("POST");
    expect(got.body.length).toBe(body.length);
    const redirect = await app.request("http://edge/redirect");
    expect(redirect.status).toBe(302);
    expect(redirect.headers.get("location")).toBe("/x");
  });
});

describe("retries", () => {
  test("a safe request goes on to the region's next gateway; an unsafe one does not", async () => {
    // random 0: the region's first gateway, the dead one, is tried first.
    const { app, lines } = edge();
    const get = await app.request("http://edge/v1/sandboxes", {
      headers: { authorization: `Bearer ${key("us_east.1")}` },
    });
    expect(get.status).toBe(200);
    expect((await seen(get)).name).toBe("us");
    const post = await app.request("http://edge/v1/sandboxes", {
      method: "POST",
      headers: { authorization: `Bearer ${key("us_east.1")}` },
      body: "{}",
    });
    expect(post.status).toBe(503);
    expect(post.headers.get("retry-after")).toBe("1");
    expect(await post.json()).toEqual({
      code: "gateway_unavailable",
      message: "no gateway of region us_east.1 answered; retry with backoff",
    });
    expect(post.headers.get("x-request-id")).toBe("new-id");
    expect(lines.join("\n")).toContain(`POST /v1/sandboxes [new-id]: region us_east.1: ${dead}:`);
    // random 0.99: the live one first, where the POST is answered.
    const second = edge({ random: () => 0.99 });
    const ok = await second.app.request("http://edge/v1/sandboxes", {
      method: "POST",
      headers: { authorization: `Bearer ${key("us_east.1")}` },
      body: "{}",
    });
    expect(ok.status).toBe(200);
  });
});

describe("routing", () => {
  const req = (path: string, headers: Record<string, string> = {}) =>
    new Request(`http://edge${path}`, { headers });
  const route = (r: Request) => routeOf(config(), r, new URL(r.url));

  test("by the key's region, wherever the key is presented", () => {
    expect(route(req("/v1/x", { authorization: `Bearer ${key("us_east.1")}` }))).toEqual({
      region: "us_east.1",
      by: "key",
    });
    expect(route(req("/v1/x", { "x-api-key": key("us_east.1") })).region).toBe("us_east.1");
    const ws = { upgrade: "websocket", "sec-websocket-protocol": `sandboxd, sandboxd.key.${key("mars")}` };
    expect(route(req("/v1/x", ws))).toEqual({ region: "mars", by: "key" });
  });

  test("a key without a region, or no key at all, goes to the default region", () => {
    expect(route(req("/v1/x", { authorization: `Bearer ${key()}` }))).toEqual({
      region: "eu",
      by: "default",
    });
    expect(route(req("/v1/x", { authorization: "Bearer garbage" })).by).toBe("default");
    expect(route(req("/v1/health")).by).toBe("default");
  });

  test("a connect URL's token names its region; only on the connect path, only without a key", () => {
    const claims = btoa(JSON.stringify({ reg: "us_east.1", tid: "t" })).replace(/=+$/, "");
    const t = `eyJhbGciOiJIUzI1NiJ9.${claims}.sig`;
    expect(route(req(`/v1/sandboxes/sbx_1/connect?port=1&t=${t}`))).toEqual({
      region: "us_east.1",
      by: "connect-token",
    });
    expect(route(req(`/v1/sandboxes/sbx_1/other?t=${t}`)).by).toBe("default");
    expect(route(req(`/v1/sandboxes/sbx_1/connect?t=${t}`, { authorization: `Bearer ${key()}` })).by).toBe(
      "default",
    );
  });

  test("E2B's SDK: an E2B-form key names its native key's region; a data-plane call's access token its claim", () => {
    expect(route(req("/e2b/sandboxes", { "x-api-key": e2bKeyOf(key("us_east.1")) }))).toEqual({
      region: "us_east.1",
      by: "key",
    });
    expect(route(req("/e2b/sandboxes", { "x-api-key": e2bKeyOf(key()) })).by).toBe("default");
    // Odd-length or non-hex after `e2b_`: no key, the default (the gateway refuses it).
    expect(route(req("/e2b/sandboxes", { "x-api-key": "e2b_abc" })).by).toBe("default");
    expect(route(req("/e2b/sandboxes", { "x-api-key": "e2b_zz" })).by).toBe("default");
    const claims = btoa(JSON.stringify({ reg: "us_east.1", sub: "sbx_1" })).replace(/=+$/, "");
    const token = `eyJhbGciOiJIUzI1NiJ9.${claims}.sig`;
    expect(route(req("/process.Process/Start", { "x-access-token": token }))).toEqual({
      region: "us_east.1",
      by: "access-token",
    });
    // A key wins over a token; a token that is no JWT, or names no region, is the default.
    expect(route(req("/health", { "x-access-token": token, "x-api-key": key("mars") })).region).toBe("mars");
    expect(route(req("/health", { "x-access-token": "not.a.jwt" })).by).toBe("default");
    const none = btoa(JSON.stringify({ sub: "sbx_1" })).replace(/=+$/, "");
    expect(route(req("/health", { "x-access-token": `h.${none}.s` })).by).toBe("default");
    expect(route(req("/health", { "x-access-token": "x".repeat(10_000) })).by).toBe("default");
  });

  test("an E2B sandbox's data-plane calls all go to one gateway of the region (its id picks it); others at random", async () => {
    const parsed = parseEdgeConfig({
      SANDBOXD_EDGE_REGIONS: JSON.stringify({
        eu: ["http://gw0.test", "http://gw1.test", "http://gw2.test"],
      }),
      SANDBOXD_EDGE_DEFAULT_REGION: "eu",
    });
    if (!parsed.ok) throw new Error(parsed.message);
    const hits: string[] = [];
    let r = 0;
    const app = createEdgeApp({
      config: parsed.config,
      fetch: async (req) => {
        hits.push(new URL(req.url).host);
        return new Response("ok");
      },
      // Each request a different draw: only the sandbox's id can keep its calls on one gateway.
      random: () => (r++ % 3) / 3,
      clientAddress: () => undefined,
      newRequestId: () => "id",
    });
    const gatewayOf = async (id: string, by: "header" | "host") => {
      hits.length = 0;
      for (let i = 0; i < 6; i++) {
        const res =
          by === "header"
            ? await app.request("http://edge/e2b/envd/process.Process/SendInput", {
                method: "POST",
                headers: { "e2b-sandbox-id": i % 2 ? `${id}-client1` : id },
              })
            : await app.request(`http://49983-${id}${i % 2 ? "-client1" : ""}.e2b.example/health`);
        await res.text();
      }
      expect(new Set(hits).size).toBe(1);
      return hits[0]!;
    };
    const ids = Array.from({ length: 12 }, (_, i) => `sandbox${i}x`);
    const picked = new Set<string>();
    for (const id of ids) {
      const g = await gatewayOf(id, "header");
      // The same gateway whichever way the sandbox is named.
      expect(await gatewayOf(id, "host")).toBe(g);
      picked.add(g);
    }
    // Sandboxes spread over the region's gateways.
    expect(picked.size).toBeGreaterThan(1);
    // Any other call: at random.
    hits.length = 0;
    for (let i = 0; i < 3; i++) await (await app.request("http://edge/e2b/sandboxes")).text();
    expect(new Set(hits).size).toBe(3);
  });

  test("a region the edge does not serve is 421 unknown_region, before any gateway is asked", async () => {
    let asked = 0;
    const { app } = edge({
      fetch: (r) => {
        asked++;
        return fetch(r);
      },
    });
    const res = await app.request("http://edge/v1/x", {
      headers: { authorization: `Bearer ${key("mars")}` },
    });
    expect(res.status).toBe(421);
    expect(((await res.json()) as { code: string }).code).toBe("unknown_region");
    expect(asked).toBe(0);
  });
});

describe("configuration", () => {
  const regions = (v: unknown) => JSON.stringify(v);
  test("every binding is checked; a bad one is named", () => {
    const cases: Array<[Record<string, unknown>, string]> = [
      [{}, "SANDBOXD_EDGE_REGIONS must be a JSON object"],
      [{ SANDBOXD_EDGE_REGIONS: "{" }, "SANDBOXD_EDGE_REGIONS is not JSON"],
      [{ SANDBOXD_EDGE_REGIONS: regions({ "a/b": ["http://x"] }) }, "is no region name"],
      [{ SANDBOXD_EDGE_REGIONS: regions({ eu: [] }) }, "SANDBOXD_EDGE_REGIONS.eu: 1 to 16 gateway URLs"],
      [{ SANDBOXD_EDGE_REGIONS: regions({ eu: ["ftp://x"] }) }, "is no http(s) URL"],
      [{ SANDBOXD_EDGE_REGIONS: regions({ eu: ["http://x/?q=1"] }) }, "is no http(s) URL"],
      [{ SANDBOXD_EDGE_REGIONS: regions({ eu: ["http://x"] }) }, "SANDBOXD_EDGE_DEFAULT_REGION must name"],
      [
        { SANDBOXD_EDGE_REGIONS: regions({ eu: ["http://x"] }), SANDBOXD_EDGE_DEFAULT_REGION: "us" },
        "SANDBOXD_EDGE_DEFAULT_REGION must name",
      ],
      [
        {
          SANDBOXD_EDGE_REGIONS: regions({ eu: ["http://x"] }),
          SANDBOXD_EDGE_DEFAULT_REGION: "eu",
          SANDBOXD_EDGE_CLIENT_IP_HEADER: "x y",
        },
        "SANDBOXD_EDGE_CLIENT_IP_HEADER must be a header name",
      ],
    ];
    for (const [env, message] of cases) {
      const parsed = parseEdgeConfig(env);
      expect(parsed.ok).toBe(false);
      if (!parsed.ok) expect(parsed.message).toContain(message);
    }
  });

  test("a JSON object binding (workerd's json, Workers' vars) is taken as it is; URLs lose a trailing /", () => {
    const parsed = parseEdgeConfig({
      SANDBOXD_EDGE_REGIONS: { eu: ["https://gw.eu.internal/prefix/"] },
      SANDBOXD_EDGE_DEFAULT_REGION: "eu",
      SANDBOXD_EDGE_CLIENT_IP_HEADER: "",
    });
    expect(parsed).toEqual({
      ok: true,
      config: {
        regions: new Map([["eu", ["https://gw.eu.internal/prefix"]]]),
        defaultRegion: "eu",
        clientIpHeader: undefined,
      },
    });
  });
});
