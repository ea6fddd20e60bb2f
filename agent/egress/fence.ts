/**
 * The egress fence: the ONE way the agent turns a destination (a name or an address literal, as a
 * tenant wrote it) into an address it may connect to. The sandbox egress proxy (proxy.ts) and the
 * registry pull path use it; nothing else in the agent resolves a tenant-chosen destination.
 *
 *   const fence = EgressFence.fromSetting(text);   // the operator's; `new EgressFence({...})` in tests
 *   const d = await checkDestination(host, port, fence);  // = fence.check(host, port)
 *   if (!d.ok) refuse(d.reason);                   // d.code: internal | malformed | unresolvable
 *   else sock = await fence.connect(d);            // TCP to d.address, the checked address
 *
 * `d.address` is the address to use from then on: a caller that hands the connection to another
 * program (the registry pull's skopeo) must make it connect to that address, not resolve the
 * name again. `check` never throws; `d.host` is the host as normalized (lower case, no brackets).
 *
 * - Literals are read the way the resolver (`inet_aton`) reads them: `2130706433`, `0177.0.0.1`,
 *   `0x7f.1`, `127.1`, `127.0.1`; IPv6 in or out of brackets, with IPv4 inside it (v4-mapped
 *   `::ffff:127.0.0.1` / `::ffff:7f00:1`, v4-compatible `::127.0.0.1`, NAT64 `64:ff9b::/96`,
 *   6to4 `2002::/16`, Teredo `2001::/32`): the embedded IPv4 address is checked too. A host made
 *   of numbers only is an IPv4 literal or malformed, never a name.
 * - A name is resolved ONCE (with `all`), EVERY address it resolves to is checked, and the
 *   connection goes to the checked address: a name cannot pass the check with one answer and
 *   connect with another (DNS rebinding), nor hide an internal address behind a public one.
 * - Internal, hence refused: loopback, unspecified, link-local (cloud metadata 169.254.169.254
 *   among it), RFC 1918, CGNAT 100.64/10, IETF/benchmark special ranges, multicast, reserved
 *   240/4 with broadcast, ULA fc00::/7 (IPv6 metadata fd00:ec2::254 among it), site-local,
 *   local-use NAT64, and every address of the host's own interfaces (re-read at most once a
 *   second). Only the OPERATOR opens a range: `SANDBOXD_EGRESS_ALLOW_INTERNAL=cidr,cidr,...` for
 *   sandboxes, `SANDBOXD_REGISTRY_ALLOW_INTERNAL` for registry pulls (`EgressFence.fromSetting`,
 *   passed in from cli/settings/), never a tenant's `egress.allow`, whose entries only name
 *   destinations.
 */
import { lookup } from "node:dns/promises";
import { Socket } from "node:net";
import { networkInterfaces } from "node:os";
import { normalizeHost } from "../../contracts/egress.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { type Cidr, cidr, formatIp, type Ip, inCidr, parseCidr, parseIpLiteral } from "./ip.ts";

export { type Cidr, formatIp, type Ip, inCidr, parseCidr, parseIpLiteral } from "./ip.ts";

/** The operator's setting: CIDR ranges (or single addresses) the fence lets through. */
export const ALLOW_INTERNAL_ENV = "SANDBOXD_EGRESS_ALLOW_INTERNAL";
/** Resolving a name: getaddrinfo's own retries can take longer; a tenant must not hold a slot. */
export const RESOLVE_TIMEOUT_MS = 10_000;
/** Connect to a checked address: long enough for a slow WAN SYN, not a hang. */
export const CONNECT_TIMEOUT_MS = 10_000;
/** How long the host's interface addresses are trusted before they are read again. */
export const HOST_ADDRESSES_TTL_MS = 1_000;

export type Destination =
  | { ok: true; host: string; port: number; address: string; family: 4 | 6 }
  | {
      ok: false;
      host: string;
      port: number;
      code: "internal" | "malformed" | "unresolvable";
      reason: string;
    };

export interface FenceOptions {
  /** Internal ranges the operator lets through (CIDR text, `127.0.0.2` meaning a /32). */
  allowInternal?: readonly string[];
  /** Name -> every address it resolves to (default: the host's resolver, getaddrinfo). */
  resolve?: (name: string) => Promise<string[]>;
  /** The host's own addresses (default: every address of `os.networkInterfaces()`). */
  hostAddresses?: () => string[];
}

/** Parses the operator's comma-separated list; a bad entry is refused naming it. */
export function parseAllowInternal(text: string, source = ALLOW_INTERNAL_ENV): Cidr[] {
  const out: Cidr[] = [];
  for (const raw of text.split(",")) {
    if (raw.trim() === "") continue;
    const c = parseCidr(raw);
    if (!c) {
      throw new SandboxdError(
        "bad_request",
        `${source}: ${JSON.stringify(raw.trim())} is not an IP address or CIDR range`,
      );
    }
    out.push(c);
  }
  return out;
}

// ---- what is internal --------------------------------------------------------------------------

const V4_INTERNAL: ReadonlyArray<[Cidr, string]> = [
  [cidr("169.254.169.254/32"), "cloud metadata"],
  [cidr("0.0.0.0/8"), "unspecified"],
  [cidr("127.0.0.0/8"), "loopback"],
  [cidr("169.254.0.0/16"), "link-local"],
  [cidr("10.0.0.0/8"), "private (RFC 1918)"],
  [cidr("172.16.0.0/12"), "private (RFC 1918)"],
  [cidr("192.168.0.0/16"), "private (RFC 1918)"],
  [cidr("100.64.0.0/10"), "carrier-grade NAT"],
  // IETF protocol assignments (DS-Lite, NAT64 discovery) and the benchmarking range: never
  // a public service, often a provider's internal network.
  [cidr("192.0.0.0/24"), "IETF special-purpose"],
  [cidr("198.18.0.0/15"), "benchmarking"],
  [cidr("224.0.0.0/4"), "multicast"],
  [cidr("255.255.255.255/32"), "broadcast"],
  [cidr("240.0.0.0/4"), "reserved"],
];

const V6_INTERNAL: ReadonlyArray<[Cidr, string]> = [
  [cidr("::/128"), "unspecified"],
  [cidr("::1/128"), "loopback"],
  [cidr("fd00:ec2::254/128"), "cloud metadata"],
  [cidr("fe80::/10"), "link-local"],
  [cidr("fec0::/10"), "site-local"],
  [cidr("fc00::/7"), "unique local (ULA)"],
  [cidr("ff00::/8"), "multicast"],
  [cidr("64:ff9b:1::/48"), "local-use NAT64"],
  // Every IPv4-compatible address (deprecated): never a real IPv6 destination.
  [cidr("::/96"), "IPv4-compatible IPv6"],
];

const V4_MAPPED = cidr("::ffff:0:0/96");
const V4_TRANSLATED = cidr("::ffff:0:0:0/96");
const V4_COMPAT = cidr("::/96");
const NAT64 = cidr("64:ff9b::/96");
const SIX_TO_FOUR = cidr("2002::/16");
const TEREDO = cidr("2001::/32");
const LOW32 = 0xffffffffn;

/** The IPv4 addresses an IPv6 address carries (NAT64, 6to4, Teredo, compat, translated). */
function embeddedV4(ip: Ip): bigint[] {
  if (ip.family !== 6) return [];
  const v = ip.value;
  // `::` and `::1` are IPv6's own unspecified and loopback addresses, not IPv4-compatible ones.
  const compat = inCidr(ip, V4_COMPAT) && v > 1n;
  if (compat || inCidr(ip, NAT64) || inCidr(ip, V4_TRANSLATED)) {
    return [v & LOW32];
  }
  if (inCidr(ip, SIX_TO_FOUR)) return [(v >> 80n) & LOW32];
  // Teredo: the server's address, and the client's (stored inverted) in the low 32 bits.
  if (inCidr(ip, TEREDO)) return [(v >> 64n) & LOW32, ~v & LOW32];
  return [];
}

const key = (ip: Ip) => `${ip.family}:${ip.value.toString(16)}`;

function defaultHostAddresses(): string[] {
  return Object.values(networkInterfaces()).flatMap((list) => (list ?? []).map((a) => a.address));
}

async function defaultResolve(name: string): Promise<string[]> {
  const answers = await lookup(name, { all: true, verbatim: true });
  return answers.map((a) => a.address);
}

// ---- the fence ---------------------------------------------------------------------------------

export class EgressFence {
  /** The operator's ranges (empty: nothing internal is reachable). */
  readonly allowInternal: readonly Cidr[];
  private readonly resolveName: (name: string) => Promise<string[]>;
  private readonly readHostAddresses: () => string[];
  private hostKeys = new Set<string>();
  private hostKeysAtMs = Number.NEGATIVE_INFINITY;

  constructor(opts: FenceOptions = {}) {
    this.allowInternal = parseAllowInternal((opts.allowInternal ?? []).join(","), "allowInternal");
    this.resolveName = opts.resolve ?? defaultResolve;
    this.readHostAddresses = opts.hostAddresses ?? defaultHostAddresses;
  }

  /** The operator's fence from the setting's text (`SANDBOXD_EGRESS_ALLOW_INTERNAL`). */
  static fromSetting(text: string, opts: Omit<FenceOptions, "allowInternal"> = {}): EgressFence {
    parseAllowInternal(text); // refused here, naming the variable
    return new EgressFence({ ...opts, allowInternal: text.split(",") });
  }

  /** The operator's ranges as text, for the agent's start-up line. */
  get allowedRanges(): string[] {
    return this.allowInternal.map((c) => `${formatIp({ family: c.family, value: c.network })}/${c.prefix}`);
  }

  private operatorAllows(ip: Ip): boolean {
    return this.allowInternal.some((c) => inCidr(ip, c));
  }

  private isHostOwn(ip: Ip): boolean {
    const now = Date.now();
    if (now - this.hostKeysAtMs > HOST_ADDRESSES_TTL_MS) {
      const keys = new Set<string>();
      for (const a of this.readHostAddresses()) {
        const ip = parseIpLiteral(a.replace(/%.*$/, ""));
        if (ip && ip !== "malformed") keys.add(key(unmap(ip)));
      }
      this.hostKeys = keys;
      this.hostKeysAtMs = now;
    }
    return this.hostKeys.has(key(ip));
  }

  /** Why a single address is internal, ignoring the operator's ranges; undefined when it is not. */
  private internalWhy(ip: Ip): string | undefined {
    const table = ip.family === 4 ? V4_INTERNAL : V6_INTERNAL;
    const hit = table.find(([c]) => inCidr(ip, c));
    if (hit) return hit[1];
    if (this.isHostOwn(ip)) return "an address of this host";
    return undefined;
  }

  /**
   * The verdict on one address (any spelling `parseIpLiteral` reads): the address to connect to
   * (a v4-mapped address becomes its IPv4 address) or why it is refused.
   */
  classify(address: string): { ok: true; address: string; family: 4 | 6 } | { ok: false; reason: string } {
    const parsed = parseIpLiteral(address);
    if (parsed === undefined || parsed === "malformed") {
      return { ok: false, reason: `${address} is not an IP address` };
    }
    const ip = unmap(parsed);
    const shown = formatIp(ip);
    for (const v of embeddedV4(ip)) {
      const inner: Ip = { family: 4, value: v };
      if (this.operatorAllows(inner) || this.operatorAllows(ip)) continue;
      const why = this.internalWhy(inner);
      if (why) return { ok: false, reason: `${shown} carries ${formatIp(inner)}, internal (${why})` };
    }
    if (!this.operatorAllows(ip)) {
      const why = this.internalWhy(ip);
      if (why) return { ok: false, reason: `${shown} is internal (${why})` };
    }
    return { ok: true, address: shown, family: ip.family };
  }

  /**
   * Checks a destination as a tenant named it: a literal is classified, a name is resolved once
   * and every address is classified; the first address is the one to connect to.
   */
  async check(host: string, port: number): Promise<Destination> {
    const h = normalizeHost(host);
    const no = (code: "internal" | "malformed" | "unresolvable", reason: string): Destination => ({
      ok: false,
      host: h,
      port,
      code,
      reason,
    });
    if (!Number.isInteger(port) || port < 1 || port > 65535)
      return no("malformed", `port ${port} is invalid`);
    const literal = parseIpLiteral(h);
    if (literal === "malformed") return no("malformed", `${h} is not a valid IP address`);
    if (literal !== undefined) {
      const v = this.classify(h);
      return v.ok
        ? { ok: true, host: h, port, address: v.address, family: v.family }
        : no("internal", v.reason);
    }
    if (!/^[a-z0-9_-]+(\.[a-z0-9_-]+)*$/.test(h) || h.length > 253) {
      return no("malformed", `${JSON.stringify(h)} is not a host name`);
    }
    let addrs: string[];
    try {
      addrs = await withTimeout(this.resolveName(h), RESOLVE_TIMEOUT_MS, `resolving ${h}`);
    } catch (err) {
      return no("unresolvable", `${h} does not resolve (${(err as Error).message})`);
    }
    if (addrs.length === 0) return no("unresolvable", `${h} does not resolve`);
    let first: { address: string; family: 4 | 6 } | undefined;
    for (const a of addrs) {
      const v = this.classify(a);
      if (!v.ok) return no("internal", `${h} resolves to ${a}: ${v.reason}`);
      first ??= v;
    }
    return { ok: true, host: h, port, address: first!.address, family: first!.family };
  }

  /** TCP to the checked address itself (never the name again), bounded by CONNECT_TIMEOUT_MS. */
  connect(d: { address: string; port: number; family: 4 | 6 }): Promise<Socket> {
    return new Promise((resolve, reject) => {
      const sock = new Socket();
      const timer = setTimeout(() => {
        sock.destroy();
        reject(new Error(`connect to ${d.address}:${d.port} timed out after ${CONNECT_TIMEOUT_MS} ms`));
      }, CONNECT_TIMEOUT_MS);
      sock.once("error", (err) => {
        clearTimeout(timer);
        reject(err);
      });
      sock.connect({ host: d.address, port: d.port, family: d.family }, () => {
        clearTimeout(timer);
        sock.removeAllListeners("error");
        resolve(sock);
      });
    });
  }
}

/** A v4-mapped IPv6 address is its IPv4 address (a dual-stack socket connects there). */
function unmap(ip: Ip): Ip {
  return inCidr(ip, V4_MAPPED) ? { family: 4, value: ip.value & LOW32 } : ip;
}

function withTimeout<T>(p: Promise<T>, ms: number, what: string): Promise<T> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const late = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what} took over ${ms} ms`)), ms);
  });
  return Promise.race([p, late]).finally(() => clearTimeout(timer));
}

let processFence: EgressFence | undefined;

/**
 * The fence with no internal range opened, built once per process: the default of the proxy, the
 * manager and the registry pull path when the operator's fence (`fromSetting`) is not passed.
 */
export function defaultFence(): EgressFence {
  processFence ??= new EgressFence();
  return processFence;
}

/** `fence.check(host, port)`: the check any caller outside the proxy uses. */
export function checkDestination(host: string, port: number, fence = defaultFence()): Promise<Destination> {
  return fence.check(host, port);
}
