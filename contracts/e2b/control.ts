/**
 * E2B's control-plane bodies and queries (docs/e2b.md "Control plane"), as e2b 2.45.0 sends and
 * reads them (its `spec/openapi.yml`, generated into the SDK's `src/api/schema.gen.ts`): the
 * requests parsed at the edge of gateway/e2b/control.ts, the answers checked by the tests. Field
 * names are E2B's, whatever our own API calls them. Bounds are ours (contracts/api/limits.ts);
 * fields E2B defines that sandboxd cannot honour are parsed here and refused by the handler with
 * a message saying so, rather than dropped unseen.
 */
import { z } from "zod";
import { ExecOptionFields, Labels, TemplateId } from "../api/common.ts";
import { MAX_FORK_COUNT, MAX_SANDBOX_TIMEOUT_S } from "../api/limits.ts";
import { ListCursor, ListLimit } from "../api/lists.ts";

/**
 * A lifetime in seconds as E2B's SDK sends it (`Math.ceil(timeoutMs / 1000)`), within our
 * absolute lifetime's bounds (MAX_SANDBOX_TIMEOUT_S: 30 days, above E2B's own 24 h for Pro).
 */
export const E2bTimeout = z.int().min(1).max(MAX_SANDBOX_TIMEOUT_S);

/** E2B's default `timeout` of `POST /sandboxes` when the body has none (its spec's default). */
export const E2B_DEFAULT_TIMEOUT_S = 15;

/** E2B's default template name (`Sandbox.create()` without one sends it too). */
export const E2B_DEFAULT_TEMPLATE = "base";

/** E2B's default page size of `GET /v2/sandboxes` and `GET /snapshots` (its SDK's `limit`). */
export const E2B_DEFAULT_PAGE = 100;

/** A host list of the network config: each entry one host name, address or CIDR (at most 253 characters). */
const HostList = z.array(z.string().min(1).max(253)).max(256);

/** `network` of `POST /sandboxes` (E2B's `SandboxNetworkConfig`). */
export const E2bNetwork = z.object({
  allowOut: HostList.optional(),
  denyOut: HostList.optional(),
  allowPublicTraffic: z.boolean().optional(),
  maskRequestHost: z.string().max(253).optional(),
  rules: z.record(z.string(), z.unknown()).optional(),
  egressProxy: z.unknown().optional(),
});
export type E2bNetwork = z.infer<typeof E2bNetwork>;

/** `POST /sandboxes` (E2B's `NewSandbox`). */
export const NewSandbox = z.object({
  templateID: z.string().min(1).max(64).optional(),
  timeout: E2bTimeout.optional(),
  metadata: Labels.optional(),
  /** The sandbox's own environment: the bounds of an exec's `env`. */
  envVars: ExecOptionFields.env.optional(),
  secure: z.boolean().optional(),
  allow_internet_access: z.boolean().optional(),
  network: E2bNetwork.optional(),
  autoPause: z.boolean().optional(),
  autoPauseMemory: z.boolean().optional(),
  autoResume: z.object({ enabled: z.boolean() }).optional(),
  mcp: z.unknown().optional(),
  iam: z.unknown().optional(),
  volumeMounts: z.array(z.unknown()).max(64).optional(),
});
export type NewSandbox = z.infer<typeof NewSandbox>;

/** `PUT /sandboxes/{id}/network` (E2B's `SandboxNetworkUpdateConfig`): the whole egress config. */
export const E2bNetworkUpdate = E2bNetwork.pick({
  allowOut: true,
  denyOut: true,
  rules: true,
  egressProxy: true,
}).extend({ allow_internet_access: z.boolean().optional() });

/** `POST /sandboxes/{id}/timeout` (E2B's `SandboxTimeoutRequest`). */
export const SandboxTimeoutRequest = z.object({ timeout: E2bTimeout });

/** `POST /sandboxes/{id}/connect` (E2B's `ConnectSandbox`). */
export const ConnectSandbox = z.object({ timeout: E2bTimeout });

/** `POST /sandboxes/{id}/resume`, deprecated by E2B for connect (E2B's `ResumedSandbox`). */
export const ResumedSandbox = z.object({
  timeout: E2bTimeout.optional(),
  autoPause: z.boolean().optional(),
});

/** `POST /sandboxes/{id}/pause` (E2B's `SandboxPauseRequest`). */
export const SandboxPauseRequest = z.object({ memory: z.boolean().optional() });

/** `POST /sandboxes/{id}/fork` (E2B's `SandboxForkRequest`); `count` within our per-call cap. */
export const SandboxForkRequest = z.object({
  count: z.int().min(1).max(MAX_FORK_COUNT).optional(),
  timeout: E2bTimeout.optional(),
});

/** `POST /sandboxes/{id}/snapshots` (E2B's `SandboxSnapshotRequest`); our snapshot name's bound. */
export const SandboxSnapshotRequest = z.object({ name: z.string().min(1).max(256).optional() });

/** E2B's sandbox states; `paused` is our `suspended`. */
export const E2bSandboxState = z.enum(["running", "paused"]);

/**
 * `GET /v2/sandboxes`. `state` is comma-separated (the SDK's `form`, `explode: false`) or
 * repeated; `metadata` is `k=v&...` with each key and value URL-encoded (the SDK's encoding).
 * The metadata string is bounded by what 16 label filters of the longest key and value encode to.
 */
export const ListSandboxesQuery = z.object({
  metadata: z
    .string()
    .max(16 * 3 * (63 + 256 + 2))
    .optional(),
  state: z.array(z.string().max(64)).max(8).optional(),
  template: TemplateId.optional(),
  startedAfter: z.string().max(64).optional(),
  order: z.enum(["asc", "desc"]).optional(),
  limit: ListLimit.optional(),
  nextToken: ListCursor.optional(),
});

/** `GET /sandboxes` (E2B's deprecated list of running sandboxes): one filter, no paging. */
export const LegacyListQuery = z.object({ metadata: ListSandboxesQuery.shape.metadata });

/** `GET /snapshots`. */
export const ListSnapshotsQuery = z.object({
  sandboxID: z.string().max(128).optional(),
  name: z.string().max(256).optional(),
  limit: ListLimit.optional(),
  nextToken: ListCursor.optional(),
});

/** Unix seconds, as the SDK sends `start` and `end` of `GET /sandboxes/{id}/metrics`. */
const UnixSeconds = z
  .string()
  .regex(/^\d{1,12}$/, "unix seconds")
  .transform(Number);

export const MetricsQuery = z.object({ start: UnixSeconds.optional(), end: UnixSeconds.optional() });

/**
 * `GET /sandboxes/metrics?sandbox_ids=a,b`: each id is one agent call, so a request names at
 * most 100 (E2B's own page size).
 */
export const MAX_METRICS_IDS = 100;
export const ManyMetricsQuery = z.object({ sandbox_ids: z.array(z.string().max(128)).min(1) });

// ---- answers (what the SDK reads) -----------------------------------------------------------

/** E2B's error body: the HTTP status again as `code`, and a message. */
export const E2bError = z.object({ code: z.int(), message: z.string() });

/** E2B's `Sandbox`: what create, connect, resume and fork answer. */
export const E2bSandbox = z.object({
  sandboxID: z.string().regex(/^[a-z0-9]+$/),
  templateID: z.string(),
  clientID: z.string(),
  envdVersion: z.string(),
  envdAccessToken: z.string(),
  domain: z.string().nullable(),
  trafficAccessToken: z.null(),
});

/** E2B's `ListedSandbox`. */
export const ListedSandbox = z.object({
  sandboxID: z.string(),
  templateID: z.string(),
  clientID: z.string(),
  metadata: z.record(z.string(), z.string()),
  startedAt: z.string(),
  endAt: z.string(),
  state: E2bSandboxState,
  cpuCount: z.int(),
  memoryMB: z.int(),
  diskSizeMB: z.int(),
  envdVersion: z.string(),
});

/** E2B's `SandboxDetail`. */
export const SandboxDetail = ListedSandbox.extend({
  envdAccessToken: z.string(),
  domain: z.string().nullable(),
  lifecycle: z.object({ onTimeout: z.enum(["kill", "pause"]), autoResume: z.boolean() }),
});

/** E2B's `SandboxMetric`. */
export const SandboxMetric = z.object({
  timestamp: z.string(),
  timestampUnix: z.int(),
  cpuCount: z.int(),
  cpuUsedPct: z.number(),
  memUsed: z.int(),
  memTotal: z.int(),
  memCache: z.int(),
  diskUsed: z.int(),
  diskTotal: z.int(),
});

/** E2B's `SnapshotInfo`. */
export const SnapshotInfo = z.object({ snapshotID: z.string(), names: z.array(z.string()) });
