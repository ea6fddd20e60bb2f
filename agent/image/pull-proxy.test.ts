/**
 * The pull proxy and skopeo's namespace, with real parts: skopeo, `unshare --net`, the proxy on a
 * unix socket, and registries on loopback that send the pull elsewhere. The pull grant opens only
 * 127.0.0.2/32 (the registries); a canary listens on the host's own address (refused by the fence
 * in the proxy) and one on 127.0.0.3 (loopback: nothing behind it inside the namespace). Every
 * test ends by counting the canaries' connections: none.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdtemp, rm } from "node:fs/promises";
import { createServer as createHttpServer, type Server as HttpServer } from "node:http";
import { type AddressInfo, connect, createServer, type Server } from "node:net";
import { networkInterfaces, tmpdir } from "node:os";
import { join } from "node:path";
import type { SandboxdError } from "../../contracts/errors.ts";
import { EgressFence } from "../egress/fence.ts";
import { runTool } from "../host/tool.ts";
import { pullImage, type RegistryConfig } from "./pull.ts";
import { MAX_HEAD_BYTES, startPullProxy } from "./pull-proxy.ts";
import { inPullNamespace } from "./skopeo.ts";

/** The host's own non-loopback IPv4 address: the fence refuses it ("an address of this host"). */
const HOST_ADDR = Object.values(networkInterfaces())
  .flat()
  .find((a) => a && a.family === "IPv4" && !a.internal)?.address;
const ROOT = process.getuid?.() === 0;
const READY = ROOT && !!Bun.which("skopeo") && !!Bun.which("unshare") && HOST_ADDR !== undefined;

interface Canary {
  host: string;
  hits: () => number;
  close: () => void;
}

/** A TCP server that counts every connection it is offered and answers nothing. */
async function canary(address: string): Promise<Canary> {
  let hits = 0;
  const s: Server = createServer((c) => {
    hits++;
    c.destroy();
  });
  await new Promise<void>((ok) => s.listen(0, address, ok));
  return {
    host: `${address}:${(s.address() as AddressInfo).port}`,
    hits: () => hits,
    close: () => s.close(),
  };
}

/** A registry on 127.0.0.2 answering with `handler` for everything but what it handles itself. */
async function fakeRegistry(
  handler: (path: string) => { status: number; headers: Record<string, string | undefined> },
): Promise<{ host: string; requests: string[]; close: () => void }> {
  const requests: string[] = [];
  const s: HttpServer = createHttpServer((req, res) => {
    requests.push(`${req.method} ${req.url}`);
    const a = handler(req.url ?? "/");
    res.writeHead(a.status, { "Content-Length": "0", ...(a.headers as Record<string, string>) });
    res.end();
  });
  await new Promise<void>((ok) => s.listen(0, "127.0.0.2", ok));
  return {
    host: `127.0.0.2:${(s.address() as AddressInfo).port}`,
    requests,
    close: () => s.close(),
  };
}

describe.skipIf(!READY)("every hop of a pull goes through the fence", () => {
  const fence = new EgressFence({ allowInternal: ["127.0.0.2/32"] });
  const registry: RegistryConfig = {
    insecureRegistries: [],
    checkDestination: async (host, port) => {
      const d = await fence.check(host, port);
      if (!d.ok) throw new Error(d.reason);
    },
    fence,
  };
  let work: string;
  let outside: Canary;
  let loop: Canary;
  beforeAll(async () => {
    work = await mkdtemp(join(tmpdir(), "sbx-pull-proxy-"));
    outside = await canary(HOST_ADDR!);
    loop = await canary("127.0.0.3");
  });
  afterAll(async () => {
    outside?.close();
    loop?.close();
    if (work) await rm(work, { recursive: true, force: true });
  });
  const refused = async (reference: string) => {
    try {
      await pullImage({ reference, cacheDir: join(work, "cache"), registry, inspectTimeoutMs: 30_000 });
    } catch (e) {
      return e as SandboxdError;
    }
    throw new Error(`pull of ${reference} succeeded`);
  };
  const causes = (e: unknown): string => {
    const out: string[] = [];
    for (let c = e as { message?: string; cause?: unknown } | undefined; c; c = c.cause as typeof c)
      out.push(String(c.message));
    return out.join(" <- ");
  };

  test("a redirect to an address the fence refuses: registry_forbidden, the canary gets nothing", async () => {
    for (const scheme of ["http", "https"]) {
      const reg = await fakeRegistry((path) =>
        path === "/v2/"
          ? { status: 200, headers: {} }
          : { status: 302, headers: { Location: `${scheme}://${outside.host}/v2/x/manifests/1` } },
      );
      try {
        const e = await refused(`${reg.host}/x:1`);
        expect(e.code).toBe("image_pull_failed");
        expect(e.details?.reason).toBe("registry_forbidden");
        expect(e.message).toBe(
          `looking up ${reg.host}/x:1 failed: the registry sent the pull to an address that is not allowed`,
        );
        // The fence's own words are kept for the agent's log, never in the tenant's text.
        expect(causes(e)).toContain(`pull proxy refused ${outside.host}: ${HOST_ADDR} is internal`);
        expect(e.message).not.toContain(HOST_ADDR!);
        expect(reg.requests.some((r) => r.includes("/manifests/"))).toBe(true); // it did redirect
      } finally {
        reg.close();
      }
    }
    expect(outside.hits()).toBe(0);
  }, 60_000);

  test("a token realm the fence refuses: the canary gets nothing", async () => {
    const challenge = `Bearer realm="http://${outside.host}/token",service="reg",scope="repository:x:pull"`;
    const reg = await fakeRegistry(() => ({ status: 401, headers: { "WWW-Authenticate": challenge } }));
    try {
      const e = await refused(`${reg.host}/x:1`);
      expect(e.details?.reason).toBe("registry_forbidden");
      expect(causes(e)).toContain(`pull proxy refused ${outside.host}`);
    } finally {
      reg.close();
    }
    expect(outside.hits()).toBe(0);
  }, 60_000);

  test("a redirect or token realm on another loopback address has nothing behind it", async () => {
    // Go never proxies a loopback address: skopeo dials it itself, inside its namespace, where
    // only the registry's own address and port are tunnelled (to the proxy, fenced).
    const reg = await fakeRegistry((path) =>
      path === "/v2/"
        ? { status: 401, headers: { "WWW-Authenticate": `Bearer realm="http://${loop.host}/token"` } }
        : { status: 302, headers: { Location: `http://${loop.host}/v2/x/manifests/1` } },
    );
    try {
      const e = await refused(`${reg.host}/x:1`);
      expect(e.code).toBe("image_pull_failed");
      expect(e.details?.reason).toBe("registry_unreachable");
    } finally {
      reg.close();
    }
    expect(loop.hits()).toBe(0);
  }, 60_000);

  test("from inside the namespace, a direct connection reaches nothing", async () => {
    const proxy = await startPullProxy({ socket: join(work, "p.sock"), fence });
    try {
      // Tries each address directly and prints what happened; the proxy variables are ignored.
      const script = `
        const net = require("node:net");
        const tryOne = (host, port) => new Promise((ok) => {
          const s = net.connect({ host, port }, () => { s.destroy(); ok("connected"); });
          s.on("error", (e) => ok(e.code));
          setTimeout(() => { s.destroy(); ok("timeout"); }, 3000);
        });
        const out = [];
        for (const h of process.argv.slice(1)) {
          const i = h.lastIndexOf(":");
          out.push(await tryOne(h.slice(0, i), Number(h.slice(i + 1))));
        }
        console.log(JSON.stringify(out));`;
      const inNs = async (command: string[]) => {
        const ns = inPullNamespace(command, { socket: proxy.socket, tunnels: [] });
        return (await runTool(ns.argv, { env: ns.env, timeoutMs: 30_000 })).stdout.toString();
      };
      const targets = [outside.host, loop.host, "1.1.1.1:443", "[2606:4700::1111]:443"];
      const results = JSON.parse(await inNs([process.execPath, "-e", script, ...targets])) as string[];
      // (Bun reports ENETUNREACH as ECONNREFUSED; the routing table below says which it is.)
      expect(results).toHaveLength(targets.length);
      for (const r of results) expect(r).not.toBe("connected");
      // No route at all but loopback's: the main tables hold nothing for IPv4 and only ::1 for IPv6.
      expect(await inNs(["ip", "-4", "route", "show", "table", "main"])).toBe("");
      expect((await inNs(["ip", "-6", "route", "show", "table", "main"])).trim()).toMatch(
        /^(::1 dev lo[^\n]*)?$/,
      );
      expect(await inNs(["ip", "-o", "link", "show", "up"])).not.toMatch(/^\d+: (?!lo:)/m);
      expect(proxy.connections).toBe(0); // nothing went to the proxy either
    } finally {
      await proxy.close();
    }
    expect(outside.hits()).toBe(0);
    expect(loop.hits()).toBe(0);
  }, 60_000);

  test("the proxy answers what it refuses, and bounds a request head", async () => {
    const proxy = await startPullProxy({ socket: join(work, "q.sock"), fence });
    const ask = (text: string) =>
      new Promise<string>((ok) => {
        let got = "";
        const s = connect(proxy.socket, () => s.write(text));
        s.on("data", (b) => {
          got += b.toString();
        });
        s.on("close", () => ok(got));
        s.on("error", () => ok(got));
      });
    try {
      expect(await ask(`CONNECT ${outside.host} HTTP/1.1\r\nHost: x\r\n\r\n`)).toStartWith("HTTP/1.1 403 ");
      expect(await ask(`GET http://${loop.host}/ HTTP/1.1\r\nHost: x\r\n\r\n`)).toStartWith("HTTP/1.1 403 ");
      expect(await ask(`GET /relative HTTP/1.1\r\nHost: x\r\n\r\n`)).toStartWith("HTTP/1.1 400 ");
      expect(
        await ask(`GET http://127.0.0.2:1/ HTTP/1.1\r\nX: ${"a".repeat(MAX_HEAD_BYTES)}\r\n\r\n`),
      ).toStartWith("HTTP/1.1 431 ");
      expect(proxy.refused).toEqual([
        `${outside.host}: ${HOST_ADDR} is internal (an address of this host)`,
        `${loop.host}: 127.0.0.3 is internal (loopback)`,
      ]);
    } finally {
      await proxy.close();
    }
    expect(outside.hits()).toBe(0);
    expect(loop.hits()).toBe(0);
  });
});
