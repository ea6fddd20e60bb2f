/**
 * Egress allow-lists (spec 2.5 `egress.allow`): which destinations a sandbox may open connections
 * to. The guest has no network interface; its only way out is the egress proxy the host agent
 * runs for it (agent/egress/proxy.ts), which asks `EgressPolicy.allows` about every connection
 * by the destination's NAME, before anything is resolved or connected on the host.
 *
 * Entries: a host name (`api.example.com`, matched exactly, case-insensitively, trailing dot
 * ignored), a wildcard `*.example.com` (any name strictly below example.com, at any depth, but not
 * example.com itself: list both to allow both, as with TLS wildcards' intent), an IP literal
 * (matched exactly; a request for an IP is otherwise refused, since no name can vouch for it), or
 * `*` (everything). Anything else is a 400 at create: a typo must not silently allow nothing.
 */
import { isIP } from "node:net";
import { SandboxdError } from "../../contracts/errors.ts";

/** RFC 1123 labels, 1-63 chars; names up to 253 chars. */
const LABEL = /^(?!-)[a-z0-9-]{1,63}(?<!-)$/;
/** Bound on entries: the list is checked on every connection and stored with every sandbox. */
export const MAX_EGRESS_ENTRIES = 256;

export type EgressDefault = "deny" | "allow";

export function normalizeHost(host: string): string {
  let h = host.trim().toLowerCase();
  if (h.startsWith("[") && h.endsWith("]")) h = h.slice(1, -1);
  if (h.endsWith(".")) h = h.slice(0, -1);
  return h;
}

function isHostName(h: string): boolean {
  if (h.length === 0 || h.length > 253) return false;
  return h.split(".").every((l) => LABEL.test(l));
}

export class EgressPolicy {
  private readonly exact = new Set<string>();
  private readonly suffixes: string[] = [];
  private readonly all: boolean;

  private constructor(
    readonly entries: readonly string[],
    all: boolean,
  ) {
    this.all = all;
  }

  /** Parses an allow-list; a malformed entry is `bad_request` naming it. */
  static fromAllowList(entries: readonly string[]): EgressPolicy {
    if (entries.length > MAX_EGRESS_ENTRIES) {
      throw new SandboxdError(
        "bad_request",
        `egress.allow has ${entries.length} entries; at most ${MAX_EGRESS_ENTRIES}`,
      );
    }
    const policy = new EgressPolicy([...entries], entries.includes("*"));
    for (const raw of entries) {
      if (raw === "*") continue;
      const e = normalizeHost(raw);
      if (e.startsWith("*.") && isHostName(e.slice(2))) policy.suffixes.push(e.slice(1));
      else if (isIP(e) !== 0 || isHostName(e)) policy.exact.add(e);
      else {
        throw new SandboxdError(
          "bad_request",
          `egress.allow entry ${JSON.stringify(raw)} is not a host name, *.suffix wildcard, IP address or *`,
        );
      }
    }
    return policy;
  }

  /** The deployment's policy for a sandbox created without `egress`. */
  static byDefault(d: EgressDefault): EgressPolicy {
    return EgressPolicy.fromAllowList(d === "allow" ? ["*"] : []);
  }

  /** Whether `host` is named by an exact entry (not only by `*` or a wildcard). */
  namesExactly(host: string): boolean {
    return this.exact.has(normalizeHost(host));
  }

  allows(host: string): boolean {
    if (this.all) return true;
    const h = normalizeHost(host);
    if (this.exact.has(h)) return true;
    // An IP literal is only allowed when listed: a wildcard names hosts, not addresses.
    if (isIP(h) !== 0) return false;
    return this.suffixes.some((s) => h.endsWith(s) && h.length > s.length);
  }
}
