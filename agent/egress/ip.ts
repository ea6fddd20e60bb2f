/**
 * Addresses as numbers (the egress fence, fence.ts, checks them): IP literals read the way the
 * resolver (`inet_aton`) reads them, IPv6 with IPv4 inside it, their canonical text, and CIDR
 * ranges.
 */
import { isIP } from "node:net";
import { normalizeHost } from "../../contracts/egress.ts";
import { SandboxdError } from "../../contracts/errors.ts";

/** An address: IPv4 as a 32-bit, IPv6 as a 128-bit number. */
export interface Ip {
  family: 4 | 6;
  value: bigint;
}

export interface Cidr {
  family: 4 | 6;
  network: bigint;
  prefix: number;
}

const V4_PART = /^(?:0x[0-9a-f]*|[0-9]+)$/i;

/** One `inet_aton` part: `0x` hex, leading-zero octal, or decimal; undefined when invalid. */
function atonPart(p: string): bigint | undefined {
  if (/^0x[0-9a-f]+$/i.test(p)) return BigInt(p);
  if (/^0[0-7]*$/.test(p)) return BigInt(`0o${p.slice(1) || "0"}`);
  if (/^[1-9][0-9]*$/.test(p)) return BigInt(p);
  return undefined;
}

/**
 * IPv4 as `inet_aton` reads it: 1 to 4 parts, the last one filling the remaining bytes
 * (`a`: 32 bits; `a.b`: 8.24; `a.b.c`: 8.8.16). Undefined when it is not one.
 */
function parseV4(s: string): bigint | undefined {
  const parts = s.split(".");
  if (parts.length > 4) return undefined;
  const nums = parts.map(atonPart);
  if (nums.some((n) => n === undefined)) return undefined;
  const ns = nums as bigint[];
  let value = 0n;
  for (let i = 0; i < ns.length - 1; i++) {
    if (ns[i]! > 255n) return undefined;
    value |= ns[i]! << BigInt(8 * (3 - i));
  }
  const lastBits = BigInt(8 * (4 - (ns.length - 1)));
  const last = ns[ns.length - 1]!;
  if (last >= 1n << lastBits) return undefined;
  return value | last;
}

function parseV6(s: string): bigint | undefined {
  if (s.includes("%") || isIP(s) !== 6) return undefined;
  let text = s;
  const tail = text.slice(text.lastIndexOf(":") + 1);
  if (tail.includes(".")) {
    const v4 = parseV4(tail);
    if (v4 === undefined || isIP(tail) !== 4) return undefined;
    text = `${text.slice(0, text.length - tail.length)}${(v4 >> 16n).toString(16)}:${(v4 & 0xffffn).toString(16)}`;
  }
  const halves = text.split("::");
  if (halves.length > 2) return undefined;
  const groups = (h: string) => (h === "" ? [] : h.split(":"));
  const head = groups(halves[0]!);
  const rest = halves.length === 2 ? groups(halves[1]!) : [];
  const fill = halves.length === 2 ? 8 - head.length - rest.length : 0;
  const all = [...head, ...Array<string>(fill).fill("0"), ...rest];
  if (all.length !== 8) return undefined;
  return all.reduce((acc, g) => (acc << 16n) | BigInt(`0x${g}`), 0n);
}

/**
 * Reads `host` as an address literal. `undefined`: not a literal (a name: some label is not a
 * number); `"malformed"`: every label is a number but `inet_aton` would not read it (`256.1`,
 * `08.1`, five parts), so it is neither an address nor a name worth resolving.
 */
export function parseIpLiteral(host: string): Ip | "malformed" | undefined {
  const h = normalizeHost(host);
  if (h.includes(":")) {
    const v6 = parseV6(h);
    return v6 === undefined ? "malformed" : { family: 6, value: v6 };
  }
  if (!h.split(".").every((l) => V4_PART.test(l))) return undefined;
  const v4 = parseV4(h);
  return v4 === undefined ? "malformed" : { family: 4, value: v4 };
}

/** Canonical text: dotted quad, or RFC 5952 compressed IPv6. */
export function formatIp(ip: Ip): string {
  if (ip.family === 4) {
    return [24n, 16n, 8n, 0n].map((sh) => ((ip.value >> sh) & 0xffn).toString()).join(".");
  }
  const g = Array.from({ length: 8 }, (_, i) => Number((ip.value >> BigInt(16 * (7 - i))) & 0xffffn));
  let best = -1;
  let bestLen = 1;
  for (let i = 0; i < 8; ) {
    let j = i;
    while (j < 8 && g[j] === 0) j++;
    if (j - i > bestLen) {
      best = i;
      bestLen = j - i;
    }
    i = j === i ? i + 1 : j;
  }
  const hex = g.map((x) => x.toString(16));
  if (best < 0) return hex.join(":");
  return `${hex.slice(0, best).join(":")}::${hex.slice(best + bestLen).join(":")}`;
}

/** `10.0.0.0/8`, `fd00::/8`, or one address (a /32 or /128); undefined when malformed. */
export function parseCidr(text: string): Cidr | undefined {
  const [addr, bits, ...more] = text.trim().split("/");
  if (more.length > 0 || addr === undefined) return undefined;
  const ip = parseIpLiteral(addr);
  if (ip === undefined || ip === "malformed") return undefined;
  const width = ip.family === 4 ? 32 : 128;
  if (bits !== undefined && !/^\d{1,3}$/.test(bits)) return undefined;
  const prefix = bits === undefined ? width : Number(bits);
  if (prefix > width) return undefined;
  const shift = BigInt(width - prefix);
  return { family: ip.family, network: (ip.value >> shift) << shift, prefix };
}

/** A built-in range, written in the source: a malformed one is a bug. */
export function cidr(text: string): Cidr {
  const c = parseCidr(text);
  if (!c) throw new SandboxdError("internal", `bad built-in range ${text}`);
  return c;
}

export function inCidr(ip: Ip, c: Cidr): boolean {
  if (ip.family !== c.family) return false;
  const shift = BigInt((c.family === 4 ? 32 : 128) - c.prefix);
  return ip.value >> shift === c.network >> shift;
}
