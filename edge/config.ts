/**
 * The edge's configuration (docs/edge.md "Configuration"), read from the isolate's bindings or
 * environment: which gateways serve each region, and the region of requests that name none. Parsed
 * once per isolate at its first request; a bad value is an error naming the binding, never a guess.
 */
import { REGION_NAME_PATTERN } from "../contracts/api/api-key.ts";

/** The binding names (a Workers `vars` entry, a workerd `text`/`json` binding, a Deno env variable). */
export const REGIONS_BINDING = "SANDBOXD_EDGE_REGIONS";
export const DEFAULT_REGION_BINDING = "SANDBOXD_EDGE_DEFAULT_REGION";
export const CLIENT_IP_HEADER_BINDING = "SANDBOXD_EDGE_CLIENT_IP_HEADER";

/**
 * Where a Workers or workerd edge reads its client's address: Cloudflare sets `CF-Connecting-IP`
 * on every request it hands a Worker (a client's own is replaced). A self-hosted workerd names the
 * header its own front sets, or "" for none (workerd tells a worker no peer address).
 */
export const DEFAULT_CLIENT_IP_HEADER = "cf-connecting-ip";

/**
 * Gateways one region may list. Every one may be tried for one request (the retry of a safe
 * request walks the list), so the list bounds the subrequests a request costs: Workers allows 50
 * per request on its free plan, and 16 gateways behind one edge is already more than a region runs.
 */
export const MAX_GATEWAYS_PER_REGION = 16;

export interface EdgeConfig {
  /** Region name -> the base URLs of its gateways (`http(s)://host[:port][/prefix]`, no trailing `/`). */
  regions: ReadonlyMap<string, readonly string[]>;
  /** Where requests that name no region go (health, openapi, keys of tenants with no home). */
  defaultRegion: string;
  /** The header that holds the client's address (lowercase); undefined: none (`clientIpHeader: ""`). */
  clientIpHeader: string | undefined;
}

export type ConfigResult = { ok: true; config: EdgeConfig } | { ok: false; message: string };

/**
 * `regions`: a JSON object (or its text) mapping each region to a list of gateway base URLs;
 * `defaultRegion`: one of its regions.
 */
export function parseEdgeConfig(env: Record<string, unknown>): ConfigResult {
  const fail = (message: string): ConfigResult => ({ ok: false, message });
  let raw = env[REGIONS_BINDING];
  if (typeof raw === "string") {
    try {
      raw = JSON.parse(raw);
    } catch (err) {
      return fail(`${REGIONS_BINDING} is not JSON: ${(err as Error).message}`);
    }
  }
  if (typeof raw !== "object" || raw === null || Array.isArray(raw))
    return fail(`${REGIONS_BINDING} must be a JSON object of region -> [gateway URL, ...]`);
  const regions = new Map<string, string[]>();
  for (const [region, urls] of Object.entries(raw)) {
    if (!REGION_NAME_PATTERN.test(region))
      return fail(`${REGIONS_BINDING}: ${JSON.stringify(region)} is no region name (1-64 of A-Za-z0-9._-)`);
    if (!Array.isArray(urls) || urls.length === 0 || urls.length > MAX_GATEWAYS_PER_REGION)
      return fail(`${REGIONS_BINDING}.${region}: 1 to ${MAX_GATEWAYS_PER_REGION} gateway URLs`);
    const bases: string[] = [];
    for (const u of urls) {
      const base = gatewayBase(u);
      if (base === undefined)
        return fail(
          `${REGIONS_BINDING}.${region}: ${JSON.stringify(u)} is no http(s) URL without query or fragment`,
        );
      bases.push(base);
    }
    regions.set(region, bases);
  }
  const def = env[DEFAULT_REGION_BINDING];
  if (typeof def !== "string" || !regions.has(def))
    return fail(`${DEFAULT_REGION_BINDING} must name a region of ${REGIONS_BINDING}`);
  const ipHeader = env[CLIENT_IP_HEADER_BINDING] ?? DEFAULT_CLIENT_IP_HEADER;
  if (typeof ipHeader !== "string" || !/^[A-Za-z0-9-]*$/.test(ipHeader))
    return fail(`${CLIENT_IP_HEADER_BINDING} must be a header name, or empty for none`);
  return {
    ok: true,
    config: {
      regions,
      defaultRegion: def,
      clientIpHeader: ipHeader === "" ? undefined : ipHeader.toLowerCase(),
    },
  };
}

function gatewayBase(u: unknown): string | undefined {
  if (typeof u !== "string") return undefined;
  let url: URL;
  try {
    url = new URL(u);
  } catch {
    return undefined; // not a URL: refused by the caller with the binding's name
  }
  if ((url.protocol !== "http:" && url.protocol !== "https:") || url.search !== "" || url.hash !== "")
    return undefined;
  if (url.username !== "" || url.password !== "") return undefined;
  return `${url.origin}${url.pathname.replace(/\/+$/, "")}`;
}
