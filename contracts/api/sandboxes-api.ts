/**
 * The sandboxes API bodies (docs/sandboxes.md "Rules of the sandboxes API", docs/templates.md "Rules of templates"): sandboxes, catalog, Pro bake, fork,
 * connect URLs, usage.
 */
import { z } from "zod";
import {
  ArgvCommands,
  checkExecOptions,
  Endpoints,
  ExecOptionFields,
  ExecTruncated,
  FileWrites,
  Labels,
  Rfc3339,
  SandboxId,
  SnapshotId,
  TemplateId,
  TimeoutSeconds,
} from "./common.ts";
import {
  IDLE_ACTIONS,
  MAX_FORK_COUNT,
  MAX_IDLE_TIMEOUT_S,
  MAX_IMAGE_REF_CHARS,
  MAX_MEM_MIB,
  MAX_PORT,
  MAX_SANDBOX_TIMEOUT_S,
  MAX_SEED_HEX_CHARS,
  MAX_SIZE_CLASSES,
  MAX_TEMPLATE_WIDTH,
  MAX_VCPUS,
  MIN_MEM_MIB,
  MIN_PORT,
  MIN_VCPUS,
  TIMEOUT_ACTIONS,
} from "./limits.ts";
import { LabelSelectors, ListCursor, ListLimit, NextCursor } from "./lists.ts";

// ---- catalog and templates (2.4, 3.2) ------------------------------------------------------

export const Visibility = z.enum(["public", "private"]);

export const CatalogEntry = z
  .object({
    id: TemplateId.describe("Pass as `template` when creating a sandbox."),
    name: z.string(),
    description: z.string(),
    visibility: Visibility,
    tier: z.string().optional().describe("Plan tier the image runs on, when applicable."),
  })
  .meta({ id: "CatalogEntry" });
export type CatalogEntry = z.infer<typeof CatalogEntry>;

export const CatalogList = z.object({ templates: z.array(CatalogEntry) }).meta({ id: "CatalogList" });

/** Bake phases in order (docs/templates.md "Rules of templates"); `Failed` is ours: the API's rules show no failure. */
export const BakePhase = z.enum(["Pending", "Converting", "Distributing", "Live", "Failed"]);
export type BakePhase = z.infer<typeof BakePhase>;

const Port = z.int().min(MIN_PORT).max(MAX_PORT);

/** Ready-state descriptor (2.4, 4.3). Semantics of `http`, `env`, `network` are not specified. */
export const ReadySpec = z
  .object({
    cmd: z.string().min(1).optional().describe("Starts the service detached; exits 0 once healthy."),
    http: z.string().optional().describe("Health URL inside the guest (semantics not specified)."),
    http_timeout_s: z.int().min(1).max(3600).optional(),
    ports: z.array(Port).max(64).optional().describe("Guest ports to expose to connect URLs."),
    env: z.record(z.string(), z.string()).optional(),
    network: z.unknown().optional().describe("Passed to the agent unchanged (semantics not specified)."),
  })
  .meta({ id: "ReadySpec" });
export type ReadySpec = z.infer<typeof ReadySpec>;

const Width = z.int().min(1).max(MAX_TEMPLATE_WIDTH);

/**
 * Credentials for the registry of a bake's image, used for that bake only: sent to the agent that
 * pulls, never stored (the template's record keeps no copy) and never logged. A registry token
 * (GHCR, Docker Hub, GitLab) is given as `password`.
 */
export const RegistryAuth = z
  .object({
    // Basic auth splits at the first ':'; control characters would break the header.
    username: z
      .string()
      .min(1)
      .max(256)
      .regex(/^[^:\p{Cc}]+$/u)
      .describe("Registry user name (no ':')."),
    password: z
      .string()
      .min(1)
      .max(8192)
      .regex(/^\P{Cc}+$/u)
      .describe("Password or access token."),
  })
  .meta({ id: "RegistryAuth" });
export type RegistryAuth = z.infer<typeof RegistryAuth>;

/** `POST /v1/templates` (sandboxes API, Pro): idempotent on (tenant, name); `name` becomes the id. */
/** A template's size class (docs/templates.md "Size classes"): a frozen snapshot of its own. */
export const SizeClass = z
  .object({
    vcpus: z.int().min(MIN_VCPUS).max(MAX_VCPUS),
    memory_mib: z.int().min(MIN_MEM_MIB).max(MAX_MEM_MIB),
  })
  .meta({ id: "SizeClass" });
export type SizeClass = z.infer<typeof SizeClass>;

export const BakeTemplateRequest = z
  .object({
    name: TemplateId.describe("Template name; also its id."),
    image: z.string().min(1).max(MAX_IMAGE_REF_CHARS).describe("OCI image reference."),
    registry_auth: RegistryAuth.optional().describe(
      "Credentials for the image's registry, for this bake only; never stored. Without them the pull is anonymous (or uses the operator's credentials for a registry the operator shares).",
    ),
    ready: ReadySpec.optional(),
    width: Width.optional().describe("Fan-out hint."),
    expected_width: Width.optional().describe("Pre-warms capacity for the first rollout."),
    sizes: z
      .array(SizeClass)
      .min(1)
      .max(MAX_SIZE_CLASSES)
      .optional()
      .describe(
        "The size classes sandboxes of this template may be created with, each frozen as a snapshot of its own at the bake; the first is the default. Without it: one class, the host's default size.",
      ),
  })
  .meta({ id: "BakeTemplateRequest" });
export type BakeTemplateRequest = z.infer<typeof BakeTemplateRequest>;

const Ms = z.number().min(0);
const Bytes = z.int().min(0);

/**
 * Readiness telemetry of a sandboxes API template (its fields are this service's choice: docs/templates.md "Template readiness telemetry").
 * Every member is optional: a member appears once the host agent has measured it (nothing while
 * Pending, the phase timings as they complete, all of them once Live; a template built by a driver
 * that does not measure a step lacks those members). The agent keeps them across its restarts.
 * Durations are milliseconds of wall time on the host agent; sizes are bytes on the host.
 */
export const TemplateTelemetry = z
  .object({
    pending_ms: Ms.optional().describe(
      "Pending: from the build request at the agent to the start of the build.",
    ),
    converting_ms: Ms.optional().describe(
      "Converting: image to frozen snapshot (pull_ms + import_ms + boot_ms + ready_cmd_ms + snapshot_ms).",
    ),
    pull_ms: Ms.optional().describe(
      "Part of converting: resolving and fetching the image from its registry (a digest already in the host's cache is only resolved).",
    ),
    import_ms: Ms.optional().describe("Part of converting: unpacking the image into a bootable disk."),
    boot_ms: Ms.optional().describe("Part of converting: QEMU start to the guest agent answering."),
    ready_cmd_ms: Ms.optional().describe(
      "Part of converting: the ready command (`ready.cmd`); 0 without one.",
    ),
    snapshot_ms: Ms.optional().describe("Part of converting: guest sync, pause and device-state save."),
    distributing_ms: Ms.optional().describe(
      "Distributing: registering the snapshot files so sandboxes can be restored from them.",
    ),
    total_ms: Ms.optional().describe("Build request at the agent to Live."),
    snapshot_bytes: z
      .object({
        memory: Bytes.describe("Guest RAM file as stored (allocated bytes, shared by every fork)."),
        device_state: Bytes.describe("Saved device state (CPU, devices)."),
        disk: Bytes.describe("Frozen copy-on-write disk overlay (allocated bytes)."),
      })
      .optional()
      .describe("Size of the frozen snapshot."),
  })
  .meta({ id: "TemplateTelemetry" });
export type TemplateTelemetry = z.infer<typeof TemplateTelemetry>;

export const TemplateB = z
  .object({
    id: TemplateId,
    name: z.string(),
    description: z.string(),
    visibility: Visibility,
    tier: z.string().optional(),
    image: z.string().optional(),
    phase: BakePhase,
    error: z.string().optional().describe("Present when the phase is Failed."),
    exposed_ports: z.array(Port),
    telemetry: TemplateTelemetry,
    sizes: z
      .array(SizeClass)
      .optional()
      .describe(
        "The size classes a create may ask for, the default first; absent: the host's default size only.",
      ),
  })
  .meta({ id: "TemplateB" });
export type TemplateB = z.infer<typeof TemplateB>;

export const ExpectRequest = z.object({ width: Width }).meta({ id: "ExpectRequest" });
export const ExpectResponse = z.object({ id: TemplateId, width: z.int() }).meta({ id: "ExpectResponse" });
export const ReleaseResponse = z
  .object({ id: TemplateId, released: z.literal(true) })
  .meta({ id: "ReleaseResponse" });
export const DeleteTemplateResponseB = z
  .object({ deleted: z.literal(true), id: TemplateId })
  .meta({ id: "DeleteTemplateResponseB" });

// ---- sandboxes (2.5) -----------------------------------------------------------------------

/**
 * A sandbox's state as clients see it. The gateway's record states (gateway/core/record-states.ts)
 * and the agent's VM states (agent/sandbox/states.ts) are finer; this is what they show as.
 */
export const PublicSandboxState = z.enum(["running", "suspended"]);

/** Seconds without a call after which the service acts on the sandbox (`idle_action`). */
export const IdleTimeoutSeconds = z
  .int()
  .min(1)
  .max(MAX_IDLE_TIMEOUT_S)
  .describe(
    "Seconds with no exec, no call in flight and no open connect relay after which the service applies `idle_action`, within about a second.",
  );
export const IdleAction = z.enum(IDLE_ACTIONS);

/** The absolute lifetime, seconds from the call that sets it (create, `POST .../timeout`) or a resume. */
export const SandboxTimeoutSeconds = z
  .int()
  .min(1)
  .max(MAX_SANDBOX_TIMEOUT_S)
  .describe(
    "Absolute lifetime in seconds, counted from this call (and again from each resume): at its end the service applies `on_timeout`, whatever the sandbox is doing, within about a second.",
  );
export const TimeoutAction = z.enum(TIMEOUT_ACTIONS);

/** `POST /v1/sandboxes/{id}/timeout`: a new absolute lifetime, counted from this call. */
export const SetTimeoutRequest = z
  .object({
    timeout_seconds: SandboxTimeoutSeconds,
    on_timeout: TimeoutAction.optional().describe(
      "What the deadline does; without it the sandbox's own (`delete` if it had none).",
    ),
  })
  .meta({ id: "SetTimeoutRequest" });
export type SetTimeoutRequest = z.infer<typeof SetTimeoutRequest>;

export const SetTimeoutResponse = z
  .object({
    id: SandboxId,
    timeout_seconds: z.int(),
    on_timeout: TimeoutAction,
    expires_at: Rfc3339.optional().describe(
      "When `on_timeout` applies; absent for a suspended sandbox whose deadline suspends it (the next resume counts `timeout_seconds` from then).",
    ),
  })
  .meta({ id: "SetTimeoutResponse" });

/**
 * A sandbox's egress policy, as `POST /v1/sandboxes` takes it and `PUT /v1/sandboxes/{id}/egress`
 * sets it (docs/egress.md). Bounds: 256 entries (MAX_EGRESS_ENTRIES of contracts/egress.ts, whose
 * parser needs node:net and so stays out of this file), each at most a host name's 253
 * characters; the entries' syntax is contracts/egress.ts's (a malformed one is 400).
 */
export const Egress = z
  .object({ allow: z.array(z.string().min(1).max(253)).max(256) })
  .loose()
  .meta({ id: "Egress" });

/** `PUT /v1/sandboxes/{id}/egress`: the sandbox's egress as now in force. */
export const SetEgressResponse = z
  .object({
    id: SandboxId,
    egress: z.object({ allow: z.array(z.string()) }).describe("The allow-list in force from this call on."),
  })
  .meta({ id: "SetEgressResponse" });

export const CreateSandboxRequest = z
  .object({
    template: TemplateId.optional().describe("The template to start from; send this or `snapshot`."),
    snapshot: SnapshotId.optional().describe(
      "A ready snapshot of the tenant's to start from instead of a template: the new sandbox has its processes, memory and files as they were when it was taken, on the host that keeps it.",
    ),
    label: z.string().max(256).optional().describe("Single convenience label; stored as labels.label."),
    labels: Labels.optional(),
    egress: Egress.optional().describe(
      "Egress policy; `allow` lists permitted host names. Internal addresses (loopback, private, link-local, cloud metadata, the host's own) stay unreachable whatever it lists; only the operator opens them.",
    ),
    idle_timeout_seconds: IdleTimeoutSeconds.optional().describe(
      "Idle lifetime: with no exec, call in flight or open connect relay for this long the service applies `idle_action`. Without it the operator's default applies (none unless the operator set one).",
    ),
    idle_action: IdleAction.optional().describe(
      "`suspend` (default): the service suspends the sandbox, and its next exec, fork or connect resumes it first. `delete`: the service deletes it (later calls get 404).",
    ),
    timeout_seconds: SandboxTimeoutSeconds.optional().describe(
      "Absolute lifetime in seconds from create (and again from each resume); `POST /v1/sandboxes/{id}/timeout` changes it. At its end the service applies `on_timeout` within about a second, whatever the sandbox is doing. Without it: none.",
    ),
    on_timeout: TimeoutAction.optional().describe(
      "`delete` (default): the sandbox is deleted at its deadline (later calls get 404). `suspend`: it is suspended, and its next exec, fork or connect resumes it first.",
    ),
    vcpus: z
      .int()
      .min(MIN_VCPUS)
      .max(MAX_VCPUS)
      .optional()
      .describe(
        "With `memory_mib` (either alone is enough when it names one class): one of the template's size classes (`sizes` of the template). Without both: the template's default size. Another size is 400 `size_unavailable`; with `snapshot` only the snapshot's own size is allowed.",
      ),
    memory_mib: z
      .int()
      .min(MIN_MEM_MIB)
      .max(MAX_MEM_MIB)
      .optional()
      .describe("Guest RAM in MiB; see `vcpus`."),
  })
  .refine((b) => (b.template === undefined) !== (b.snapshot === undefined), {
    message: "send template or snapshot, one of them",
  })
  .meta({ id: "CreateSandboxRequest" });
export type CreateSandboxRequest = z.infer<typeof CreateSandboxRequest>;

export const CreateSandboxResponse = z
  .object({
    id: SandboxId,
    template: TemplateId,
    snapshot: SnapshotId.optional().describe("The snapshot it was created from, if any."),
    state: z.literal("running"),
    fork_time_ms: z.number(),
    create_time_ms: z.number(),
    endpoints: Endpoints,
  })
  .meta({ id: "CreateSandboxResponse" });

export const SandboxInfo = z
  .object({
    id: SandboxId,
    template: TemplateId,
    state: PublicSandboxState,
    age_secs: z.number(),
    idle_secs: z.number(),
    exec_count: z.int(),
    labels: z.record(z.string(), z.string()),
    endpoints: Endpoints,
    vcpus: z.int().optional().describe("The sandbox's vCPUs (its size class); absent before it has started."),
    memory_mib: z.int().optional().describe("The sandbox's guest RAM, MiB; absent before it has started."),
    idle_timeout_seconds: z
      .int()
      .optional()
      .describe("The idle lifetime in force (asked for, or the operator's default); absent: none."),
    idle_action: IdleAction.optional().describe("What the idle lifetime does; with `idle_timeout_seconds`."),
    suspended_by: z
      .enum(["user", "idle", "timeout"])
      .optional()
      .describe(
        "While `suspended`: `idle` when the service suspended it for idleness, `timeout` at its absolute deadline (the next exec, fork or connect resumes either), `user` when a suspend call did (it stays suspended until resumed).",
      ),
    timeout_seconds: z
      .int()
      .optional()
      .describe("The absolute lifetime last asked for (create, `POST .../timeout`); absent: none."),
    on_timeout: TimeoutAction.optional().describe("What the deadline does; with `timeout_seconds`."),
    expires_at: Rfc3339.optional().describe(
      "When `on_timeout` applies; absent while suspended when the next resume starts the lifetime again.",
    ),
  })
  .meta({ id: "SandboxInfo" });

export const MetricsSample = z
  .object({
    at: Rfc3339,
    cpu_percent: z
      .number()
      .nullable()
      .describe(
        "Host CPU time of the sandbox's VM process per wall time since the previous sample, in % of one host core (a VM with 2 vCPUs busy shows up to ~200); null on the first sample after a start or resume.",
      ),
    memory_used_bytes: z
      .int()
      .describe(
        "Host memory the sandbox alone holds: the guest pages it has written and its VM process's own memory (the process's private resident memory).",
      ),
    memory_resident_bytes: z
      .int()
      .describe(
        "The VM process's whole resident set, including template memory it shares with other sandboxes.",
      ),
    disk_used_bytes: z
      .int()
      .describe("Bytes allocated on the host to the sandbox's own disk (its copy-on-write layer)."),
  })
  .meta({ id: "MetricsSample" });

export const SandboxMetrics = z
  .object({
    id: SandboxId,
    state: z
      .enum(["starting", "running", "suspended"])
      .describe(
        "`suspended`: the samples are the last ones taken while it ran; none are added until it runs again.",
      ),
    vcpus: z.int().optional(),
    memory_limit_bytes: z.int().optional().describe("The guest's RAM size."),
    interval_s: z.number().describe("Seconds between samples."),
    current: MetricsSample.nullable().describe("The newest sample; null before the first."),
    samples: z
      .array(MetricsSample)
      .describe("The last samples, oldest first (at most 60: two minutes at 2 s)."),
  })
  .meta({ id: "SandboxMetrics" });

export const SandboxList = z
  .object({
    sandboxes: z.array(z.object({ id: SandboxId, template: TemplateId, state: PublicSandboxState })),
    next_cursor: NextCursor,
  })
  .meta({ id: "SandboxList" });

/** `GET /v1/sandboxes` (docs/lists.md): filters, AND-ed, and the page. */
export const SandboxListQuery = z.object({
  label: LabelSelectors.optional(),
  state: PublicSandboxState.optional().describe("Only sandboxes in this state."),
  template: TemplateId.optional().describe("Only sandboxes of this template id."),
  limit: ListLimit.optional(),
  cursor: ListCursor.optional(),
});

export const StateResponse = z
  .object({
    id: SandboxId,
    state: PublicSandboxState,
    mem_bytes: z.int().describe("On suspend: size of the on-disk memory image."),
  })
  .meta({ id: "StateResponse" });

export const DeleteSandboxResponse = z
  .object({ deleted: z.literal(true), id: SandboxId })
  .meta({ id: "DeleteSandboxResponse" });

// ---- exec (2.6) ----------------------------------------------------------------------------

export const ExecRequestB = z
  .object({
    files: FileWrites.optional().describe("Written before the command."),
    command: z.string().min(1).optional().describe("A command line, run by /bin/sh -c."),
    commands: ArgvCommands.optional().describe("Argv arrays run in order; the response reflects the last."),
    timeout_seconds: TimeoutSeconds.optional(),
    seed: z
      .string()
      .regex(new RegExp(`^[0-9a-fA-F]{1,${MAX_SEED_HEX_CHARS}}$`), "hex string")
      .optional()
      .describe("Echoed back."),
    ...ExecOptionFields,
  })
  .refine(checkExecOptions, { message: "send stdin or stdin_b64, not both" })
  .refine((b) => b.command !== undefined || b.commands !== undefined || b.files !== undefined, {
    message: "send command, commands or files",
  })
  .refine((b) => !(b.command !== undefined && b.commands !== undefined), {
    message: "send command or commands, not both",
  })
  .meta({ id: "ExecRequestB" });
export type ExecRequestB = z.infer<typeof ExecRequestB>;

export const ExecResponseB = z
  .object({
    id: SandboxId,
    stdout: z.string(),
    stderr: z.string(),
    exit_code: z.int(),
    fork_time_ms: z.number().describe("0 for an existing sandbox."),
    exec_time_ms: z.number(),
    total_time_ms: z.number(),
    seed: z.string().optional(),
    seed_ack: z.string().optional().describe("`verified` when the guest saw the seed."),
    truncated: ExecTruncated,
  })
  .meta({ id: "ExecResponseB" });

// ---- fork (2.7) ----------------------------------------------------------------------------

export const ForkRequest = z
  .object({
    count: z
      .int()
      .min(1)
      .max(MAX_FORK_COUNT)
      .optional()
      .describe("Default 1; per-call cap by tier (Pro 32, Enterprise 64)."),
    labels: z.array(z.string().max(256)).optional().describe("One per child, stored as labels.label."),
  })
  .refine((b) => b.labels === undefined || b.labels.length <= (b.count ?? 1), {
    message: "at most one label per child",
  })
  .meta({ id: "ForkRequest" });
export type ForkRequest = z.infer<typeof ForkRequest>;

export const ForkResponse = z
  .object({
    parent: SandboxId,
    children: z.array(z.object({ id: SandboxId, endpoints: Endpoints })),
  })
  .meta({ id: "ForkResponse" });

// ---- snapshots (docs/snapshots.md) ------------------------------------------------------------

/**
 * `lost`: its host was declared lost (gateway/core/host-loss.ts), or its live host no longer keeps
 * its files (gateway/core/reconcile.ts); the files are gone unless they come back with that host,
 * when it reads `ready` again (docs/snapshots.md).
 */
export const SnapshotState = z.enum(["creating", "ready", "failed", "lost"]);

export const CreateSnapshotRequest = z
  .object({
    name: z.string().min(1).max(256).optional().describe("A name for people; not unique."),
    labels: Labels.optional(),
  })
  .meta({ id: "CreateSnapshotRequest" });
export type CreateSnapshotRequest = z.infer<typeof CreateSnapshotRequest>;

export const RestoreRequest = z
  .object({
    snapshot: SnapshotId.describe(
      "A ready snapshot of the caller's, kept on the sandbox's host, of the same template and size.",
    ),
  })
  .meta({ id: "RestoreRequest" });

export const RestoreResponse = z
  .object({
    id: SandboxId,
    state: z.literal("running"),
    snapshot: SnapshotId,
    restore_ms: z
      .number()
      .describe(
        "The rollback on its host, ms: from the agent taking the call to the restored guest answering.",
      ),
    down_ms: z
      .number()
      .describe("Of that, the time the sandbox's VM was down (old one stopped, new one not yet answering)."),
  })
  .meta({ id: "RestoreResponse" });

export const SnapshotInfo = z
  .object({
    id: SnapshotId,
    state: SnapshotState,
    source_sandbox: SandboxId.describe("The sandbox it was taken of."),
    template: TemplateId.describe("The source sandbox's template: the base of the snapshot's disk."),
    name: z.string().optional(),
    labels: z.record(z.string(), z.string()),
    size_bytes: z.int().describe("Bytes the snapshot keeps on its host (memory image and disk overlay)."),
    created_at: Rfc3339,
    ready_at: Rfc3339.optional(),
    error: z.string().optional().describe("Why a `failed` snapshot failed."),
  })
  .meta({ id: "SnapshotInfo" });

export const SnapshotListQuery = z.object({
  label: LabelSelectors.optional(),
  state: SnapshotState.optional().describe("Only snapshots in this state."),
  source_sandbox: SandboxId.optional().describe("Only snapshots taken of this sandbox."),
  template: TemplateId.optional().describe("Only snapshots whose source had this template id."),
  limit: ListLimit.optional(),
  cursor: ListCursor.optional(),
});

export const SnapshotList = z
  .object({ snapshots: z.array(SnapshotInfo), next_cursor: NextCursor })
  .meta({ id: "SnapshotList" });

export const DeleteSnapshotResponse = z
  .object({ deleted: z.literal(true), id: SnapshotId })
  .meta({ id: "DeleteSnapshotResponse" });

// ---- connect (2.8) -------------------------------------------------------------------------

export const TunnelProtocol = z.enum(["tcp", "cdp"]);
export type TunnelProtocol = z.infer<typeof TunnelProtocol>;

export const ConnectUrlRequest = z
  .object({
    port: Port,
    ttl_seconds: z.int().min(1).describe("Clamped down to 3600."),
    protocol: TunnelProtocol.optional().describe("Default tcp."),
  })
  .meta({ id: "ConnectUrlRequest" });

export const ConnectUrlResponse = z
  .object({ url: z.string(), expires_at: Rfc3339 })
  .meta({ id: "ConnectUrlResponse" });

export const ConnectQuery = z.object({
  port: z
    .string()
    .regex(/^\d{1,5}$/)
    .transform(Number)
    .pipe(Port),
  protocol: TunnelProtocol.optional().describe("Default tcp; must be the token's."),
  t: z
    .string()
    .min(1)
    .max(512)
    .optional()
    .describe("The scoped token of a connect URL (connect-url); without it, a Bearer key."),
});

// ---- usage (2.9) ---------------------------------------------------------------------------

export const UsageQuery = z.object({
  from: Rfc3339.optional().describe("Default: start of the current UTC month."),
  to: Rfc3339.optional().describe("Default: now."),
});

export const UsageResponse = z
  .object({
    from: Rfc3339,
    to: Rfc3339,
    totals: z.object({
      cpu_core_hours: z.number(),
      ram_gb_hours: z.number(),
      disk_gb_hours: z.number(),
      snapshot_gb_months: z.number(),
    }),
  })
  .meta({ id: "UsageResponse" });
