/**
 * Connect-from-outside (docs/connect.md "Rules of connect URLs"; docs/sandboxes.md "Rules of the sandboxes API") through a real gateway (`startGateway`, Bun.serve)
 * on real sockets. The agent is the in-memory stand-in (tests/support/memory-agent.ts), whose
 * `openTunnel` connects to a real TCP port on 127.0.0.1 chosen per guest port: everything from
 * the client's WebSocket to that port is the production path (upgrade, checks, relay,
 * back-pressure); the agent's own tunnel into a VM is built and tested separately.
 *
 * CDP: a real Chromium on the host (Debian package `chromium`) stands behind the tunnel as the
 * guest's DevTools port, and Playwright (`chromium.connectOverCDP(connectUrl)`) drives it through
 * the gateway.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { type ChildProcess, spawn, spawnSync } from "node:child_process";
import { createHash, randomBytes } from "node:crypto";
import { mkdtempSync, rmSync } from "node:fs";
import { createServer as createHttpServer, type Server as HttpServer } from "node:http";
import { createServer, type Server, type Socket } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import WebSocket from "ws";
import { createKey, revokeKey } from "../../gateway/auth/keys.ts";
import { upsertPublicTemplate } from "../../gateway/core/templates.ts";
import { type RunningGateway, startGateway } from "../../gateway/server.ts";
import { CHROMIUM_FLAGS } from "../support/chromium.ts";
import { MemoryAgent } from "../support/memory-agent.ts";

const HTTP_PORT = 8080; // guest port of the template's web server
const ECHO_PORT = 7000; // guest port of an echo server
const SOURCE_PORT = 7001; // guest port of a server that sends a stream
const CDP_PORT = 9222; // guest port of DevTools
const CHROMIUM = ["chromium", "/usr/bin/chromium"].find(
  (c) => spawnSync(c, ["--version"], { stdio: "ignore" }).status === 0,
);
const MB = 1024 * 1024;

let dir = "";
let gw: RunningGateway;
const agent = new MemoryAgent();
/** The gateway's clock: real time plus an offset the expiry test moves. */
const skew = { ms: 0 };
let pro = "";
let pro2 = "";
let demo = "";
const servers: Array<Server | HttpServer> = [];
const figures: Record<string, number> = {};

function listen(server: Server | HttpServer): Promise<number> {
  servers.push(server);
  return new Promise((resolve) => {
    server.listen(0, "127.0.0.1", () => resolve((server.address() as { port: number }).port));
  });
}

async function api(method: string, path: string, key: string, json?: unknown) {
  const headers: Record<string, string> = { authorization: `Bearer ${key}` };
  if (json !== undefined) headers["content-type"] = "application/json";
  const init: RequestInit = { method, headers };
  if (json !== undefined) init.body = JSON.stringify(json);
  const res = await fetch(`${gw.url}${path}`, init);
  return { status: res.status, body: (await res.json()) as Record<string, unknown> & { code?: string } };
}

async function sandbox(key = pro): Promise<string> {
  const r = await api("POST", "/v1/sandboxes", key, { template: "web" });
  expect(r.status).toBe(201);
  return r.body.id as string;
}

/**
 * A connect URL minted by the API, used as issued: with no public URL configured it follows the
 * request, so a gateway serving plain HTTP hands out `ws://` on the host the client reached.
 */
async function connectUrl(id: string, port: number, protocol = "tcp", ttl = 300, key = pro): Promise<string> {
  const r = await api("POST", `/v1/sandboxes/${id}/connect-url`, key, { port, ttl_seconds: ttl, protocol });
  expect(r.status).toBe(200);
  const url = r.body.url as string;
  expect(url).toStartWith(`${gw.url.replace(/^http:/, "ws:")}/v1/sandboxes/${id}/connect?port=${port}&`);
  return url;
}

type Closed = { code: number; reason: string };
type Opened = { ws: WebSocket; closed: Promise<Closed> } | { status: number; body: string };

/** Opens a WebSocket; a refused handshake gives its HTTP status and body instead. */
function wsOpen(url: string, headers: Record<string, string> = {}): Promise<Opened> {
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(url, { headers, perMessageDeflate: false });
    const closed = new Promise<Closed>((r) =>
      ws.once("close", (code, reason) => r({ code, reason: reason.toString() })),
    );
    ws.once("open", () => resolve({ ws, closed }));
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

async function mustOpen(url: string): Promise<WebSocket> {
  const o = await wsOpen(url);
  if (!("ws" in o)) throw new Error(`connect refused: ${o.status} ${o.body}`);
  return o.ws;
}

function closed(ws: WebSocket): Promise<{ code: number; reason: string }> {
  return new Promise((resolve) => {
    if (ws.readyState === WebSocket.CLOSED) return resolve({ code: -1, reason: "already closed" });
    ws.once("close", (code, reason) => resolve({ code, reason: reason.toString() }));
  });
}

async function until(cond: () => boolean, what: string, ms = 10_000): Promise<void> {
  const t0 = Date.now();
  while (!cond()) {
    if (Date.now() - t0 > ms) throw new Error(`timed out waiting for ${what}`);
    await Bun.sleep(10);
  }
}

/**
 * Until `read()` has not changed for 500 ms (the flow it counts has stopped: back-pressure took
 * hold), polled every 50 ms; throws past 20 s (a flow that never stops).
 */
async function settled(read: () => number, what: string): Promise<void> {
  const t0 = Date.now();
  let last = read();
  let since = Date.now();
  while (Date.now() - since < 500) {
    if (Date.now() - t0 > 20_000) throw new Error(`${what} still moving after 20 s`);
    await Bun.sleep(50);
    const now = read();
    if (now !== last) {
      last = now;
      since = Date.now();
    }
  }
}

beforeAll(async () => {
  dir = mkdtempSync(join(tmpdir(), "sandboxd-connect-"));
  gw = await startGateway({
    port: 0,
    dataDir: dir,
    agent,
    clock: () => Date.now() + skew.ms,
    log: () => {},
  });
  agent.addReadyTemplate("web", [HTTP_PORT, ECHO_PORT, SOURCE_PORT, CDP_PORT]);
  await gw.withDb(async (db) => {
    await upsertPublicTemplate({ db, clock: Date.now }, { id: "web", name: "web", description: "ports" });
    pro = (await createKey(db, gw.config.keyPepper, { tenant: "acme", tier: "pro" })).key;
    pro2 = (await createKey(db, gw.config.keyPepper, { tenant: "other", tier: "pro" })).key;
    demo = (await createKey(db, gw.config.keyPepper, { tenant: "small", tier: "demo" })).key;
  });

  // The guest's services, as loopback servers.
  const web = createHttpServer((req, res) => {
    if (req.url === "/page") {
      res.writeHead(200, { "content-type": "text/html" });
      res.end("<!doctype html><title>relay page</title><p>hello through the relay</p>");
      return;
    }
    const body = `hello from the guest, ${req.method} ${req.url}`;
    res.writeHead(200, { "content-type": "text/plain", "content-length": Buffer.byteLength(body) });
    res.end(body);
  });
  agent.tunnelTargets.set(HTTP_PORT, await listen(web));
  const echo = createServer((s) => s.pipe(s));
  agent.tunnelTargets.set(ECHO_PORT, await listen(echo));
}, 60_000);

afterAll(async () => {
  console.log(`connect figures: ${JSON.stringify(figures)}`);
  await gw?.stop();
  for (const s of servers) s.close();
  rmSync(dir, { recursive: true, force: true });
});

describe("connect (tcp)", () => {
  test("a WebSocket client speaks raw HTTP to the guest's port through a minted connect URL", async () => {
    const id = await sandbox();
    const ws = await mustOpen(await connectUrl(id, HTTP_PORT));
    const chunks: Buffer[] = [];
    ws.on("message", (data, isBinary) => {
      expect(isBinary).toBe(true);
      chunks.push(data as Buffer);
    });
    const end = closed(ws);
    ws.send(Buffer.from("GET /hello HTTP/1.1\r\nHost: guest\r\nConnection: close\r\n\r\n"));
    // The guest's server closes after its answer: the relay ends with 1000.
    expect((await end).code).toBe(1000);
    const text = Buffer.concat(chunks).toString();
    expect(text).toStartWith("HTTP/1.1 200 OK\r\n");
    expect(text).toEndWith("hello from the guest, GET /hello");
    await until(() => agent.openTunnelSockets.size === 0, "the tunnel to close");
  });

  test("20 MB echo arrives intact (sha256), with back-pressure", async () => {
    const id = await sandbox();
    const ws = await mustOpen(await connectUrl(id, ECHO_PORT));
    const data = randomBytes(20 * MB);
    const want = createHash("sha256").update(data).digest("hex");
    const got = createHash("sha256");
    let received = 0;
    const done = new Promise<void>((resolve) => {
      ws.on("message", (chunk: Buffer) => {
        got.update(chunk);
        received += chunk.length;
        if (received >= data.length) resolve();
      });
    });
    const t0 = performance.now();
    for (let off = 0; off < data.length; off += 64 * 1024) ws.send(data.subarray(off, off + 64 * 1024));
    await done;
    const secs = (performance.now() - t0) / 1000;
    figures.echo_20mb_mb_per_s = Math.round((20 / secs) * 10) / 10;
    expect(received).toBe(data.length);
    expect(got.digest("hex")).toBe(want);
    ws.close(1000);
    await closed(ws);
  }, 60_000);

  test("back-pressure: a guest that does not read stops the gateway reading the client, and back", async () => {
    // Client -> guest: the guest reads nothing for a while.
    let guest: Socket | undefined;
    const stalled = createServer((s) => {
      guest = s;
      s.pause();
    });
    agent.tunnelTargets.set(ECHO_PORT, await listen(stalled));
    const id = await sandbox();
    const ws = await mustOpen(await connectUrl(id, ECHO_PORT));
    const data = randomBytes(48 * MB);
    for (let off = 0; off < data.length; off += 64 * 1024) ws.send(data.subarray(off, off + 64 * 1024));
    await settled(() => ws.bufferedAmount, "the client's queue");
    // What the gateway did not take is still in the client's queue: the kernel buffers on the way
    // hold some MB, the gateway itself at most ~1 MiB above its high-water mark.
    figures.client_queue_while_guest_stalled_mb = Math.round(ws.bufferedAmount / MB);
    expect(ws.bufferedAmount).toBeGreaterThan(24 * MB);
    let got = 0;
    const hash = createHash("sha256");
    const all = new Promise<void>((resolve) => {
      guest!.on("data", (b: Buffer) => {
        hash.update(b);
        got += b.length;
        if (got === data.length) resolve();
      });
    });
    guest!.resume();
    await all;
    expect(hash.digest("hex")).toBe(createHash("sha256").update(data).digest("hex"));
    ws.close(1000);
    await closed(ws);

    // Guest -> client: the client reads nothing for a while; the guest's writes back up.
    const payload = randomBytes(48 * MB);
    const sourceServer = createServer((s) => s.end(payload));
    agent.tunnelTargets.set(SOURCE_PORT, await listen(sourceServer));
    const id2 = await sandbox();
    const readBefore = agent.tunnelBytesRead;
    const ws2 = await mustOpen(await connectUrl(id2, SOURCE_PORT));
    ws2.pause();
    await settled(() => agent.tunnelBytesRead, "the reads from the guest");
    // The gateway stopped reading the tunnel: what it read sits in its send queue (~1 MiB) and in
    // the kernel buffers to the client; without back-pressure it would have read all 48 MB.
    const readWhileStalled = agent.tunnelBytesRead - readBefore;
    figures.read_from_guest_while_client_stalled_mb = Math.round(readWhileStalled / MB);
    expect(readWhileStalled).toBeLessThan(24 * MB);
    const hash2 = createHash("sha256");
    let got2 = 0;
    const end2 = closed(ws2);
    ws2.on("message", (b: Buffer) => {
      hash2.update(b);
      got2 += b.length;
    });
    ws2.resume();
    expect((await end2).code).toBe(1000);
    expect(got2).toBe(payload.length);
    expect(hash2.digest("hex")).toBe(createHash("sha256").update(payload).digest("hex"));
    agent.tunnelTargets.set(ECHO_PORT, (servers[1]!.address() as { port: number }).port);
  }, 60_000);

  test("expired, foreign-sandbox, foreign-tenant and revoked tokens: 401 before any upgrade", async () => {
    const a = await sandbox();
    const b = await sandbox();
    const theirs = await sandbox(pro2);
    const before = agent.tunnelsOpened.length;
    const refused = async (url: string) => {
      const o = await wsOpen(url);
      expect("status" in o ? o.status : 101).toBe(401);
      if ("status" in o) expect(JSON.parse(o.body).code).toBe("unauthorized");
    };

    const expiring = await connectUrl(a, ECHO_PORT, "tcp", 60);
    skew.ms = 61_000;
    try {
      await refused(expiring);
    } finally {
      skew.ms = 0;
    }
    // a's token on b (same tenant), and the other tenant's token on a.
    const forA = new URL(await connectUrl(a, ECHO_PORT));
    await refused(forA.href.replace(`/sandboxes/${a}/`, `/sandboxes/${b}/`));
    const forTheirs = new URL(await connectUrl(theirs, ECHO_PORT, "tcp", 300, pro2));
    await refused(forTheirs.href.replace(`/sandboxes/${theirs}/`, `/sandboxes/${a}/`));
    // Another port or protocol than the token's.
    await refused(forA.href.replace(`port=${ECHO_PORT}`, `port=${HTTP_PORT}`));
    await refused(forA.href.replace("protocol=tcp", "protocol=cdp"));
    // Deleting the sandbox revokes its tokens.
    expect((await api("DELETE", `/v1/sandboxes/${a}`, pro)).status).toBe(200);
    await refused(forA.href);
    expect(agent.tunnelsOpened.length).toBe(before);
  });

  test("revoking the key that minted a connect URL revokes the URL; the tenant's other keys' stand", async () => {
    const minter = await gw.withDb((db) =>
      createKey(db, gw.config.keyPepper, { tenant: "acme", tier: "pro" }),
    );
    const id = await sandbox();
    const byMinter = await connectUrl(id, ECHO_PORT, "tcp", 300, minter.key);
    const byOther = await connectUrl(id, ECHO_PORT, "tcp", 300, pro);
    const ok = await mustOpen(byMinter); // works before the revocation
    ok.close(1000);
    await closed(ok);

    expect(await gw.withDb((db) => revokeKey(db, minter.keyId))).toBe(true);
    const o = await wsOpen(byMinter);
    expect("status" in o ? o.status : 101).toBe(401);
    if ("status" in o) expect(JSON.parse(o.body).code).toBe("unauthorized");
    const other = await mustOpen(byOther); // minted by another, live key of the same tenant
    other.close(1000);
    await closed(other);
  });

  test("an open relay closes when its sandbox is deleted", async () => {
    const id = await sandbox();
    const ws = await mustOpen(await connectUrl(id, ECHO_PORT));
    // The relay works...
    const echoed = new Promise<string>((resolve) => ws.once("message", (b: Buffer) => resolve(b.toString())));
    ws.send(Buffer.from("ping"));
    expect(await echoed).toBe("ping");
    const end = closed(ws);
    expect((await api("DELETE", `/v1/sandboxes/${id}`, pro)).status).toBe(200);
    expect(await end).toEqual({ code: 1001, reason: "sandbox deleted" });
    await until(() => agent.openTunnelSockets.size === 0, "the tunnel to close");
  });

  test("Bearer-key connects: 409 port_not_exposed, 403 demo_tier_limit, 404 foreign, 400 without Upgrade", async () => {
    const id = await sandbox();
    const base = `${gw.url.replace(/^http/, "ws")}/v1/sandboxes/${id}/connect`;
    const key = (k: string) => ({ authorization: `Bearer ${k}` });
    const o409 = await wsOpen(`${base}?port=9999`, key(pro));
    expect("status" in o409 && [o409.status, JSON.parse(o409.body).code]).toEqual([409, "port_not_exposed"]);
    const o404 = await wsOpen(`${base}?port=${ECHO_PORT}`, key(pro2));
    expect("status" in o404 && o404.status).toBe(404);
    const demoId = await sandbox(demo);
    const o403 = await wsOpen(
      `${gw.url.replace(/^http/, "ws")}/v1/sandboxes/${demoId}/connect?port=${ECHO_PORT}`,
      key(demo),
    );
    expect("status" in o403 && [o403.status, JSON.parse(o403.body).code]).toEqual([403, "demo_tier_limit"]);
    // A key works as well as a token.
    const ok = await wsOpen(`${base}?port=${ECHO_PORT}`, key(pro));
    expect("ws" in ok).toBe(true);
    if ("ws" in ok) {
      ok.ws.close(1000);
      await closed(ok.ws);
    }
    // A plain GET (no Upgrade) passes every check and is 400.
    const plain = await fetch(`${gw.url}/v1/sandboxes/${id}/connect?port=${ECHO_PORT}`, {
      headers: key(pro),
    });
    expect(plain.status).toBe(400);
    expect(((await plain.json()) as { code: string }).code).toBe("bad_request");
    const tokenPlain = await fetch((await connectUrl(id, ECHO_PORT)).replace(/^ws/, "http"));
    expect(tokenPlain.status).toBe(400);
  });

  test("a failure after the upgrade closes the WebSocket with 1011 and the reason", async () => {
    // cdp to a port that is not DevTools (the echo server answers its own request back).
    const id = await sandbox();
    const o = await wsOpen(await connectUrl(id, ECHO_PORT, "cdp"));
    if (!("ws" in o)) throw new Error(`refused: ${o.status}`);
    const end = await o.closed;
    expect(end.code).toBe(1011);
    expect(end.reason).toStartWith("devtools: GET /json/version");
    await until(() => agent.openTunnelSockets.size === 0, "the tunnel to close");
  });
});

describe.skipIf(CHROMIUM === undefined)("connect (cdp)", () => {
  let chrome: ChildProcess | undefined;
  let profile = "";

  afterAll(async () => {
    // Its own process group: the kill reaches chromium's zygote and renderers too, and the
    // profile (its TMPDIR as well) is removed only once they are gone, so none writes into it
    // after the removal.
    if (chrome?.pid !== undefined && chrome.exitCode === null) {
      const gone = new Promise((resolve) => chrome?.once("exit", resolve));
      process.kill(-chrome.pid, "SIGKILL");
      await gone;
    }
    if (profile) rmSync(profile, { recursive: true, force: true });
  });

  test("Playwright connectOverCDP through the connect URL opens a page and reads its title", async () => {
    profile = mkdtempSync(join(tmpdir(), "sandboxd-chromium-"));
    // The flags this machine needs: no network (QUIC, component updates, sync off), no GPU, no
    // setuid sandbox as root.
    chrome = spawn(
      CHROMIUM!,
      [
        "--headless",
        "--no-sandbox",
        ...CHROMIUM_FLAGS,
        "--remote-debugging-port=0",
        `--user-data-dir=${profile}`,
        "about:blank",
      ],
      // Chromium's own temp dirs (org.chromium.Chromium.*) go inside the profile, removed with it.
      { stdio: ["ignore", "ignore", "pipe"], detached: true, env: { ...process.env, TMPDIR: profile } },
    );
    let log = "";
    const devtoolsPort = await new Promise<number>((resolve, reject) => {
      const timer = setTimeout(() => reject(new Error(`chromium did not start:\n${log}`)), 30_000);
      chrome!.stderr!.on("data", (b: Buffer) => {
        log += b.toString();
        const m = /DevTools listening on ws:\/\/[^:]+:(\d+)\//.exec(log);
        if (m) {
          clearTimeout(timer);
          resolve(Number(m[1]));
        }
      });
      chrome!.once("exit", (code) => reject(new Error(`chromium exited ${code}:\n${log}`)));
    });
    agent.tunnelTargets.set(CDP_PORT, devtoolsPort);
    const webPort = agent.tunnelTargets.get(HTTP_PORT)!;

    const id = await sandbox();
    const url = await connectUrl(id, CDP_PORT, "cdp");
    const { chromium } = await import("playwright-core");
    const t0 = performance.now();
    const browser = await chromium.connectOverCDP(url, { timeout: 30_000 });
    figures.cdp_connect_ms = Math.round(performance.now() - t0);
    try {
      const context = browser.contexts()[0] ?? (await browser.newContext());
      const page = await context.newPage();
      await page.goto(`http://127.0.0.1:${webPort}/page`);
      expect(await page.title()).toBe("relay page");
      expect(await page.textContent("p")).toBe("hello through the relay");
      await page.close();
    } finally {
      await browser.close();
    }
    // The relay of a deleted sandbox ends; Chromium itself keeps running (it is the guest's).
    expect((await api("DELETE", `/v1/sandboxes/${id}`, pro)).status).toBe(200);
    await until(() => agent.openTunnelSockets.size === 0, "the DevTools tunnels to close");
  }, 90_000);
});
