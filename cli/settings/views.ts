/**
 * The typed views of the settings that the code receives as options: the gateway's limits and
 * start options, the agent's options, and what every process needs at start.
 */
import { resolve } from "node:path";
import type { EgressDefault } from "../../agent/egress/policy.ts";
import { DEFAULT_JAIL } from "../../agent/qemu/jail-setup.ts";
import { DEFAULT_FORK_METHOD, type ForkMethod, isForkMethod } from "../../agent/snapshot/fork-method.ts";
import type { VmHostSettings } from "../../agent/vm/host-settings.ts";
import {
  DEFAULT_LIMITS,
  FORK_CAP_BY_TIER,
  IDLE_ACTIONS,
  type Limits,
  SANDBOX_QUOTA_BY_TIER,
} from "../../contracts/api/limits.ts";
import type { OperatorSecrets } from "../../gateway/auth/secrets.ts";
import { defaultDataDir } from "./environment.ts";
import type { Settings } from "./parse.ts";
import { B_TIERS, type Scope, SETTINGS } from "./table.ts";

/** The settings of one scope, for health to show what is in force in that process. */
export function settingsOf(settings: Settings, scope: Scope): Record<string, number | string> {
  return Object.fromEntries(
    SETTINGS.filter((s) => s.scope === scope && s.reported !== false).map((s) => [s.env, settings[s.env]!]),
  );
}

/** The gateway's limits the settings override (gateway/config.ts merges them over the defaults). */
export function gatewayLimits(s: Settings): Partial<Limits> {
  const n = (env: string) => Number(s[env]);
  const byTier = (prefix: string) =>
    Object.fromEntries(B_TIERS.map((t) => [t, n(`${prefix}_${t.toUpperCase()}`)]));
  const action = IDLE_ACTIONS.find((a) => a === s.SANDBOXD_IDLE_ACTION) ?? DEFAULT_LIMITS.idleAction;
  return {
    sessionIdleTtlS: n("SANDBOXD_SESSION_IDLE_TTL"),
    reaperIntervalS: n("SANDBOXD_REAPER_INTERVAL"),
    idleTimeoutS: n("SANDBOXD_IDLE_TIMEOUT"),
    idleAction: action,
    sessionCapPerTenant: n("SANDBOXD_SESSION_CAP"),
    sandboxQuotaByTier: { ...SANDBOX_QUOTA_BY_TIER, ...byTier("SANDBOXD_QUOTA") },
    forkCapByTier: { ...FORK_CAP_BY_TIER, ...byTier("SANDBOXD_FORK_CAP") },
    // The gateway stages uploads on its own disk with the same reserve as the agent.
    diskReserveBytes: n("SANDBOXD_DISK_RESERVE_BYTES"),
  };
}

/** The agent's options the settings set (agent/sandbox/manager.ts, drivers/snapshot.ts). */
export interface AgentSettings {
  idlePauseMs: number;
  buildSlots: number;
  forkMethod: ForkMethod;
  timeouts: { bootMs: number; readyMs: number; restoreMs: number };
  egressDefault: EgressDefault;
  prelaunch: number;
  /** The registry settings by variable name, for agent/image/pull.ts's `registryConfigFromEnv`. */
  registry: Record<string, string>;
  imageCacheBytes: number;
  /** SANDBOXD_VM_MEMORY_BYTES; 0: the default budget (agent/sandbox/capacity.ts `hostCapacity`). */
  vmMemoryBytes: number;
  /** SANDBOXD_ACCEL: auto (probe), kvm or tcg. */
  accel: string;
  /** The jail's uid range and `unshare`, and the disk reserve (agent/vm/host-settings.ts). */
  host: VmHostSettings;
  /** SANDBOXD_EGRESS_ALLOW_INTERNAL, as text (agent/egress/fence.ts `EgressFence.fromSetting`). */
  egressAllowInternal: string;
  /** SANDBOXD_REGISTRY_ALLOW_INTERNAL, as text: the internal ranges registry pulls alone may reach. */
  registryAllowInternal: string;
  /** SANDBOXD_DEBIAN_MIRROR; empty: the host's apt sources' mirror. */
  debianMirror: string;
}

export function agentSettings(s: Settings): AgentSettings {
  const n = (env: string) => Number(s[env]);
  return {
    idlePauseMs: n("SANDBOXD_IDLE_PAUSE_MS"),
    buildSlots: n("SANDBOXD_BUILD_SLOTS"),
    forkMethod: isForkMethod(s.SANDBOXD_FORK_METHOD) ? s.SANDBOXD_FORK_METHOD : DEFAULT_FORK_METHOD,
    timeouts: {
      bootMs: n("SANDBOXD_BOOT_TIMEOUT") * 1000,
      readyMs: n("SANDBOXD_READY_TIMEOUT") * 1000,
      restoreMs: n("SANDBOXD_RESTORE_TIMEOUT") * 1000,
    },
    egressDefault: s.SANDBOXD_EGRESS_DEFAULT === "allow" ? "allow" : "deny",
    prelaunch: n("SANDBOXD_PRELAUNCH"),
    registry: Object.fromEntries(
      [
        "SANDBOXD_INSECURE_REGISTRIES",
        "SANDBOXD_SHARED_REGISTRIES",
        "SANDBOXD_REGISTRY_AUTH",
        "SANDBOXD_PULL_MAX_BYTES",
      ].map((k) => [k, String(s[k])]),
    ),
    imageCacheBytes: n("SANDBOXD_IMAGE_CACHE_BYTES"),
    vmMemoryBytes: n("SANDBOXD_VM_MEMORY_BYTES"),
    accel: String(s.SANDBOXD_ACCEL),
    host: hostSettings(s),
    egressAllowInternal: String(s.SANDBOXD_EGRESS_ALLOW_INTERNAL),
    registryAllowInternal: String(s.SANDBOXD_REGISTRY_ALLOW_INTERNAL),
    debianMirror: String(s.SANDBOXD_DEBIAN_MIRROR),
  };
}

/** What every VM launch and large write obeys: for the serving commands, `run` and `bench`. */
export function hostSettings(s: Settings): VmHostSettings {
  const unshare = String(s.SANDBOXD_JAIL_UNSHARE);
  return {
    jail: {
      uidRange: { base: Number(s.SANDBOXD_JAIL_UID_BASE), count: Number(s.SANDBOXD_JAIL_UID_COUNT) },
      unshare: unshare === "" ? DEFAULT_JAIL.unshare : unshare,
      ksmQemu: String(s.SANDBOXD_KSM) === "qemu",
    },
    diskReserveBytes: Number(s.SANDBOXD_DISK_RESERVE_BYTES),
  };
}

/** The operator's secrets from variables by name; an empty one counts as unset. */
export function secretsFrom(env: Readonly<Record<string, string | number | undefined>>): OperatorSecrets {
  const out: OperatorSecrets = {};
  const text = (k: string) => (env[k] === undefined || env[k] === "" ? undefined : String(env[k]));
  const pepper = text("SANDBOXD_KEY_PEPPER");
  const connect = text("SANDBOXD_CONNECT_SECRET");
  const agent = text("SANDBOXD_AGENT_SECRET");
  if (pepper) out.keyPepper = pepper;
  if (connect) out.connectSecret = connect;
  if (agent) out.agentSecret = agent;
  return out;
}

/** The gateway's start options the settings give (gateway/server.ts `startGateway`). */
export interface GatewayStart {
  databaseUrl?: string;
  /** Secrets set by the operator; the rest come from `<data>/secrets/`. */
  secrets: OperatorSecrets;
  publicBaseUrl?: string;
  /** `SANDBOXD_E2B_DOMAIN`: the domain of E2B's sandbox hosts (lower case). */
  e2bDomain?: string;
  /** `SANDBOXD_PEER_URL`: where the other gateways of the region reach this one. */
  peerUrl?: string;
  /** `SANDBOXD_DATABASE_LISTEN_URL`: a direct connection for LISTEN behind a pooler. */
  databaseListenUrl?: string;
  /** `SANDBOXD_MIGRATE`: false when the gateway must find the schema migrated already. */
  migrate: boolean;
}

export function gatewayStart(s: Settings): GatewayStart {
  const text = (env: string): string | undefined => (s[env] === "" ? undefined : String(s[env]));
  const databaseUrl = text("DATABASE_URL");
  const publicUrl = text("SANDBOXD_PUBLIC_URL");
  const peerUrl = text("SANDBOXD_PEER_URL");
  const e2bDomain = text("SANDBOXD_E2B_DOMAIN");
  const listenUrl = text("SANDBOXD_DATABASE_LISTEN_URL");
  return {
    ...(listenUrl ? { databaseListenUrl: listenUrl } : {}),
    migrate: s.SANDBOXD_MIGRATE !== "off",
    ...(peerUrl ? { peerUrl: peerUrl.replace(/\/+$/, "") } : {}),
    ...(databaseUrl ? { databaseUrl } : {}),
    secrets: secretsFrom(s),
    // Checked by the settings' parser: an http(s):// or ws(s):// URL.
    ...(publicUrl ? { publicBaseUrl: new URL(publicUrl).origin } : {}),
    ...(e2bDomain ? { e2bDomain: e2bDomain.toLowerCase() } : {}),
  };
}

/** `SANDBOXD_METRICS_TOKEN`, or undefined: no metrics endpoint. */
export function metricsToken(s: Settings): string | undefined {
  return s.SANDBOXD_METRICS_TOKEN === "" ? undefined : String(s.SANDBOXD_METRICS_TOKEN);
}

/** `SANDBOXD_OTLP_ENDPOINT`, or undefined: spans are not exported. */
export function otlpEndpoint(s: Settings): string | undefined {
  return s.SANDBOXD_OTLP_ENDPOINT === "" ? undefined : String(s.SANDBOXD_OTLP_ENDPOINT);
}

/** SANDBOXD_ENROLL_TOKEN: redeemed at an agent's first start only (agent/api/enroll.ts `loadOrEnroll`). */
export function firstStartEnrollToken(s: Settings): string | undefined {
  return s.SANDBOXD_ENROLL_TOKEN === "" ? undefined : String(s.SANDBOXD_ENROLL_TOKEN);
}

/** The graceful stop's bounds (`SANDBOXD_DRAIN_DELAY`, `SANDBOXD_DRAIN_TIMEOUT`), ms. */
export function drainOptions(s: Settings): { delayMs: number; timeoutMs: number } {
  return {
    delayMs: Number(s.SANDBOXD_DRAIN_DELAY) * 1000,
    timeoutMs: Number(s.SANDBOXD_DRAIN_TIMEOUT) * 1000,
  };
}

/** SANDBOXD_DATA_DIR (`--data-dir`, a config file), else the default place (environment.ts). */
export function dataDirOf(s: Settings): string {
  return s.SANDBOXD_DATA_DIR === "" ? defaultDataDir() : resolve(String(s.SANDBOXD_DATA_DIR));
}

/** The settings every serving process shows in health: the gateway's, the agent's, or both. */
export function reportedSettings(s: Settings, scopes: readonly Scope[]): Record<string, number | string> {
  return Object.assign({}, ...scopes.map((scope) => settingsOf(s, scope)));
}
