/**
 * Which destinations a sandbox may open connections to. The guest has no network interface; its
 * only way out is the egress proxy the host agent runs for it (proxy.ts), which asks
 * `EgressPolicy.allows` about every connection by the destination's NAME, before anything is
 * resolved or connected on the host. The list's syntax and what each entry names are the
 * contract's (contracts/egress.ts); this is the tenant's half of the decision. The other half is
 * the operator's fence (fence.ts): an allowed name or address is still refused when it is, or
 * resolves to, an internal address; no entry here can open one.
 */
import { type AllowList, normalizeHost, parseAllowList } from "../../contracts/egress.ts";
import { formatIp, parseIpLiteral } from "./fence.ts";

export type EgressDefault = "deny" | "allow";

export class EgressPolicy {
  /** The exact entries that are address literals, in canonical form (`0x7f.1` is 127.0.0.1). */
  private readonly literals: ReadonlySet<string>;

  private constructor(private readonly list: AllowList) {
    const literals = new Set<string>();
    for (const e of list.exact) {
      const ip = parseIpLiteral(e);
      if (ip !== undefined && ip !== "malformed") literals.add(formatIp(ip));
    }
    this.literals = literals;
  }

  /** The entries as given. */
  get entries(): readonly string[] {
    return this.list.entries;
  }

  /** Parses an allow-list; a malformed entry is `bad_request` naming it. */
  static fromAllowList(entries: readonly string[]): EgressPolicy {
    return new EgressPolicy(parseAllowList(entries));
  }

  /** The deployment's policy for a sandbox created without `egress`. */
  static byDefault(d: EgressDefault): EgressPolicy {
    return EgressPolicy.fromAllowList(d === "allow" ? ["*"] : []);
  }

  allows(host: string): boolean {
    if (this.list.all) return true;
    const h = normalizeHost(host);
    // An address (in any spelling the resolver reads) is only allowed when an exact entry names
    // the same address: a wildcard names hosts, not addresses.
    const ip = parseIpLiteral(h);
    if (ip === "malformed") return false;
    if (ip !== undefined) return this.literals.has(formatIp(ip));
    if (this.list.exact.has(h)) return true;
    return this.list.suffixes.some((s) => h.endsWith(s) && h.length > s.length);
  }
}
