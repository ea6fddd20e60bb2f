/**
 * The edge (edge/, docs/edge.md) as it ships, in front of two regional gateways: the bundle of
 * edge/worker.ts under the real workerd with edge/workerd.capnp as it is, and edge/deno.ts under
 * Deno. The gateways are real (`startGateway`, Bun.serve on loopback) and share one real
 * PostgreSQL, as a deployment's do; each has its own in-memory agent (tests/support/memory-agent.ts),
 * so which agent holds a sandbox proves which gateway created it. Tenants are at home in
 * `eu_west.1` (a region name with `_` and `.`) and `us-east`.
 *
 * Shown: each tenant's requests land on its region's gateway; requests naming no region (health,
 * a key without one) go to the default region; an event stream passes through as it is written
 * (its first event arrives while the exec is still running); a terminal WebSocket and a connect
 * URL's WebSocket (routed by its token's region) pass through; the edge's own refusals are the
 * envelope (unknown region 421, no gateway answering 503); a bad key is refused by the gateway
 * (401), not the edge; a safe request is retried on the region's next gateway.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { createServer, type Server } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import WebSocket from "ws";
import { e2bKeyOf } from "../../contracts/e2b/ids.ts";
import { REGION_HEADER } from "../../edge/app.ts";
import { createKey } from "../../gateway/auth/keys.ts";
import { upsertPublicTemplate } from "../../gateway/core/templates.ts";
import { type RunningGateway, startGateway } from "../../gateway/server.ts";
import { type RunningEdge, startDenoEdge, startWorkerdEdge } from "../support/edge.ts";
import { followBody } from "../support/follow-body.ts";
import { MemoryAgent } from "../support/memory-agent.ts";
import { freePort, startPostgres, type TestPostgres } from "../support/postgres.ts";
import { denoBinary } from "../support/runtimes.ts";
import { until } from "../support/until.ts";

const EU = "eu_west.1";
const US = "us-east";
const ECHO_PORT = 7000;
const E2B_DOMAIN = "e2b.edge.test";
const SECRETS = { keyPepper: "edge-test-pepper-0123456789", connectSecret: "edge-test-connect-0123456789" };
/** PostgreSQL, two gateways migrating it, workerd and Deno starting cold on a loaded 2-core host. */
const SETUP_MS = 90_000;
/** A pass-through that works answers in milliseconds; the bound is for a loaded host. */
const PASS_MS = 10_000;

let pg: TestPostgres | null = null;
const dirs: string[] = [];
const gateways: RunningGateway[] = [];
const agents = { [EU]: new MemoryAgent(), [US]: new MemoryAgent() };
let workerd: RunningEdge;
let deno: RunningEdge | undefined;
let echo: Server;
/**
 * Keys by tenant: `eu` and `us` at home there, `old` with no home, `mars` in a region no edge
 * serves, `retry` in `us-retry`, whose first gateway is down.
 */
const keys: Record<"eu" | "us" | "old" | "mars" | "retry", string> = {
  eu: "",
  us: "",
  old: "",
  mars: "",
  retry: "",
};
/** A loopback port nothing listens on: a gateway that is down. */
let deadPort = 0;

async function gateway(region: string, edgeUrl: string): Promise<RunningGateway> {
  const dir = mkdtempSync(join(tmpdir(), "sbx-edge-gw-"));
  dirs.push(dir);
  const gw = await startGateway({
    port: 0,
    dataDir: dir,
    databaseUrl: pg!.url,
    agent: agents[region as keyof typeof agents],
    secrets: SECRETS,
    reaper: false,
    // Connect URLs name the edge, the address clients use (docs/edge.md "Gateways behind an edge").
    config: {
      region,
      agent: { id: `mem-${region}`, region, url: "in-process" },
      publicBaseUrl: edgeUrl,
      // E2B's data plane by host, `<port>-<id>.<domain>`: the domain's names point at the edge.
      e2bDomain: E2B_DOMAIN,
    },
    log: () => {},
  });
  gateways.push(gw);
  return gw;
}

function edgeEnv(eu: RunningGateway, us: RunningGateway): Record<string, string> {
  return {
    SANDBOXD_EDGE_REGIONS: JSON.stringify({
      [EU]: [eu.url],
      [US]: [us.url],
      // A region whose first gateway is down: a safe request goes on to the next.
      "us-retry": [`http://127.0.0.1:${deadPort}`, us.url],
      // A region none of whose gateways answers.
      down: [`http://127.0.0.1:${deadPort}`],
    }),
    SANDBOXD_EDGE_DEFAULT_REGION: EU,
    SANDBOXD_EDGE_CLIENT_IP_HEADER: "x-real-ip",
  };
}

beforeAll(async () => {
  pg = await startPostgres();
  if (!pg) throw new Error("PostgreSQL binaries missing (bin/sandboxd test installs them)");
  deadPort = await freePort();
  const workerdPort = await freePort();
  const edgeUrl = `http://127.0.0.1:${workerdPort}`;
  const eu = await gateway(EU, edgeUrl);
  const us = await gateway(US, edgeUrl);
  for (const a of Object.values(agents)) a.addReadyTemplate("web", [ECHO_PORT]);
  echo = createServer((s) => s.pipe(s));
  await new Promise<void>((r) => echo.listen(0, "127.0.0.1", r));
  for (const a of Object.values(agents))
    a.tunnelTargets.set(ECHO_PORT, (echo.address() as { port: number }).port);
  await eu.withDb(async (db) => {
    await upsertPublicTemplate({ db, clock: Date.now }, { id: "web", name: "web", description: "echo" });
    keys.eu = (await createKey(db, SECRETS.keyPepper, { tenant: "alpha", tier: "pro", region: EU })).key;
    keys.us = (await createKey(db, SECRETS.keyPepper, { tenant: "beta", tier: "pro", region: US })).key;
    keys.old = (await createKey(db, SECRETS.keyPepper, { tenant: "gamma", tier: "pro" })).key;
    keys.mars = (
      await createKey(db, SECRETS.keyPepper, { tenant: "delta", tier: "pro", region: "mars" })
    ).key;
    keys.retry = (
      await createKey(db, SECRETS.keyPepper, { tenant: "eps", tier: "pro", region: "us-retry" })
    ).key;
  });
  workerd = await startWorkerdEdge(workerdPort, edgeEnv(eu, us));
  deno = await startDenoEdge(denoBinary(), await freePort(), edgeEnv(eu, us));
}, SETUP_MS);

afterAll(async () => {
  await workerd?.stop();
  await deno?.stop();
  for (const gw of gateways) await gw.stop();
  echo?.close();
  pg?.stop();
  for (const d of dirs) rmSync(d, { recursive: true, force: true });
});

async function call(edge: RunningEdge, method: string, path: string, key?: string, json?: unknown) {
  const res = await fetch(`${edge.url}${path}`, {
    method,
    headers: {
      ...(key ? { authorization: `Bearer ${key}` } : {}),
      ...(json !== undefined ? { "content-type": "application/json" } : {}),
    },
    ...(json !== undefined ? { body: JSON.stringify(json) } : {}),
  });
  const text = await res.text();
  return { res, status: res.status, body: JSON.parse(text) as Record<string, unknown> };
}

/** VMs per region's in-memory agent: the one that gained a VM is the region whose gateway made it. */
function vmCounts() {
  return { [EU]: agents[EU].vms.size, [US]: agents[US].vms.size };
}

type Opened = { ws: WebSocket; got: string[]; protocol: string };

function wsOpen(url: string, opts: { headers?: Record<string, string>; protocols?: string[] }) {
  return new Promise<Opened | { status: number; body: string }>((resolve, reject) => {
    const ws = new WebSocket(url, opts.protocols ?? [], {
      headers: opts.headers ?? {},
      perMessageDeflate: false,
    });
    const got: string[] = [];
    ws.on("message", (data: Buffer) => got.push(data.toString()));
    ws.once("open", () => resolve({ ws, got, protocol: ws.protocol }));
    ws.once("unexpected-response", (_req, res) => {
      let body = "";
      res.on("data", (b: Buffer) => {
        body += b.toString();
      });
      res.on("end", () => resolve({ status: res.statusCode ?? 0, body }));
    });
    ws.once("error", reject);
  });
}

async function echoes(o: Opened, text: string): Promise<void> {
  o.ws.send(Buffer.from(text));
  await until(() => o.got.join("").includes(text), PASS_MS, 10);
}

/** The cases both runtimes must pass, on `edge()`. */
function passThrough(edge: () => RunningEdge) {
  test("each tenant's requests land on its home region's gateway; no region: the default", async () => {
    for (const [tenant, region] of [
      ["eu", EU],
      ["us", US],
      ["old", EU],
    ] as const) {
      const before = vmCounts();
      const created = await call(edge(), "POST", "/v1/sandboxes", keys[tenant], { template: "web" });
      expect(created.status).toBe(201);
      expect(created.res.headers.get(REGION_HEADER)).toBe(region);
      const after = vmCounts();
      // The VM is on the agent of that region's gateway, and on no other.
      expect(after[region]).toBe(before[region] + 1);
      const other = region === EU ? US : EU;
      expect(after[other]).toBe(before[other]);
    }
    const health = await call(edge(), "GET", "/v1/health");
    expect(health.status).toBe(200);
    expect(health.res.headers.get(REGION_HEADER)).toBe(EU);
  });

  test("the request id is kept, the client's address and scheme forwarded", async () => {
    const res = await fetch(`${edge().url}/v1/sandboxes`, {
      headers: { authorization: `Bearer ${keys.us}`, "x-request-id": "edge-req-1", "x-real-ip": "192.0.2.7" },
    });
    expect(res.status).toBe(200);
    expect(res.headers.get("x-request-id")).toBe("edge-req-1");
    await res.arrayBuffer();
  });

  test("an event stream passes through as it is written", async () => {
    const created = await call(edge(), "POST", "/v1/sandboxes", keys.us, { template: "web" });
    const id = created.body.id as string;
    agents[US].holdStreams = true;
    try {
      const res = await fetch(`${edge().url}/v1/sandboxes/${id}/exec`, {
        method: "POST",
        headers: {
          authorization: `Bearer ${keys.us}`,
          accept: "text/event-stream",
          "content-type": "application/json",
        },
        body: JSON.stringify({ command: "streamed-through-the-edge" }),
      });
      expect(res.status).toBe(200);
      expect(res.headers.get("content-type")).toContain("text/event-stream");
      const followed = followBody(res);
      // The output's event arrives while the exec still runs (the agent holds it open): nothing
      // between the gateway and the client waits for the end.
      await until(() => followed.state.text.includes("streamed-through-the-edge"), PASS_MS, 10);
      expect(agents[US].streamsHeld).toBe(1);
      const aborted = agents[US].streamsAborted;
      await followed.cancel();
      // The client going away reaches the gateway through the edge: the exec's call is aborted.
      await until(() => agents[US].streamsAborted === aborted + 1, PASS_MS, 10);
    } finally {
      agents[US].holdStreams = false;
    }
  });

  test("a terminal's WebSocket passes through, with the key as a header or a subprotocol", async () => {
    const created = await call(edge(), "POST", "/v1/sandboxes", keys.eu, { template: "web" });
    const wsUrl = `${edge().url.replace(/^http/, "ws")}/v1/sandboxes/${created.body.id as string}/pty`;
    const byHeader = await wsOpen(wsUrl, { headers: { authorization: `Bearer ${keys.eu}` } });
    if (!("ws" in byHeader)) throw new Error(`refused: ${byHeader.status} ${byHeader.body}`);
    await echoes(byHeader, "typed-through-the-edge");
    byHeader.ws.close();
    // A browser's way: the key in Sec-WebSocket-Protocol; the gateway answers with the marker only.
    const byProtocol = await wsOpen(wsUrl, { protocols: ["sandboxd", `sandboxd.key.${keys.eu}`] });
    if (!("ws" in byProtocol)) throw new Error(`refused: ${byProtocol.status} ${byProtocol.body}`);
    expect(byProtocol.protocol).toBe("sandboxd");
    await echoes(byProtocol, "typed-again");
    byProtocol.ws.close();
  });

  test("a connect URL (no key, its token names the region) reaches the tenant's region", async () => {
    const created = await call(edge(), "POST", "/v1/sandboxes", keys.us, { template: "web" });
    const id = created.body.id as string;
    const minted = await call(edge(), "POST", `/v1/sandboxes/${id}/connect-url`, keys.us, {
      port: ECHO_PORT,
      ttl_seconds: 60,
    });
    expect(minted.status).toBe(200);
    // The gateways' public URL is the workerd edge's: the URL is used through the edge under test.
    const url = (minted.body.url as string).replace(/^ws:\/\/[^/]+/, edge().url.replace(/^http/, "ws"));
    const opened = agents[US].tunnelsOpened.length;
    const o = await wsOpen(url, {});
    if (!("ws" in o)) throw new Error(`refused: ${o.status} ${o.body}`);
    await echoes(o, "sent-by-token");
    expect(agents[US].tunnelsOpened.length).toBe(opened + 1);
    o.ws.close();
  });

  test("E2B's SDK calls: an E2B-form key's control plane, then the data plane by its access token alone, by header and by host", async () => {
    const before = vmCounts();
    const res = await fetch(`${edge().url}/e2b/sandboxes`, {
      method: "POST",
      headers: { "x-api-key": e2bKeyOf(keys.us), "content-type": "application/json" },
      body: JSON.stringify({ templateID: "web" }),
    });
    expect(res.status).toBe(201);
    expect(res.headers.get(REGION_HEADER)).toBe(US);
    const sbx = (await res.json()) as { sandboxID: string; envdAccessToken: string };
    expect(vmCounts()[US]).toBe(before[US] + 1);
    // The data plane's calls carry the sandbox's token and no key: its claim names the region.
    const token = sbx.envdAccessToken;
    const byHeader = await fetch(`${edge().url}/e2b/envd/health`, {
      headers: { "e2b-sandbox-id": sbx.sandboxID, "x-access-token": token },
    });
    expect(byHeader.status).toBe(204);
    expect(byHeader.headers.get(REGION_HEADER)).toBe(US);
    // E2B's own form: the host names sandbox and port; the gateway reads it from X-Forwarded-Host.
    const byHost = await fetch(`${edge().url}/health`, {
      headers: { host: `49983-${sbx.sandboxID}.${E2B_DOMAIN}`, "x-access-token": token },
    });
    expect(byHost.status).toBe(204);
    expect(byHost.headers.get(REGION_HEADER)).toBe(US);
    // Another tenant's token for it is refused by the gateway, whichever region it names.
    const eu = await fetch(`${edge().url}/e2b/sandboxes`, {
      method: "POST",
      headers: { "x-api-key": e2bKeyOf(keys.eu), "content-type": "application/json" },
      body: JSON.stringify({ templateID: "web" }),
    });
    expect(eu.headers.get(REGION_HEADER)).toBe(EU);
    const euToken = ((await eu.json()) as { envdAccessToken: string }).envdAccessToken;
    const foreign = await fetch(`${edge().url}/e2b/envd/health`, {
      headers: { "e2b-sandbox-id": sbx.sandboxID, "x-access-token": euToken },
    });
    expect(foreign.status).toBe(401);
    await foreign.arrayBuffer();
  });

  test("a bad key is the gateway's 401, not the edge's", async () => {
    const wrongSecret = keys.us.replace(/_[A-Za-z0-9]+$/, `_${"A".repeat(40)}`);
    const moved = keys.us.replace(`_${US}_`, `_${EU}_`); // another region: the hash covers it
    for (const key of [wrongSecret, moved, "not-a-key"]) {
      const r = await call(edge(), "GET", "/v1/sandboxes", key);
      expect(r.status).toBe(401);
      expect(r.body.code).toBe("unauthorized");
      expect(r.res.headers.get(REGION_HEADER)).not.toBeNull(); // a gateway answered
    }
    const ws = await wsOpen(`${edge().url.replace(/^http/, "ws")}/v1/sandboxes/sbx_none/pty`, {
      headers: { authorization: `Bearer ${wrongSecret}` },
    });
    expect("status" in ws && ws.status).toBe(401);
  });

  test("the edge's own refusals: an unknown region (421), no gateway answering (503)", async () => {
    const unknown = await call(edge(), "GET", "/v1/sandboxes", keys.mars);
    expect(unknown.status).toBe(421);
    expect(unknown.body).toEqual({
      code: "unknown_region",
      message:
        "the API key names region mars, which this edge does not serve; send it to that region's address",
    });
    expect(unknown.res.headers.get("content-type")).toContain("application/json");
    expect(unknown.res.headers.get("x-request-id")).not.toBeNull();
    const downKey = keys.us.replace(`_${US}_`, "_down_");
    const down = await call(edge(), "GET", "/v1/sandboxes", downKey);
    expect(down.status).toBe(503);
    expect(down.res.headers.get("retry-after")).toBe("1");
    expect(down.body).toEqual({
      code: "gateway_unavailable",
      message: "no gateway of region down answered; retry with backoff",
    });
  });

  test("a safe request is tried on the region's next gateway when one is down", async () => {
    // us-retry lists a dead gateway first: whichever the edge picks, every GET is answered.
    for (let i = 0; i < 8; i++) {
      const r = await call(edge(), "GET", "/v1/sandboxes", keys.retry);
      expect(r.status).toBe(200);
      expect(r.res.headers.get(REGION_HEADER)).toBe("us-retry");
    }
  });
}

describe("workerd (edge/worker.ts, edge/workerd.capnp)", () => {
  passThrough(() => workerd);
});

describe("Deno (edge/deno.ts)", () => {
  passThrough(() => deno!);
});
