/**
 * Egress allow-lists and the host-side egress proxy, with real sockets: the proxy serves real
 * TCP connections on loopback (standing in for the guest's stream channel), and servers on
 * loopback stand in for an allowed and a denied host. Names are pointed at loopback by the
 * fence's resolver, and the operator's range lets the fence reach 127.0.0.1: DNS is the one
 * boundary replaced here (no /etc/hosts edits).
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { createServer, type Server, Socket } from "node:net";
import fc from "fast-check";
import { SandboxdError } from "../../contracts/errors.ts";
import { EgressFence, parseIpLiteral } from "./fence.ts";
import { EgressPolicy } from "./policy.ts";
import { type EgressAttempt, parseHead, serveEgressConnection } from "./proxy.ts";

describe("EgressPolicy", () => {
  test("exact names, *.suffix wildcards, IP literals, *", () => {
    const p = EgressPolicy.fromAllowList(["api.example.com", "*.pkg.dev", "10.0.0.7", "Upper.Example.ORG."]);
    expect(p.allows("api.example.com")).toBe(true);
    expect(p.allows("API.Example.com.")).toBe(true);
    expect(p.allows("upper.example.org")).toBe(true);
    expect(p.allows("www.example.com")).toBe(false);
    expect(p.allows("example.com")).toBe(false);
    expect(p.allows("a.pkg.dev")).toBe(true);
    expect(p.allows("a.b.pkg.dev")).toBe(true);
    expect(p.allows("pkg.dev")).toBe(false);
    expect(p.allows("evilpkg.dev")).toBe(false);
    expect(p.allows("10.0.0.7")).toBe(true);
    expect(p.allows("10.0.0.8")).toBe(false);
    expect(EgressPolicy.fromAllowList(["*"]).allows("anything.at.all")).toBe(true);
    expect(EgressPolicy.byDefault("deny").allows("localhost")).toBe(false);
    expect(EgressPolicy.byDefault("allow").allows("localhost")).toBe(true);
  });

  test("malformed entries are bad_request naming the entry", () => {
    for (const bad of [
      "",
      "http://x.com",
      "a..b",
      "*.",
      "*x.com",
      "x.com/path",
      "-a.com",
      "a b",
      "*.*.com",
    ]) {
      let err: unknown;
      try {
        EgressPolicy.fromAllowList([bad]);
      } catch (e) {
        err = e;
      }
      expect(err).toBeInstanceOf(SandboxdError);
      expect((err as SandboxdError).code).toBe("bad_request");
    }
    expect(() => EgressPolicy.fromAllowList(Array.from({ length: 257 }, (_, i) => `h${i}.com`))).toThrow(
      SandboxdError,
    );
  });

  test("property: a wildcard allows exactly the names strictly below its suffix", () => {
    const label = fc.stringMatching(/^[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?$/);
    // Names, not addresses: dotted numbers (`1.0`) are what the resolver reads as an IPv4 address,
    // which only an exact entry can name.
    const name = fc
      .array(label, { minLength: 1, maxLength: 4 })
      .map((ls) => ls.join("."))
      .filter((n) => parseIpLiteral(n) === undefined);
    fc.assert(
      fc.property(name, name, (suffix, host) => {
        const p = EgressPolicy.fromAllowList([`*.${suffix}`]);
        const below = host.endsWith(`.${suffix}`);
        expect(p.allows(host)).toBe(below);
        expect(p.allows(suffix)).toBe(false);
        expect(p.allows(`x.${suffix}`)).toBe(true);
      }),
      { numRuns: 500 },
    );
  });
});

describe("egress proxy over real loopback sockets", () => {
  let allowedOrigin: Server;
  let deniedOrigin: Server;
  let proxy: Server;
  let deniedHits = 0;
  const seen: string[] = [];
  const attempts: EgressAttempt[] = [];
  const logs: string[] = [];
  const port = (s: Server) => (s.address() as { port: number }).port;

  beforeAll(async () => {
    allowedOrigin = createServer((sock) => {
      let buf = "";
      sock.on("data", (d) => {
        buf += d.toString();
        if (buf.startsWith("PING")) sock.write("PONG");
        else if (buf.includes("\r\n\r\n")) {
          seen.push(buf.split("\r\n")[0]!);
          sock.end("HTTP/1.1 200 OK\r\nContent-Length: 7\r\nConnection: close\r\n\r\norigin!");
        }
      });
    });
    deniedOrigin = createServer((sock) => {
      deniedHits++;
      sock.end("should never be reached");
    });
    await Promise.all([
      new Promise<void>((r) => allowedOrigin.listen(0, "127.0.0.1", r)),
      new Promise<void>((r) => deniedOrigin.listen(0, "127.0.0.1", r)),
    ]);
    const policy = EgressPolicy.fromAllowList(["api.allowed.test", "*.allowed.test", "localhost"]);
    // The test hosts' names resolve to the loopback servers, which the operator's range opens.
    const fence = new EgressFence({
      allowInternal: ["127.0.0.1/32"],
      resolve: async (name) => (name.endsWith(".test") ? ["127.0.0.1"] : []),
    });
    proxy = createServer((sock) => {
      void serveEgressConnection(sock, {
        sandboxId: "sbx-test",
        policy,
        fence,
        onAttempt: (a) => attempts.push(a),
        log: (m) => logs.push(m),
      });
    });
    await new Promise<void>((r) => proxy.listen(0, "127.0.0.1", r));
  });

  afterAll(() => {
    for (const s of [allowedOrigin, deniedOrigin, proxy]) s.close();
  });

  /** Sends `request` to the proxy; resolves with everything received until close (or `until`). */
  function talk(
    request: string,
    opts: { send?: string; until?: string } = {},
  ): Promise<{ text: string; ms: number }> {
    const t0 = performance.now();
    return new Promise((resolve, reject) => {
      const s = new Socket();
      let text = "";
      s.on("data", (d) => {
        text += d.toString();
        if (opts.send && text.includes("\r\n\r\n") && text.startsWith("HTTP/1.1 200")) {
          s.write(opts.send);
          opts.send = undefined;
        }
        if (opts.until && text.includes(opts.until)) s.end();
      });
      s.on("close", () => resolve({ text, ms: performance.now() - t0 }));
      s.on("error", reject);
      s.connect({ host: "127.0.0.1", port: port(proxy) }, () => s.write(request));
    });
  }

  test("CONNECT to an allowed host: 200, then raw bytes both ways", async () => {
    const hp = `api.allowed.test:${port(allowedOrigin)}`;
    const r = await talk(`CONNECT ${hp} HTTP/1.1\r\nHost: ${hp}\r\n\r\n`, { send: "PING", until: "PONG" });
    expect(r.text).toStartWith("HTTP/1.1 200 Connection established\r\n\r\n");
    expect(r.text).toEndWith("PONG");
  });

  test("plain HTTP through the proxy reaches the origin in origin form", async () => {
    const r = await talk(
      `GET http://cdn.allowed.test:${port(allowedOrigin)}/health?x=1 HTTP/1.1\r\nHost: cdn.allowed.test\r\nProxy-Connection: keep-alive\r\n\r\n`,
    );
    expect(r.text).toStartWith("HTTP/1.1 200 OK");
    expect(r.text).toEndWith("origin!");
    expect(seen.at(-1)).toBe("GET /health?x=1 HTTP/1.1");
  });

  test("a denied host is refused at once with 403, logged, and never contacted", async () => {
    const before = deniedHits;
    for (const req of [
      "CONNECT evil.test:443 HTTP/1.1\r\nHost: evil.test:443\r\n\r\n",
      "GET http://evil.test/ HTTP/1.1\r\nHost: evil.test\r\n\r\n",
      "CONNECT allowed.test:443 HTTP/1.1\r\n\r\n", // the bare suffix of a wildcard
      "CONNECT 127.0.0.9:22 HTTP/1.1\r\n\r\n", // an IP literal no entry names
    ]) {
      const r = await talk(req);
      expect(r.text).toStartWith("HTTP/1.1 403 Forbidden");
      expect(r.text).toContain("X-Sandboxd-Egress: denied");
      // Only catches a hang (a refusal that waited on the denied host); never contacted: below.
      expect(r.ms).toBeLessThan(10_000);
    }
    expect(deniedHits).toBe(before);
    const refused = attempts.filter((a) => !a.allowed).map((a) => `${a.host}:${a.port}`);
    expect(refused).toEqual(["evil.test:443", "evil.test:80", "allowed.test:443", "127.0.0.9:22"]);
    expect(logs.filter((l) => l.includes("egress denied: sandbox sbx-test -> evil.test"))).toHaveLength(2);
  });

  test("the default fence resolves names with the host's resolver", async () => {
    const fence = new EgressFence({ allowInternal: ["127.0.0.0/8", "::1"] });
    const d = await fence.check("localhost", port(allowedOrigin));
    if (!d.ok) throw new Error(d.reason);
    const sock = await fence.connect(d);
    const got = await new Promise<string>((resolve) => {
      sock.once("data", (d) => resolve(d.toString()));
      sock.write("PING");
    });
    expect(got).toBe("PONG");
    sock.destroy();
  });

  test("malformed requests get 400, an unreachable allowed port 502, both at once", async () => {
    for (const req of [
      "hello\r\n\r\n",
      "CONNECT api.allowed.test HTTP/1.1\r\n\r\n",
      "GET /relative HTTP/1.1\r\n\r\n",
    ]) {
      const r = await talk(req);
      expect(r.text).toStartWith("HTTP/1.1 400 Bad Request");
    }
    // The guest's own loopback with no route back into a guest (this proxy has none): 502.
    const r = await talk("CONNECT localhost:1 HTTP/1.1\r\n\r\n");
    expect(r.text).toStartWith("HTTP/1.1 502 Bad Gateway");
    expect(r.ms).toBeLessThan(10_000); // only catches a hang, on a loaded host
  });
});

test("no tenant entry reaches the host's own addresses, the operator's range does; the guest's own loopback stays in the guest", async () => {
  const origin = createServer((s) => s.end("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"));
  await new Promise<void>((r) => origin.listen(0, "127.0.0.2", r));
  const originPort = (origin.address() as { port: number }).port;
  const ask = async (allow: string[], target: string, allowInternal: string[] = []): Promise<string> => {
    const proxy = createServer((sock) => {
      void serveEgressConnection(sock, {
        sandboxId: "sbx-int",
        policy: EgressPolicy.fromAllowList(allow),
        fence: new EgressFence({ allowInternal }),
        // The guest's own loopback: here the origin plays the server inside the guest.
        connectLocal: (p) =>
          new EgressFence({ allowInternal: ["127.0.0.2"] }).connect({
            address: "127.0.0.2",
            port: p,
            family: 4,
          }),
      });
    });
    await new Promise<void>((r) => proxy.listen(0, "127.0.0.1", r));
    const text = await new Promise<string>((resolve, reject) => {
      const s = new Socket();
      let got = "";
      s.on("data", (d) => {
        got += d.toString();
      });
      s.on("close", () => resolve(got));
      s.on("error", reject);
      s.connect({ host: "127.0.0.1", port: (proxy.address() as { port: number }).port }, () =>
        s.write(`GET http://${target}:${originPort}/ HTTP/1.1\r\nHost: ${target}\r\n\r\n`),
      );
    });
    proxy.close();
    return text;
  };
  expect(await ask(["*"], "127.0.0.2")).toStartWith("HTTP/1.1 403");
  expect(await ask(["*.allowed.test", "*"], "127.0.0.2")).toStartWith("HTTP/1.1 403");
  expect(await ask(["127.0.0.2"], "127.0.0.2")).toStartWith("HTTP/1.1 403");
  expect(await ask(["127.0.0.2"], "127.0.0.2", ["127.0.0.2/32"])).toEndWith("ok");
  expect(await ask(["*"], "127.0.0.2", ["127.0.0.0/30"])).toEndWith("ok");
  // Other spellings of the origin's address, listed exactly or under `*`: refused, never routed
  // into the guest as its own loopback either.
  for (const spelling of [
    "2130706434",
    "127.2",
    "0x7f.0.0.2",
    "0177.0.0.2",
    "[::ffff:127.0.0.2]",
    "[::ffff:7f00:2]",
  ]) {
    expect(await ask(["*"], spelling)).toStartWith("HTTP/1.1 403");
    expect(await ask([spelling], spelling)).toStartWith("HTTP/1.1 403");
  }
  expect(parseHead(Buffer.from("GET http://127.1:8/x HTTP/1.1\r\n\r\n"))).toMatchObject({
    host: "127.1",
    port: 8,
  });
  // The operator's range opens what it names, no more.
  expect(await ask(["*"], "127.0.0.2", ["127.0.0.3/32"])).toStartWith("HTTP/1.1 403");
  // localhost / 127.0.0.1 / ::1 mean the sandbox itself: routed back into it, whatever the list.
  for (const local of ["localhost", "127.0.0.1"]) expect(await ask([], local)).toEndWith("ok");
  origin.close();
});

describe("splice", () => {
  test("a destination that answers and closes at once still reaches a slow client whole", async () => {
    // The client reads slowly (as a guest tunnel does, one credit window at a time); the
    // destination writes its whole reply, ends and closes before the client has read it.
    const reply = Buffer.alloc(512 * 1024, 7);
    let received = 0;
    const { Duplex } = await import("node:stream");
    let finished!: () => void;
    const done = new Promise<void>((r) => {
      finished = r;
    });
    const client = new Duplex({
      read() {},
      write(chunk: Buffer, _enc, cb) {
        received += chunk.length;
        setTimeout(cb, 2);
      },
      final(cb) {
        finished();
        cb();
      },
    });
    client.push("GET http://localhost:8080/x HTTP/1.1\r\nHost: localhost:8080\r\n\r\n");
    const upstream = new Duplex({
      read() {},
      write(_chunk, _enc, cb) {
        // The request arrived: answer everything, end, and close like a socket whose peer is done.
        this.push(reply);
        this.push(null);
        this.once("end", () => this.destroy());
        cb();
      },
    });
    await serveEgressConnection(client, {
      sandboxId: "sbx-test",
      policy: EgressPolicy.fromAllowList([]),
      connectLocal: async () => upstream,
    });
    await Promise.race([done, Bun.sleep(10_000)]);
    expect(received).toBe(reply.length);
  });
});
