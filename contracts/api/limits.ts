/**
 * Every numeric limit of the public API, in one place. Values the API fixes point to the doc that
 * states the rule; the others are our choices, each argued in docs/limits.md. All of them are
 * defaults: `GatewayConfig.limits` (gateway/config.ts) overrides any of them per deployment
 * (an operator tunes the session cap, idle TTL and reaper interval: the settings of cli/settings/).
 */
import { DEFAULT_DISK_RESERVE_BYTES } from "../disk-space.ts";
import { EXEC_OUTPUT_MAX } from "../guest-protocol.ts";
import type { Tier } from "./tiers.ts";

/** docs/limits.md "Public API limits": 100 requests per second per key, 429 beyond. */
export const RATE_LIMIT_PER_SECOND = 100;

/** docs/sandboxes.md "Rules of the sandboxes API"; docs/sessions.md "Rules of the sessions API"; docs/limits.md "Public API limits": `timeout_seconds` defaults to 30. */
export const DEFAULT_EXEC_TIMEOUT_S = 30;
/**
 * Our choice (docs/limits.md "Public API limits"): an exec holds an HTTP request open for its whole run, and load
 * balancers commonly cut idle requests around 10 minutes; longer work belongs in a session.
 */
export const MAX_EXEC_TIMEOUT_S = 600;

/**
 * Our choice: largest JSON request body (exec code plus `files`). 10 MiB fits real source trees
 * and fixtures while bounding what one request can make the gateway hold in memory. Template
 * image uploads are streamed to disk and have their own limit below. Exceeding it gives 413.
 */
export const MAX_JSON_BODY_BYTES = 10 * 1024 * 1024;

/**
 * Our choice: largest uploaded template image (sessions API `POST /v1/templates`). The API allows
 * multi-GB images; 20 GiB covers large ML images while stopping a runaway upload from filling
 * the disk. The body is streamed to a file, never held in memory.
 */
export const MAX_TEMPLATE_UPLOAD_BYTES = 20 * 1024 * 1024 * 1024;

/**
 * Our choice (docs/limits.md "Public API limits"): an exec's stdout and stderr together carry at most this many bytes
 * (1,044,480: one guest RESPONSE frame less its other fields); the response then says
 * `truncated: true`. The guest discards the rest as it is written, so neither the guest, the
 * agent nor the gateway holds more. JSON escapes a control byte as `\u00XX` (6 bytes), so one
 * exec's JSON response is at most 6 x 1,044,480 + 512 = 6,267,392 bytes.
 */
export const MAX_EXEC_OUTPUT_BYTES = EXEC_OUTPUT_MAX;
/** The worst-case JSON size of one exec response (see MAX_EXEC_OUTPUT_BYTES). */
export const MAX_EXEC_RESPONSE_BYTES = 6 * MAX_EXEC_OUTPUT_BYTES + 512;

/**
 * Our choice: most executions in one `POST /v1/exec/batch`. Each runs in its own VM at once,
 * so this bounds one call's fan-out; 64 matches the largest fork fan-out (Enterprise).
 */
export const MAX_BATCH_EXECUTIONS = 64;

/**
 * docs/sandboxes.md "Rules of the sandboxes API": fork `count` per call is capped by tier (Pro 32, Enterprise 64; call again
 * for more). Demo is our choice (the API names no demo cap): 4, enough to try fork.
 * A session fork (sessions API) makes exactly one child per call (its body is not specified).
 */
export const FORK_CAP_BY_TIER: Readonly<Record<Tier, number>> = {
  live: 1,
  scale: 1,
  demo: 4,
  pro: 32,
  enterprise: 64,
};

/** docs/sandboxes.md "Rules of the sandboxes API": connect-url `ttl_seconds` above 3600 is clamped down to 3600. */
export const CONNECT_TTL_MAX_S = 3600;

/**
 * Our choice: live sessions API sessions per tenant (docs/limits.md "Public API limits" "live-session cap", 429 on
 * create). 100 lets an agent framework keep one session per worker for a sizeable pool.
 */
export const SESSION_CAP_PER_TENANT = 100;

/**
 * Our choice: concurrently running sandboxes API sandboxes per tenant, by tier (docs/api.md "Rules every route shares"
 * `quota_exceeded`). Suspended sandboxes do not count: they hold no CPU or memory.
 */
export const SANDBOX_QUOTA_BY_TIER: Readonly<Record<Tier, number>> = {
  live: 0,
  scale: 0,
  demo: 5,
  pro: 200,
  enterprise: 1000,
};

/**
 * Our choice (docs/quotas-and-usage.md "Disk budgets"): suspended sandboxes API sandboxes per tenant, by tier,
 * counted apart from the running quota: a suspended sandbox holds no CPU but keeps its RAM image
 * on the host's disk (up to its memory size) and may pin a RAM file on tmpfs, so a tenant that
 * suspends without end would fill the disk. A suspend beyond it is 429 `quota_exceeded`; resume
 * or delete one first. The same numbers as the running quota: a tenant may park every sandbox it
 * may run, and no more.
 */
export const SUSPENDED_QUOTA_BY_TIER: Readonly<Record<Tier, number>> = {
  live: 0,
  scale: 0,
  demo: 5,
  pro: 200,
  enterprise: 1000,
};

/**
 * Our choice (docs/quotas-and-usage.md "Disk budgets"): snapshots one tenant may keep (creating or
 * ready), by tier. Each keeps its memory image (up to the sandbox's RAM) and its disk overlay on
 * the host that took it, until deleted; half the suspended quota, since a snapshot outlives its
 * sandbox (nothing ends it but a delete) where a suspended sandbox is one the tenant still runs.
 * A snapshot beyond it is 429 `quota_exceeded`; delete one first.
 */
export const SNAPSHOT_QUOTA_BY_TIER: Readonly<Record<Tier, number>> = {
  live: 0,
  scale: 0,
  demo: 2,
  pro: 100,
  enterprise: 500,
};

/**
 * Our choice (docs/quotas-and-usage.md "Disk budgets"): templates one tenant may own (building, ready or
 * failed), by tier. Each holds a base disk and a RAM file on every agent of its region, so the
 * count bounds what one tenant makes every host keep. Registering or baking beyond it is 429
 * `quota_exceeded`; delete one first. Live and demo keys cannot register templates at all.
 */
export const TEMPLATE_QUOTA_BY_TIER: Readonly<Record<Tier, number>> = {
  live: 0,
  scale: 50,
  demo: 0,
  pro: 100,
  enterprise: 500,
};

/**
 * Our choice: a sessions API session idle (no exec) longer than this is reclaimed (docs/sessions.md "Rules of the sessions API");
 * later calls get 410. 15 minutes outlasts a human's think-time between agent steps while
 * bounding the memory an abandoned session holds.
 */
export const SESSION_IDLE_TTL_S = 15 * 60;

/**
 * Our choice: how often the reaper looks for idle sessions. 30 s keeps the overshoot past the
 * TTL at most 30 s (about 3% of the TTL) at the cost of one indexed query per interval.
 */
export const REAPER_INTERVAL_S = 30;

/**
 * Our choice: the largest `idle_timeout_seconds` a sandbox or session may ask for (and the
 * largest operator default, `SANDBOXD_IDLE_TIMEOUT`): 7 days, the same bound as the session TTL
 * setting. A sandbox meant to idle longer than a week should be suspended by its owner; a larger
 * value is far more likely a unit mistake (milliseconds) than a wish.
 */
export const MAX_IDLE_TIMEOUT_S = 7 * 24 * 3600;

/**
 * What the service does with a sandbox idle past its `idle_timeout_seconds`: `suspend` it (KeyApi
 * B only: its memory goes to disk, the next call resumes it) or `delete` it.
 */
export const IDLE_ACTIONS = ["suspend", "delete"] as const;

/**
 * Our choice: the longest absolute lifetime (`timeout_seconds` at create or `POST .../timeout`):
 * 30 days, a billing month. It is a lifetime, not an idle bound, so it may be longer than
 * `MAX_IDLE_TIMEOUT_S`: a sandbox that is suspended at its deadline keeps its state on disk, and
 * one meant to outlive a month has no lifetime at all (send none). A larger value is far more
 * likely a unit mistake (milliseconds) than a wish. The smallest is 1 s: the deadline timer acts
 * within about a second, so a shorter one could not be kept.
 */
export const MAX_SANDBOX_TIMEOUT_S = 30 * 24 * 3600;

/**
 * What the service does with a sandbox at its absolute deadline (`on_timeout`): `delete` it (the
 * default, as E2B users expect: the sandbox is gone at its timeout) or `suspend` it (its next
 * exec, fork or connect resumes it, as after an idle suspend).
 */
export const TIMEOUT_ACTIONS = ["delete", "suspend"] as const;

/**
 * Our choice: connect relays (WebSockets of `GET /v1/sandboxes/{id}/connect`) one tenant may hold
 * open on one gateway process; the next is refused with 429 `quota_exceeded` before the upgrade.
 * Each relay holds at most one client message plus its back-pressure margin (docs/connect.md
 * "Connect relays"), so this bounds what one tenant can make a gateway hold. 100 is a browser per
 * agent worker plus a database pool each for a sizeable fleet of workers.
 */
export const RELAYS_PER_TENANT = 100;

/** Our choice: longest `GET /v1/usage` window, so one query scans at most a year of intervals. */
export const MAX_USAGE_WINDOW_S = 366 * 24 * 3600;

/** Our choice: label bounds (count, key and value lengths), like Kubernetes label limits. */
export const MAX_LABELS = 64;
export const MAX_LABEL_KEY_CHARS = 63;
export const MAX_LABEL_VALUE_CHARS = 256;

/** Our choice: files written by one exec; the byte total is bounded by MAX_JSON_BODY_BYTES. */
export const MAX_EXEC_FILES = 1000;
/** Linux PATH_MAX. */
export const MAX_PATH_CHARS = 4096;

/** Our choice: Pro bake fan-out hints (`width`, `expected_width`, expect `width`). */
export const MAX_TEMPLATE_WIDTH = 10_000;

// ---- bounds the gateway and the agent both check -------------------------------------------
// The public schemas (contracts/api/) and the agent's contract (contracts/agent/schemas.ts, and
// the template builder) read these same constants, so a value the gateway accepts is one the
// agent accepts: the gateway refuses a value outside them with 400 before doing any work (an
// image upload's body is never read), instead of the agent failing the work afterwards.
// tests/integration/shared-limits.test.ts walks SHARED_BOUNDS and probes both sides with max and max + 1.

/**
 * Our choice: guest RAM of a template, MiB. 64 MiB leaves the guest kernel, its initramfs and the
 * guest agent room to boot with a small workload (the default is 256); 64 GiB is the most one
 * template may freeze into a RAM file on the host's tmpfs (the builder also checks the tmpfs has
 * that much free before it starts).
 */
export const MIN_MEM_MIB = 64;
export const MAX_MEM_MIB = 65_536;
/** Our choice: vCPUs of a template's VMs; 64 is QEMU microvm's practical ceiling for one guest. */
export const MIN_VCPUS = 1;
export const MAX_VCPUS = 64;
/**
 * Our choice: size classes of one template (docs/templates.md "Size classes"), the default one
 * included. Each is a frozen snapshot of its own, built one after another in the template's build
 * slot: 4 keeps a bake within 4 boots and 4 RAM files on the host's tmpfs.
 */
export const MAX_SIZE_CLASSES = 4;
/**
 * Our choice: `wait_secs` of a sessions API template registration, how long its build waits for the
 * VM to come up (QEMU start to the guest agent's answer). At least 1 s (a cold boot under TCG
 * takes a few); at most an hour, past which a guest that has not answered is broken.
 */
export const MIN_WAIT_SECS = 1;
export const MAX_WAIT_SECS = 3600;
/** Our choice: argv commands in one exec (`commands`); each is one guest round trip. */
export const MAX_EXEC_COMMANDS = 64;
/**
 * The most any deployment may raise `maxExecTimeoutS` to: the agent holds an exec's HTTP request
 * (and its guest request) open for this long at most. `resolveConfig` refuses a larger setting.
 */
export const EXEC_TIMEOUT_CEILING_S = 3600;
/**
 * docs/sandboxes.md "Rules of the sandboxes API": the largest per-call fork `count` of any tier (Enterprise 64). The agent
 * refuses more; `resolveConfig` refuses a `forkCapByTier` above it.
 */
export const MAX_FORK_COUNT = 64;
/** Our choice: the sandboxes API `seed`, hex characters (64 bytes of entropy at most). */
export const MAX_SEED_HEX_CHARS = 128;
/** Our choice: length of an OCI image reference to bake (registry, path, tag and digest). */
export const MAX_IMAGE_REF_CHARS = 1024;
/** TCP ports: a connect URL's port, a bake's `ready.ports`, the agent's tunnel port. */
export const MIN_PORT = 1;
export const MAX_PORT = 65_535;
/**
 * The most any deployment may raise `maxJsonBodyBytes` to (`resolveConfig` refuses more). The
 * gateway re-encodes a request's files for the agent no larger than the client sent them (JSON
 * escapes the same characters both ways), so the agent's own body limit is this plus
 * AGENT_BODY_MARGIN_BYTES for the fields it adds.
 */
export const JSON_BODY_CEILING_BYTES = 32 * 1024 * 1024;
/** Room for what the gateway adds around a client's request (template, timeout, env, ...). */
export const AGENT_BODY_MARGIN_BYTES = 1024 * 1024;
/** The agent's JSON body limit (agent/api/app.ts). */
export const AGENT_MAX_JSON_BODY_BYTES = JSON_BODY_CEILING_BYTES + AGENT_BODY_MARGIN_BYTES;

/** Every bound both sides check, by name, for the test that probes both sides with each. */
export const SHARED_BOUNDS = {
  memMib: { min: MIN_MEM_MIB, max: MAX_MEM_MIB },
  vcpus: { min: MIN_VCPUS, max: MAX_VCPUS },
  waitSecs: { min: MIN_WAIT_SECS, max: MAX_WAIT_SECS },
  execFiles: { min: 0, max: MAX_EXEC_FILES },
  pathChars: { min: 1, max: MAX_PATH_CHARS },
  execCommands: { min: 1, max: MAX_EXEC_COMMANDS },
  execTimeoutS: { min: 1, max: EXEC_TIMEOUT_CEILING_S },
  forkCount: { min: 1, max: MAX_FORK_COUNT },
  seedHexChars: { min: 1, max: MAX_SEED_HEX_CHARS },
  imageRefChars: { min: 1, max: MAX_IMAGE_REF_CHARS },
  templateWidth: { min: 1, max: MAX_TEMPLATE_WIDTH },
  port: { min: MIN_PORT, max: MAX_PORT },
  jsonBodyBytes: { min: 1, max: JSON_BODY_CEILING_BYTES },
} as const satisfies Record<string, { min: number; max: number }>;

/**
 * The settings of a deployment's `Limits` that the agents cannot follow past a shared bound;
 * empty when every one is within. `resolveConfig` (gateway/config.ts) refuses a config with any.
 */
export function limitsBeyondAgent(l: Limits): string[] {
  const out: string[] = [];
  if (l.maxExecTimeoutS > EXEC_TIMEOUT_CEILING_S)
    out.push(`maxExecTimeoutS ${l.maxExecTimeoutS} is over ${EXEC_TIMEOUT_CEILING_S}`);
  if (l.maxJsonBodyBytes > JSON_BODY_CEILING_BYTES)
    out.push(`maxJsonBodyBytes ${l.maxJsonBodyBytes} is over ${JSON_BODY_CEILING_BYTES}`);
  for (const [tier, cap] of Object.entries(l.forkCapByTier))
    if (cap > MAX_FORK_COUNT) out.push(`forkCapByTier.${tier} ${cap} is over ${MAX_FORK_COUNT}`);
  return out;
}

/** The whole set, as the config carries it. */
export interface Limits {
  ratePerSecond: number;
  defaultExecTimeoutS: number;
  maxExecTimeoutS: number;
  maxJsonBodyBytes: number;
  maxTemplateUploadBytes: number;
  maxBatchExecutions: number;
  forkCapByTier: Record<Tier, number>;
  connectTtlMaxS: number;
  sessionCapPerTenant: number;
  relaysPerTenant: number;
  sandboxQuotaByTier: Record<Tier, number>;
  suspendedQuotaByTier: Record<Tier, number>;
  templateQuotaByTier: Record<Tier, number>;
  snapshotQuotaByTier: Record<Tier, number>;
  /**
   * Free space the gateway keeps on the disk of its upload directory: an upload that would leave
   * less is 507 `insufficient_storage` (contracts/disk-space.ts; `SANDBOXD_DISK_RESERVE_BYTES`).
   */
  diskReserveBytes: number;
  sessionIdleTtlS: number;
  reaperIntervalS: number;
  /**
   * The operator's default idle timeout of sandboxes API sandboxes created without one, seconds; 0 is
   * none (a sandbox runs until deleted, as without the setting). `SANDBOXD_IDLE_TIMEOUT`.
   */
  idleTimeoutS: number;
  /** What the operator's default timeout does (`SANDBOXD_IDLE_ACTION`). */
  idleAction: (typeof IDLE_ACTIONS)[number];
  maxUsageWindowS: number;
}

export const DEFAULT_LIMITS: Readonly<Limits> = Object.freeze({
  ratePerSecond: RATE_LIMIT_PER_SECOND,
  defaultExecTimeoutS: DEFAULT_EXEC_TIMEOUT_S,
  maxExecTimeoutS: MAX_EXEC_TIMEOUT_S,
  maxJsonBodyBytes: MAX_JSON_BODY_BYTES,
  maxTemplateUploadBytes: MAX_TEMPLATE_UPLOAD_BYTES,
  maxBatchExecutions: MAX_BATCH_EXECUTIONS,
  forkCapByTier: { ...FORK_CAP_BY_TIER },
  connectTtlMaxS: CONNECT_TTL_MAX_S,
  sessionCapPerTenant: SESSION_CAP_PER_TENANT,
  relaysPerTenant: RELAYS_PER_TENANT,
  sandboxQuotaByTier: { ...SANDBOX_QUOTA_BY_TIER },
  suspendedQuotaByTier: { ...SUSPENDED_QUOTA_BY_TIER },
  templateQuotaByTier: { ...TEMPLATE_QUOTA_BY_TIER },
  snapshotQuotaByTier: { ...SNAPSHOT_QUOTA_BY_TIER },
  diskReserveBytes: DEFAULT_DISK_RESERVE_BYTES,
  sessionIdleTtlS: SESSION_IDLE_TTL_S,
  reaperIntervalS: REAPER_INTERVAL_S,
  idleTimeoutS: 0,
  idleAction: "suspend",
  maxUsageWindowS: MAX_USAGE_WINDOW_S,
});

// ---- per-exec options (env, cwd, user, stdin) and streamed exec ------------------------------

/**
 * Our choice: most `env` entries on one exec. The request's env rides in the guest's one REQUEST
 * frame (1 MiB) beside the argv; 256 names is far past what real tools set per call.
 */
export const MAX_EXEC_ENV_ENTRIES = 256;
/**
 * Our choice: `env` names plus values of one exec, in UTF-8 bytes. 64 KiB leaves most of the
 * guest's 1 MiB REQUEST frame to the argv and stays under Linux's 128 KiB per-string limit
 * (MAX_ARG_STRLEN), so a value the kernel would refuse at execve is refused here first.
 */
export const MAX_EXEC_ENV_BYTES = 64 * 1024;
/** PATH_MAX: a longer `cwd` could not be chdir'ed into anyway. */
export const MAX_EXEC_CWD_CHARS = 4096;
/** Our choice: a user name (LOGIN_NAME_MAX-ish 32) or a decimal uid. */
export const MAX_EXEC_USER_CHARS = 32;
/**
 * Our choice: `stdin` (or the bytes of `stdin_b64`) of one exec. It is streamed to the guest in
 * 64 KiB frames, and the guest queues at most 16 MiB of stdin its command has not read yet
 * (guest/exec.c STDIN_QUEUE_LIMIT); 4 MiB stays well under that and, even as base64,
 * inside the 10 MiB JSON body.
 */
export const MAX_EXEC_STDIN_BYTES = 4 * 1024 * 1024;

// ---- the file API (`/files` of sandboxes and sessions) -------------------------------------

/**
 * Our choice: the largest file one `PUT .../files` uploads, and where a download stops. Both are
 * streamed end to end, so the bound is not about memory: it stops a runaway upload (or a download
 * of a file that never ends, such as a device) from running for hours. 4 GiB covers datasets and
 * model weights a sandbox works on; the guest's own disk is the real limit below it.
 */
export const MAX_FILE_TRANSFER_BYTES = 4 * 1024 * 1024 * 1024;
/**
 * Our choice: most entries one `list=true` answers. The guest sends them in one 1 MiB frame
 * (guest/fsops.c LIST_DIR_MAX is the same number); past it the answer says
 * `truncated: true` and the rest are not listed.
 */
export const MAX_LIST_ENTRIES = 10_000;

// ---- paged lists (`GET /v1/sandboxes`, `GET /v1/sessions`; docs/lists.md) -------------------

/**
 * Our choice: rows per page when the request names no `limit`. 50 fills a screen or a batch of
 * work without making a client that reads one page wait for hundreds of rows it did not ask for.
 */
export const DEFAULT_LIST_LIMIT = 50;
/**
 * Our choice: the largest `limit`. One page is one indexed range read and one JSON answer held by
 * the gateway; 200 keeps both small (a pro tenant's whole running quota), and a larger `limit` is
 * 400, not a silent clamp, like every other bound of the API.
 */
export const MAX_LIST_LIMIT = 200;
/**
 * Our choice: most `label=` filters in one list request. They are AND-ed into one jsonb
 * containment test, so the cost is small; the cap bounds the query string and what the cursor's
 * filter digest covers. 16 is more than any selector of a few labels needs.
 */
export const MAX_LABEL_FILTERS = 16;
/**
 * Our choice: the longest `cursor` accepted. The service's own are about 130 characters (a
 * position, a digest and a MAC in base64url); anything much longer is not one of them and is
 * refused before it is decoded.
 */
export const MAX_CURSOR_CHARS = 512;
