/**
 * The egress fence's address classifier and resolver, without traffic: every literal spelling a
 * resolver reads, every internal range, the host's own addresses, the operator's ranges, and a
 * resolver stub (names never reach DNS here). The one connection made goes to a server on
 * loopback, to show that the fence connects to the address it checked, not to the name again.
 */
import { expect, test } from "bun:test";
import { createServer, type Server } from "node:net";
import { SandboxdError } from "../../contracts/errors.ts";
import {
  ALLOW_INTERNAL_ENV,
  checkDestination,
  EgressFence,
  formatIp,
  parseCidr,
  parseIpLiteral,
} from "./fence.ts";

/** A fence whose host has one public-looking address, so "own address" is tested too. */
const HOST_ADDR = "203.0.113.9";
const fence = (allowInternal: string[] = [], names: Record<string, string[]> = {}) =>
  new EgressFence({
    allowInternal,
    hostAddresses: () => ["127.0.0.1", "::1", HOST_ADDR, "fe80::1234%eth0", "2001:db8::9"],
    resolve: async (n) => {
      const a = names[n];
      if (!a) throw new Error("ENOTFOUND");
      return a;
    },
  });

const canon = (s: string) => {
  const ip = parseIpLiteral(s);
  return ip === undefined || ip === "malformed" ? ip : formatIp(ip);
};

test("literals are read as the resolver reads them", () => {
  for (const [text, want] of [
    ["127.0.0.1", "127.0.0.1"],
    ["2130706433", "127.0.0.1"],
    ["0177.0.0.1", "127.0.0.1"],
    ["0x7f.1", "127.0.0.1"],
    ["0x7F000001", "127.0.0.1"],
    ["127.1", "127.0.0.1"],
    ["127.0.1", "127.0.0.1"],
    ["0", "0.0.0.0"],
    ["017700000001", "127.0.0.1"],
    ["169.254.43518", "169.254.169.254"],
    ["[::1]", "::1"],
    ["::ffff:127.0.0.1", "::ffff:7f00:1"],
    ["[::FFFF:7f00:1]", "::ffff:7f00:1"],
    ["::127.0.0.1", "::7f00:1"],
    ["64:ff9b::10.0.0.1", "64:ff9b::a00:1"],
    ["fd00:ec2:0:0:0:0:0:254", "fd00:ec2::254"],
    ["2001:db8:0:0:1:0:0:1", "2001:db8::1:0:0:1"],
    ["127.0.0.1.", "127.0.0.1"],
  ] as const) {
    expect(canon(text)).toBe(want);
  }
  // Names are names; dotted numbers no resolver reads are malformed, not names.
  for (const name of ["example.com", "x.0", "1.2.3.example", "0x7f.example"])
    expect(canon(name)).toBeUndefined();
  for (const bad of [
    "256.1.1.1",
    "1.2.3.4.5",
    "08.1",
    "0x.1",
    "1.16777216",
    "4294967296",
    "fe80::1%eth0",
    "1:2:3",
  ]) {
    expect(canon(bad)).toBe("malformed");
  }
});

test("every internal range is refused, in every spelling, with the reason", () => {
  const f = fence();
  const refused: Array<[string, string]> = [
    ["127.0.0.1", "loopback"],
    ["127.0.0.2", "loopback"],
    ["2130706433", "loopback"],
    ["0177.0.0.1", "loopback"],
    ["0x7f.1", "loopback"],
    ["127.1", "loopback"],
    ["127.0.1", "loopback"],
    ["0.0.0.0", "unspecified"],
    ["0", "unspecified"],
    ["::", "unspecified"],
    ["::1", "loopback"],
    ["::ffff:127.0.0.1", "loopback"],
    ["::ffff:7f00:1", "loopback"],
    ["[::ffff:7f00:1]", "loopback"],
    ["::127.0.0.1", "loopback"],
    ["64:ff9b::127.0.0.1", "loopback"],
    ["64:ff9b::169.254.169.254", "cloud metadata"],
    ["2002:7f00:1::", "loopback"],
    ["2002:a00:1::1", "private (RFC 1918)"],
    ["2001:0:4136:e378:8000:63bf:3fff:fdd2", "" /* Teredo: client 192.0.2.45 is public */],
    ["169.254.169.254", "cloud metadata"],
    ["169.254.1.1", "link-local"],
    ["fe80::1", "link-local"],
    ["fd00:ec2::254", "cloud metadata"],
    ["fd12:3456::1", "unique local (ULA)"],
    ["fc00::1", "unique local (ULA)"],
    ["fec0::1", "site-local"],
    ["10.1.2.3", "private (RFC 1918)"],
    ["172.16.0.1", "private (RFC 1918)"],
    ["172.31.255.255", "private (RFC 1918)"],
    ["192.168.1.1", "private (RFC 1918)"],
    ["100.64.0.1", "carrier-grade NAT"],
    ["100.127.255.254", "carrier-grade NAT"],
    ["224.0.0.1", "multicast"],
    ["239.255.255.250", "multicast"],
    ["ff02::1", "multicast"],
    ["255.255.255.255", "broadcast"],
    ["240.0.0.1", "reserved"],
    ["::ffff:0:10.0.0.1", "private (RFC 1918)"],
    [HOST_ADDR, "an address of this host"],
    [`::ffff:${HOST_ADDR}`, "an address of this host"],
    ["2001:db8::9", "an address of this host"],
    ["64:ff9b:1::5", "local-use NAT64"],
  ];
  for (const [addr, why] of refused) {
    const v = f.classify(addr);
    if (why === "") {
      expect(v.ok).toBe(true);
      continue;
    }
    expect({ addr, ok: v.ok }).toEqual({ addr, ok: false });
    if (!v.ok) expect(v.reason).toContain(`(${why})`);
  }
  // Teredo whose client (stored inverted) is loopback: ~127.0.0.1 = 0x80fffffe.
  expect(f.classify("2001:0:4136:e378:8000:63bf:80ff:fffe").ok).toBe(false);
  for (const pub of [
    "93.184.216.34",
    "8.8.8.8",
    "172.32.0.1",
    "100.128.0.1",
    "2606:4700::1111",
    "::ffff:8.8.8.8",
  ]) {
    expect({ pub, v: f.classify(pub) }).toMatchObject({ pub, v: { ok: true } });
  }
  // A v4-mapped address is connected to as its IPv4 address.
  expect(f.classify("::ffff:8.8.8.8")).toEqual({ ok: true, address: "8.8.8.8", family: 4 });
});

test("the operator's ranges open what they name, no more; malformed ranges are refused", () => {
  const f = fence(["127.0.0.2/32", "10.0.0.0/8", "fd00::/8"]);
  expect(f.classify("127.0.0.2").ok).toBe(true);
  expect(f.classify("::ffff:127.0.0.2")).toEqual({ ok: true, address: "127.0.0.2", family: 4 });
  expect(f.classify("127.0.0.3").ok).toBe(false);
  expect(f.classify("127.0.0.1").ok).toBe(false);
  expect(f.classify("10.200.1.1").ok).toBe(true);
  expect(f.classify("64:ff9b::10.0.0.1").ok).toBe(true); // the embedded address is the operator's
  expect(f.classify("fd00:ec2::254").ok).toBe(true);
  expect(f.classify("169.254.169.254").ok).toBe(false);
  expect(f.classify("fc00::1").ok).toBe(false);
  expect(parseCidr("10.1.2.3/8")).toEqual({ family: 4, network: 0x0a000000n, prefix: 8 });
  for (const bad of ["10.0.0.0/33", "::/129", "example.com/8", "10.0.0.0/8/8", "1.2.3.4/x", "256.0.0.0"]) {
    expect(() => new EgressFence({ allowInternal: [bad] })).toThrow(SandboxdError);
  }
  let err: unknown;
  try {
    EgressFence.fromSetting("127.0.0.0/8, nope");
  } catch (e) {
    err = e;
  }
  expect((err as SandboxdError).code).toBe("bad_request");
  expect((err as Error).message).toContain(ALLOW_INTERNAL_ENV);
  expect((err as Error).message).toContain('"nope"');
  const env = EgressFence.fromSetting(" 127.0.0.0/8 ,, ::1 ");
  expect(env.classify("127.9.9.9").ok).toBe(true);
  expect(env.classify("::1").ok).toBe(true);
  expect(EgressFence.fromSetting("").allowInternal).toEqual([]);
  expect(env.allowedRanges).toEqual(["127.0.0.0/8", "::1/128"]);
  expect(fence(["10.1.2.3/8"]).allowedRanges).toEqual(["10.0.0.0/8"]);
});

test("the host's own addresses are read again once they are stale", async () => {
  let addrs = ["198.51.100.7"];
  let reads = 0;
  const f = new EgressFence({
    hostAddresses: () => {
      reads++;
      return addrs;
    },
  });
  expect(f.classify("198.51.100.7").ok).toBe(false);
  for (let i = 0; i < 100; i++) f.classify("198.51.100.8");
  expect(reads).toBe(1); // bounded cost: not once per check
  addrs = ["198.51.100.8"];
  await Bun.sleep(1_100);
  expect(f.classify("198.51.100.8").ok).toBe(false);
  expect(f.classify("198.51.100.7").ok).toBe(true);
});

test("names: resolved once, every address checked, a mix of public and internal refused", async () => {
  const calls: string[] = [];
  const answers: Record<string, string[]> = {
    "pub.test": ["93.184.216.34", "2606:4700::1111"],
    "mixed.test": ["93.184.216.34", "127.0.0.1"],
    "mixed6.test": ["2606:4700::1111", "::ffff:169.254.169.254"],
    "meta.test": ["fd00:ec2::254"],
    "zero.test": ["0.0.0.0"],
    "empty.test": [],
  };
  const f = new EgressFence({
    hostAddresses: () => [],
    resolve: async (n) => {
      calls.push(n);
      const a = answers[n];
      if (!a) throw new Error("ENOTFOUND");
      return a;
    },
  });
  expect(await f.check("PUB.test.", 443)).toEqual({
    ok: true,
    host: "pub.test",
    port: 443,
    address: "93.184.216.34",
    family: 4,
  });
  for (const n of ["mixed.test", "mixed6.test", "meta.test", "zero.test"]) {
    const d = await f.check(n, 80);
    expect({ n, ok: d.ok }).toEqual({ n, ok: false });
    if (!d.ok) {
      expect(d.code).toBe("internal");
      expect(d.reason).toStartWith(`${n} resolves to `);
    }
  }
  const none = await f.check("nowhere.test", 80);
  expect(none).toMatchObject({ ok: false, code: "unresolvable" });
  expect(await f.check("empty.test", 80)).toMatchObject({ ok: false, code: "unresolvable" });
  // Literals and malformed hosts never reach the resolver.
  calls.length = 0;
  expect(await f.check("2130706433", 80)).toMatchObject({ ok: false, code: "internal" });
  expect(await f.check("[::ffff:7f00:1]", 80)).toMatchObject({ ok: false, code: "internal" });
  expect(await f.check("256.0.0.1", 80)).toMatchObject({ ok: false, code: "malformed" });
  expect(await f.check("a b", 80)).toMatchObject({ ok: false, code: "malformed" });
  expect(await f.check("pub.test", 0)).toMatchObject({ ok: false, code: "malformed" });
  expect(calls).toEqual([]);
});

test("checkDestination uses the fence it is given (the operator's from the environment by default)", async () => {
  const f = fence([], { "reg.test": ["10.0.0.5"] });
  expect(await checkDestination("reg.test", 5000, f)).toMatchObject({ ok: false, code: "internal" });
  expect(await checkDestination("169.254.169.254", 80, f)).toMatchObject({ ok: false, code: "internal" });
  const open = fence(["10.0.0.0/24"], { "reg.test": ["10.0.0.5"] });
  expect(await checkDestination("reg.test", 5000, open)).toMatchObject({ ok: true, address: "10.0.0.5" });
});

test("the connection goes to the checked address: a rebinding resolver gets one question", async () => {
  const hits: string[] = [];
  const listen = (host: string) =>
    new Promise<Server>((r) => {
      const s = createServer((sock) => {
        hits.push(host);
        sock.end();
      });
      s.listen(0, host, () => r(s));
    });
  const first = await listen("127.0.0.5");
  const port = (first.address() as { port: number }).port;
  // The rebinding target listens on the same port on another loopback address.
  const second = await new Promise<Server>((r) => {
    const s = createServer((sock) => {
      hits.push("127.0.0.6");
      sock.end();
    });
    s.listen(port, "127.0.0.6", () => r(s));
  });
  let asked = 0;
  const f = new EgressFence({
    allowInternal: ["127.0.0.0/8"],
    resolve: async () => (asked++ === 0 ? ["127.0.0.5"] : ["127.0.0.6"]),
  });
  const d = await f.check("rebind.test", port);
  expect(d).toMatchObject({ ok: true, address: "127.0.0.5" });
  if (!d.ok) throw new Error(d.reason);
  const sock = await f.connect(d);
  expect(sock.remoteAddress).toBe("127.0.0.5");
  await new Promise((r) => sock.once("close", r));
  expect(asked).toBe(1);
  expect(hits).toEqual(["127.0.0.5"]);
  first.close();
  second.close();
});
