/**
 * Which destinations a sandbox may open connections to. The guest has no network interface; its
 * only way out is the egress proxy the host agent runs for it (proxy.ts), which asks
 * `EgressPolicy.allows` about every connection by the destination's NAME, before anything is
 * resolved or connected on the host. The list's syntax and what each entry names are the
 * contract's (contracts/egress.ts); this is the agent's decision on one destination.
 */
import { isIP } from "node:net";
import { type AllowList, normalizeHost, parseAllowList } from "../../contracts/egress.ts";

export type EgressDefault = "deny" | "allow";

export class EgressPolicy {
  private constructor(private readonly list: AllowList) {}

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

  /** Whether `host` is named by an exact entry (not only by `*` or a wildcard). */
  namesExactly(host: string): boolean {
    return this.list.exact.has(normalizeHost(host));
  }

  allows(host: string): boolean {
    if (this.list.all) return true;
    const h = normalizeHost(host);
    if (this.list.exact.has(h)) return true;
    // An IP literal is only allowed when listed: a wildcard names hosts, not addresses.
    if (isIP(h) !== 0) return false;
    return this.list.suffixes.some((s) => h.endsWith(s) && h.length > s.length);
  }
}
