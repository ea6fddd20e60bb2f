/**
 * The syntax of egress allow-lists (docs/sandboxes.md "Rules of the sandboxes API" `egress.allow`), shared by the gateway, which refuses
 * a malformed list with 400 before anything is created, and the agent, whose egress proxy
 * (agent/egress/) enforces the parsed list on every connection the guest opens.
 *
 * Entries: a host name (`api.example.com`, matched exactly, case-insensitively, trailing dot
 * ignored), a wildcard `*.example.com` (any name strictly below example.com, at any depth, but not
 * example.com itself: list both to allow both, as with TLS wildcards' intent), an IP literal
 * (matched exactly; a request for an IP is otherwise refused, since no name can vouch for it), or
 * `*` (everything). Anything else is a 400 at create: a typo must not silently allow nothing.
 * Entries only name destinations: an internal address (loopback, private, link-local, the host's
 * own) stays refused whatever the list says, unless the operator opens its range on the agent.
 */
import { isIP } from "node:net";
import { SandboxdError } from "./errors.ts";

/** RFC 1123 labels, 1-63 chars; names up to 253 chars. */
const LABEL = /^(?!-)[a-z0-9-]{1,63}(?<!-)$/;
/** Bound on entries: the list is checked on every connection and stored with every sandbox. */
export const MAX_EGRESS_ENTRIES = 256;

/** An allow-list as parsed: what each entry names, in normalized form. */
export interface AllowList {
  /** The entries as given. */
  readonly entries: readonly string[];
  /** `*` was listed. */
  readonly all: boolean;
  /** Host names and IP literals, normalized (normalizeHost). */
  readonly exact: ReadonlySet<string>;
  /** `*.example.com` kept as `.example.com`: a name matches when it ends with it and is longer. */
  readonly suffixes: readonly string[];
}

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

/** Parses an allow-list; a malformed entry is `bad_request` naming it. */
export function parseAllowList(entries: readonly string[]): AllowList {
  if (entries.length > MAX_EGRESS_ENTRIES) {
    throw new SandboxdError(
      "bad_request",
      `egress.allow has ${entries.length} entries; at most ${MAX_EGRESS_ENTRIES}`,
    );
  }
  const exact = new Set<string>();
  const suffixes: string[] = [];
  for (const raw of entries) {
    if (raw === "*") continue;
    const e = normalizeHost(raw);
    if (e.startsWith("*.") && isHostName(e.slice(2))) suffixes.push(e.slice(1));
    else if (isIP(e) !== 0 || isHostName(e)) exact.add(e);
    else {
      throw new SandboxdError(
        "bad_request",
        `egress.allow entry ${JSON.stringify(raw)} is not a host name, *.suffix wildcard, IP address or *`,
      );
    }
  }
  return { entries: [...entries], all: entries.includes("*"), exact, suffixes };
}
