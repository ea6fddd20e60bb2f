/**
 * Which registries a pull may reach and how (pull.ts): the operator's registry settings (insecure
 * and shared registries, the host-wide credentials file, the pull cap), plain HTTP for loopback
 * and listed registries as Docker does, and the address the egress fence checks.
 */
import { isIP } from "node:net";
import { resolve } from "node:path";
import { bytesSetting } from "../../contracts/disk-space.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import type { ImageReference } from "../../contracts/image-ref.ts";
import type { ProxyFence } from "./pull-proxy.ts";

/** Refuses (throws) a registry address the egress fence does not allow; resolves otherwise. */
export type DestinationCheck = (host: string, port: number) => void | Promise<void>;

export interface RegistryConfig {
  /** A docker `config.json` style credentials file (skopeo `--authfile`), for shared registries only. */
  authFile?: string;
  /** `host` or `host:port` entries spoken to without TLS verification (beyond loopback). */
  insecureRegistries: string[];
  /** `host` or `host:port` entries the operator shares with every tenant: `authFile` applies there. */
  sharedRegistries?: string[];
  /** The egress fence for registry addresses; absent: no check (tests of the pull alone). */
  checkDestination?: DestinationCheck;
  /**
   * The same fence for EVERY connection skopeo makes (pull-proxy.ts: the registry, each redirect,
   * the token realm), resolved once and pinned; absent: any address (tests of the pull alone).
   */
  fence?: ProxyFence;
  /** Largest image a pull may copy, bytes as its manifest declares them; absent: the default. */
  maxPullBytes?: number;
}

/**
 * Our choice (docs/quotas-and-usage.md "Disk budgets"): the largest image a bake may pull, counted as the
 * registry's manifest declares it (config plus compressed layers, the bytes skopeo writes). 8 GiB
 * matches the import's limit on unpacked bytes (limits.ts), which no smaller pull can exceed by
 * much. `SANDBOXD_PULL_MAX_BYTES` overrides it.
 */
export const DEFAULT_MAX_PULL_BYTES = 8 * 1024 ** 3;

/** A bake's own registry credentials; a token goes in `password`. Never logged, never stored. */
export interface RegistryAuth {
  username: string;
  password: string;
}

/** The registry Docker means when a reference names none. */
export const DEFAULT_REGISTRY = "docker.io";
/** Where the default registry's API really is (what the fence checks). */
const DEFAULT_REGISTRY_HOST = "registry-1.docker.io";

const REGISTRY_ENTRY = /^(?:[a-z0-9]([a-z0-9.-]*[a-z0-9])?|\[[0-9a-f:.]+\])(?::[0-9]{1,5})?$/;

/** `host[:port],...` (empty entries skipped); a malformed entry is refused naming `name`. */
export function parseRegistryList(text: string, name: string): string[] {
  const out: string[] = [];
  for (const raw of text.split(",")) {
    const entry = raw.trim().toLowerCase();
    if (entry === "") continue;
    if (!REGISTRY_ENTRY.test(entry))
      throw new SandboxdError("bad_request", `${name}: ${JSON.stringify(raw)} is not host or host:port`);
    out.push(entry);
  }
  return out;
}

/**
 * The registry settings from the agent's settings by variable name (cli/settings/ reads them); a
 * bad entry is refused at start.
 */
export function registryConfigFromEnv(env: Record<string, string | undefined>): RegistryConfig {
  const out: RegistryConfig = {
    insecureRegistries: parseRegistryList(
      env.SANDBOXD_INSECURE_REGISTRIES ?? "",
      "SANDBOXD_INSECURE_REGISTRIES",
    ),
    sharedRegistries: parseRegistryList(env.SANDBOXD_SHARED_REGISTRIES ?? "", "SANDBOXD_SHARED_REGISTRIES"),
  };
  const auth = env.SANDBOXD_REGISTRY_AUTH?.trim();
  if (auth) out.authFile = resolve(auth);
  if (env.SANDBOXD_PULL_MAX_BYTES !== undefined)
    out.maxPullBytes = bytesSetting(env, "SANDBOXD_PULL_MAX_BYTES", DEFAULT_MAX_PULL_BYTES);
  return out;
}

/** True for a registry host on the loopback interface: 127.0.0.0/8, ::1, `localhost`. */
export function isLoopbackHost(host: string): boolean {
  const h = host.toLowerCase().replace(/^\[|\]$/g, "");
  if (h === "localhost" || h.endsWith(".localhost")) return true;
  if (isIP(h) === 4) return h.split(".")[0] === "127";
  if (isIP(h) === 6) {
    // Any spelling of ::1 (e.g. 0:0:0:0:0:0:0:1), and ::ffff:127.x.y.z.
    const norm = new URL(`http://[${h}]/`).hostname;
    return norm === "[::1]" || /^\[::ffff:7f[0-9a-f]{2}:[0-9a-f]{1,4}\]$/.test(norm);
  }
  return false;
}

/** Whether `list` names the reference's registry: by `host:port`, or by `host` for every port. */
function listed(ref: ImageReference, list: readonly string[]): boolean {
  const domain = (ref.domain ?? DEFAULT_REGISTRY).toLowerCase();
  const host = ref.host ?? DEFAULT_REGISTRY;
  return list.some((e) => e === domain || e === host);
}

/**
 * Whether to verify TLS for the reference's registry: not for loopback (as Docker), not for a
 * registry the operator listed as insecure (by `host:port`, or by `host` for every port).
 */
export function registryTlsVerify(ref: ImageReference, cfg: RegistryConfig): boolean {
  if (!ref.host) return true; // the default registry: always TLS
  if (isLoopbackHost(ref.host)) return false;
  return !listed(ref, cfg.insecureRegistries);
}

/** Whether the operator's host-wide credentials may be used for the reference's registry. */
export function isSharedRegistry(ref: ImageReference, cfg: RegistryConfig): boolean {
  return listed(ref, cfg.sharedRegistries ?? []);
}

/** The registry's host and port as the fence sees them: Docker's defaults where none is written. */
export function registryAddress(ref: ImageReference): { host: string; port: number } {
  if (!ref.host) return { host: DEFAULT_REGISTRY_HOST, port: 443 };
  return { host: ref.host, port: ref.port ?? (isLoopbackHost(ref.host) ? 80 : 443) };
}
