/** Gateway configuration. Every limit defaults to contracts/api/limits.ts and can be overridden. */

import { DEFAULT_REGION } from "../contracts/agent/enroll.ts";
import { HEARTBEAT_INTERVAL_MS } from "../contracts/agent/heartbeat.ts";
import { DEFAULT_LIMITS, type Limits, limitsBeyondAgent } from "../contracts/api/limits.ts";
import { SandboxdError } from "../contracts/errors.ts";

export interface GatewayConfig {
  /** API build stamp reported by `GET /v1/health` (docs/api.md "Rules every route shares"). */
  version: string;
  /** Server secret for API key hashes (HMAC-SHA256). Never stored in the db. */
  keyPepper: string;
  /** Server secret for connect-url tokens (HMAC-SHA256). */
  connectSecret: string;
  /** The domain of E2B's sandbox hosts (`<port>-<id>.<domain>`, docs/e2b.md "Data plane"); unset: no host routing. */
  e2bDomain?: string;
  /**
   * Public base URL (`--public-url`, `SANDBOXD_PUBLIC_URL`): connect URLs (docs/connect.md "Rules of connect URLs") use its host
   * with `wss://` (`ws://` for an `http:` one). Unset, they follow the request: the scheme this
   * gateway serves (plain HTTP: `ws://`) and the host the client reached it by.
   */
  publicBaseUrl?: string;
  /** Where uploaded template images are streamed before the agent takes them. */
  uploadDir: string;
  /**
   * The single host agent of a gateway given one `AgentApi` (tests' stand-in). A gateway that
   * routes (gateway/agents/router.ts) uses the `agents` table instead.
   */
  agent: { id: string; region: string; url: string };
  /**
   * This gateway's default region (`sandboxd gateway --region`, default `local`: the region of
   * `up`): the home region of a tenant created through it without `--region`, and the home of a
   * tenant made before regions existed. Every other tenant's sandboxes and template builds go to
   * its own home region, whichever gateway serves the call (docs/regions.md "Rules of regions").
   */
  region: string;
  /**
   * How long a bake, an upload's build or a create accepted while no agent of the region is live
   * waits for one before it fails (docs/templates.md "Waiting for an agent"). Default `AGENT_WAIT_MS`.
   */
  agentWaitMs: number;
  limits: Limits;
  /**
   * The operator settings in force in this process by their environment names (cli/settings.ts),
   * shown by `GET /v1/health`: limits and deadlines only, never a secret. Empty when the gateway
   * was started without the CLI (tests).
   */
  settings: Readonly<Record<string, number | string>>;
}

/**
 * Three heartbeat intervals (15 s): an agent that is starting (`up`'s own, or a host's agent
 * restarting) beats at once when it is up and at least once an interval after that, so three
 * intervals cover its start with room for two lost beats; it is also the window after which a
 * live agent is declared lost (gateway/agents/registry.ts AGENT_STALE_AFTER_MS), so a request
 * waits for an agent as long as the gateway would wait before giving up on one. A create holds
 * its HTTP request that long at most.
 */
export const AGENT_WAIT_MS = 3 * HEARTBEAT_INTERVAL_MS;

export type GatewayConfigInput = Omit<Partial<GatewayConfig>, "limits"> &
  Pick<GatewayConfig, "keyPepper" | "connectSecret" | "uploadDir"> & { limits?: Partial<Limits> };

export function resolveConfig(input: GatewayConfigInput): GatewayConfig {
  if (input.keyPepper.length < 16 || input.connectSecret.length < 16) {
    throw new SandboxdError("bad_request", "keyPepper and connectSecret must be at least 16 characters");
  }
  const config: GatewayConfig = {
    version: input.version ?? "sandboxd-dev",
    keyPepper: input.keyPepper,
    connectSecret: input.connectSecret,
    ...(input.publicBaseUrl !== undefined ? { publicBaseUrl: input.publicBaseUrl } : {}),
    ...(input.e2bDomain !== undefined ? { e2bDomain: input.e2bDomain } : {}),
    uploadDir: input.uploadDir,
    agent: input.agent ?? { id: "local", region: input.region ?? DEFAULT_REGION, url: "in-process" },
    region: input.region ?? DEFAULT_REGION,
    agentWaitMs: input.agentWaitMs ?? AGENT_WAIT_MS,
    settings: input.settings ?? {},
    limits: {
      ...DEFAULT_LIMITS,
      ...input.limits,
      forkCapByTier: { ...DEFAULT_LIMITS.forkCapByTier, ...input.limits?.forkCapByTier },
      sandboxQuotaByTier: { ...DEFAULT_LIMITS.sandboxQuotaByTier, ...input.limits?.sandboxQuotaByTier },
      suspendedQuotaByTier: { ...DEFAULT_LIMITS.suspendedQuotaByTier, ...input.limits?.suspendedQuotaByTier },
      snapshotQuotaByTier: { ...DEFAULT_LIMITS.snapshotQuotaByTier, ...input.limits?.snapshotQuotaByTier },
      templateQuotaByTier: { ...DEFAULT_LIMITS.templateQuotaByTier, ...input.limits?.templateQuotaByTier },
    },
  };
  // A limit the agents would refuse past is refused here, at start, not on a request.
  const beyond = limitsBeyondAgent(config.limits);
  if (beyond.length > 0)
    throw new SandboxdError("bad_request", `limits beyond what an agent accepts: ${beyond.join("; ")}`);
  return config;
}
