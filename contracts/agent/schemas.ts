/**
 * Every body of the agent's HTTP API (docs/agent-api.md), defined once and used by both sides:
 * the agent (agent/api/app.ts) parses requests with them into typed calls on its manager, and
 * the gateway's client (gateway/agents/client.ts) parses the answers with them. The TypeScript
 * types of the contract (api.ts) are inferred from these. Field names are camelCase: this API is
 * internal, between the gateway and its agents, not the public snake_case one.
 */
import { z } from "zod";
import { FileWrite as PublicFileWrite } from "../api/common.ts";
import {
  EXEC_TIMEOUT_CEILING_S,
  MAX_EXEC_COMMANDS,
  MAX_EXEC_FILES,
  MAX_FORK_COUNT,
  MAX_IMAGE_REF_CHARS,
  MAX_MEM_MIB,
  MAX_PORT,
  MAX_SEED_HEX_CHARS,
  MAX_SIZE_CLASSES,
  MAX_TEMPLATE_WIDTH,
  MAX_VCPUS,
  MAX_WAIT_SECS,
  MIN_MEM_MIB,
  MIN_PORT,
  MIN_VCPUS,
  MIN_WAIT_SECS,
} from "../api/limits.ts";
import { BakePhase, ReadySpec, RegistryAuth } from "../api/sandboxes-api.ts";
import { AgentErrorCode, SandboxdError } from "../errors.ts";

/**
 * The agent's key for a template. The gateway chooses it, unique across tenants: the template id
 * for public templates, `<tenantId>.<templateId>` for a tenant's own.
 */
export const TemplateRefParam = z
  .string()
  .regex(/^[A-Za-z0-9][A-Za-z0-9_.-]{0,160}$/)
  .refine((s) => !s.includes(".."));
/** The agent's handle for a VM; the gateway's sess_/sbx_ ids map to it in its db. */
export const VmIdParam = z.string().regex(/^vm-[0-9a-z-]{1,60}$/);

/** The API sets no exec timeout ceiling (docs/limits.md "Public API limits"); the shared ceiling bounds a request the gateway holds open. */
export const MAX_EXEC_TIMEOUT_MS = EXEC_TIMEOUT_CEILING_S * 1000;

/** The public shape itself: path bounds, `encoding` and the base64 check are the gateway's too. */
export const FileWrite = PublicFileWrite;

/** What to run after the files are written. */
export const RunAction = z.discriminatedUnion("kind", [
  /** Source code, run by the template's interpreter/entrypoint (sessions API `code`). */
  z.object({ kind: z.literal("code"), code: z.string() }),
  /** One command line run by /bin/sh -c (sandboxes API `command`). */
  z.object({ kind: z.literal("shell"), command: z.string().min(1) }),
  /** Argv arrays run in order, no shell; the result is the last one's (`commands`). */
  z.object({
    kind: z.literal("argv"),
    commands: z.array(z.array(z.string()).min(1)).min(1).max(MAX_EXEC_COMMANDS),
  }),
  /** Only write files. */
  z.object({ kind: z.literal("none") }),
]);

export const ExecBody = z.object({
  /** Written (created or overwritten) before anything runs. */
  files: z.array(FileWrite).max(MAX_EXEC_FILES).default([]),
  run: RunAction,
  /**
   * Hard limit for the whole action, ms; on expiry the process group is killed. The agent
   * defaults it to 30 s (docs/limits.md "Public API limits"); the gateway always sends it (api.ts `ExecAction`).
   */
  timeoutMs: z.int().min(1).max(MAX_EXEC_TIMEOUT_MS).optional(),
  /** The sandboxes API `seed`, handed to the guest; the agent reports `seedAck`. */
  seed: z.string().max(MAX_SEED_HEX_CHARS).optional(),
  /** Added to (and overriding) the image's Env. */
  env: z.record(z.string().regex(/^[A-Za-z_][A-Za-z0-9_]*$/), z.string()).optional(),
  /** Working directory of the files and commands instead of the image's WorkingDir. */
  cwd: z.string().startsWith("/").max(4096).optional(),
  /** A user name (looked up in the guest's /etc/passwd) or a decimal uid, instead of the image's User. */
  user: z.string().min(1).max(64).optional(),
  /**
   * Standard input of the (first) command, base64; then closed. The gateway bounds it
   * (MAX_EXEC_STDIN_BYTES); 16 MiB here is the guest's own stdin queue bound.
   */
  stdinB64: z
    .base64()
    .max(Math.ceil((16 * 1024 * 1024) / 3) * 4)
    .optional(),
});
export type ExecBody = z.infer<typeof ExecBody>;

export const CreateBody = z.object({
  template: TemplateRefParam,
  /** What the VM is for: affects idle handling only (sessions pause between calls). */
  kind: z.enum(["session", "sandbox"]),
  /** Egress policy (contracts/egress.ts); host names the guest may reach. Absent: the deployment default. */
  egressAllow: z.array(z.string()).optional(),
  /**
   * The size class to start (docs/templates.md "Size classes"): one the template was built with;
   * absent, its default one. Another size is `bad_request` (the gateway refuses it before).
   */
  vcpus: z.int().min(MIN_VCPUS).max(MAX_VCPUS).optional(),
  memMib: z.int().min(MIN_MEM_MIB).max(MAX_MEM_MIB).optional(),
});

/** One size class of a template (docs/templates.md "Size classes"). */
export const SizeClass = z.object({
  vcpus: z.int().min(MIN_VCPUS).max(MAX_VCPUS),
  memMib: z.int().min(MIN_MEM_MIB).max(MAX_MEM_MIB),
});

/** `PUT /vms/{id}/egress`: the allow-list in force from now on (contracts/egress.ts syntax). */
export const EgressBody = z.object({ egressAllow: z.array(z.string()) });

export const ExecOnceBody = z.object({ template: TemplateRefParam, action: ExecBody });

/** docs/limits.md "Public API limits": at most 64 children per fork call (Enterprise). */
export const ForkBody = z.object({ count: z.int().min(1).max(MAX_FORK_COUNT) });

/** The sandboxes API (Pro): bake from an OCI reference, optionally into a ready state (docs/templates.md "Rules of templates"). */
export const OciBuildBody = z.object({
  image: z.string().min(1).max(MAX_IMAGE_REF_CHARS),
  /** The tenant the bake is for (the agent's log names it beside each pull). */
  tenantId: z.string().min(1).max(200).optional(),
  /** This bake's registry credentials (the tenant's `registry_auth`); used for the pull only. */
  registryAuth: RegistryAuth.optional(),
  ready: ReadySpec.optional(),
  width: z.int().min(1).max(MAX_TEMPLATE_WIDTH).optional(),
  expectedWidth: z.int().min(1).max(MAX_TEMPLATE_WIDTH).optional(),
  /** The template's size classes, the first its default (docs/templates.md "Size classes"); absent: the agent's default size. */
  sizes: z.array(SizeClass).min(1).max(MAX_SIZE_CLASSES).optional(),
});

/** Query of `PUT /templates/:ref/upload` (sessions API register options, docs/sessions.md "Rules of the sessions API"). */
export const UploadQuery = z.object({
  memMib: z.coerce.number().int().min(MIN_MEM_MIB).max(MAX_MEM_MIB).optional(),
  vcpuCount: z.coerce.number().int().min(MIN_VCPUS).max(MAX_VCPUS).optional(),
  waitSecs: z.coerce.number().int().min(MIN_WAIT_SECS).max(MAX_WAIT_SECS).optional(),
});

export const WidthBody = z.object({ width: z.int().min(1).max(MAX_TEMPLATE_WIDTH) });

/** `GET /vms/{id}/tunnel?port=N`: a TCP port inside the guest. */
export const TunnelQuery = z.object({ port: z.coerce.number().int().min(MIN_PORT).max(MAX_PORT) });

export const DeleteQuery = z.object({
  force: z
    .enum(["true", "false", "1", "0"])
    .optional()
    .transform((v) => v === "true" || v === "1"),
});

// ---- answers (checked by the client) -------------------------------------------------------

export const ResourcesSchema = z.object({
  vcpus: z.number(),
  memMib: z.number(),
  /** Bytes of the VM's own writable disk (its copy-on-write overlay), for metering. */
  diskBytes: z.number(),
});

export const CreatedVmSchema = z.object({
  vmId: z.string(),
  /** Spawn time, ms (a per-call measurement). */
  forkTimeMs: z.number(),
  /** Total bring-up including the readiness probe, ms. */
  createTimeMs: z.number(),
  /** Exposed guest port (decimal string) -> connect hint (not a dialable address). */
  endpoints: z.record(z.string(), z.string()),
  resources: ResourcesSchema,
});

export const ExecResultSchema = z.object({
  stdout: z.string(),
  stderr: z.string(),
  exitCode: z.number(),
  execTimeMs: z.number(),
  totalTimeMs: z.number(),
  /** e.g. "verified" when the guest saw the seed. */
  seedAck: z.string().optional(),
  /**
   * Present, and true, only when stdout+stderr were cut at the exec output cap
   * (`MAX_EXEC_OUTPUT_BYTES`, contracts/guest-protocol.ts); absent otherwise, so an answer under
   * the cap is what it was before the flag existed.
   */
  truncated: z.literal(true).optional(),
});

export const OneShotResultSchema = ExecResultSchema.extend({
  forkTimeMs: z.number(),
  /** What the throwaway VM held, for metering the call (absent from an agent that predates it). */
  resources: ResourcesSchema.optional(),
});
export const ForkResultSchema = z.object({ children: z.array(CreatedVmSchema) });

/**
 * A kept snapshot's name on its agent (docs/snapshots.md): the gateway's `snap_` id. The agent
 * keeps the files under it until `DELETE /snapshots/{ref}` and the last VM made from them end.
 */
export const SnapshotRefParam = z.string().regex(/^snap_[a-z0-9]{1,60}$/);
export const TakeSnapshotBody = z.object({ snapshot: SnapshotRefParam });
/** `POST /vms/{id}/restore`: roll the VM back to kept snapshot `snapshot` in place. */
export const RestoreSnapshotBody = z.object({ snapshot: SnapshotRefParam });
export const SnapshotRestoredSchema = z.object({
  snapshot: z.string(),
  /** The whole rollback on the agent, ms: from the call to the restored guest answering. */
  restoreMs: z.number(),
  /** Of that, from the old QEMU's stop to the new one answering: the time the VM was down. */
  downMs: z.number(),
  /** Whether a standby QEMU launched ahead took over (agent/snapshot/standby.ts), else a cold launch. */
  standby: z.boolean(),
  resources: ResourcesSchema,
});
/** `POST /snapshots/{ref}/vms`: a VM from a kept snapshot, as `POST /vms` from a template. */
export const SnapshotVmBody = CreateBody.omit({ template: true, vcpus: true, memMib: true });
export const SnapshotTakenSchema = z.object({
  snapshot: z.string(),
  /** Bytes the snapshot keeps: its memory image and its disk overlay. */
  sizeBytes: z.number(),
  /** The source VM's stall while its state was taken, ms. */
  stallMs: z.number(),
  resources: ResourcesSchema,
});

/**
 * One VM as `GET /vms` lists it (the agent sends more; these are what the gateway's
 * reconciliation reads: gateway/core/reconcile.ts).
 */
export const VmSummarySchema = z.object({
  id: z.string(),
  /** The agent's state (agent/sandbox/states.ts), e.g. `running`, `paused`, `failed`. */
  state: z.string(),
  /** Why it is failed or lost. */
  reason: z.string().optional(),
  createdAtMs: z.number(),
  /** A sessions API one-shot exec's VM: it lives for its call and has no row of its own. */
  oneShot: z.boolean().optional(),
});
/**
 * A VM's live metrics (`GET /vms/{id}/metrics`, agent/sandbox/live-metrics.ts), all sampled by the
 * host from the VM's QEMU process and disk overlay, never reported by the guest.
 */
export const VmMetricsSchema = z.object({
  /** The agent's state (agent/sandbox/states.ts); `suspended`: the samples are its last running ones. */
  state: z.string(),
  vcpus: z.number(),
  memLimitBytes: z.number(),
  /** Ms between samples. */
  intervalMs: z.number(),
  /** Oldest first. */
  samples: z.array(
    z.object({
      atMs: z.number(),
      /** % of one host core; null on a QEMU's first sample. */
      cpuPercent: z.number().nullable(),
      memUsedBytes: z.number(),
      memResidentBytes: z.number(),
      diskBytes: z.number(),
    }),
  ),
});
export const VmListSchema = z.object({ vms: z.array(VmSummarySchema) });
/** The answer of `PUT /vms/{id}/egress`: the allow-list now in force. */
export const EgressSchema = z.object({ egressAllow: z.array(z.string()) });

/** `GET /snapshots`: the kept snapshots' refs. */
export const SnapshotListSchema = z.object({ snapshots: z.array(SnapshotRefParam) });
export const SuspendResultSchema = z.object({
  /** Size of the on-disk memory image, bytes. */
  memBytes: z.number(),
  /** Bytes the suspended VM keeps on disk in all (memory image + disk overlay), for metering. */
  snapshotBytes: z.number(),
});
export const ResumeResultSchema = z.object({ memBytes: z.number(), resources: ResourcesSchema });

export const TemplateStatusSchema = z.object({
  status: z.enum(["building", "ready", "failed"]),
  /** The sandboxes API bake phase; `Live` when ready, `Failed` when failed. */
  phase: BakePhase,
  /** Readable error when failed (never a crash; docs/templates.md "Rules of templates"). */
  error: z.string().optional(),
  /** Unix ms when the template became ready. */
  readyAtMs: z.number().optional(),
  /** Guest ports exposed by forks of this template (`ready.ports`). */
  exposedPorts: z.array(z.number()),
  /** Readiness telemetry, passed through to clients as is. */
  telemetry: z.record(z.string(), z.unknown()),
});

export const CapacitySchema = z.object({
  /** How many more VMs of a default size this host can start now. */
  slotsFree: z.number(),
  slotsTotal: z.number(),
  vcpusFree: z.number(),
  memMibFree: z.number(),
});

export const HealthSchema = z.object({
  ok: z.boolean(),
  version: z.string(),
  capacity: CapacitySchema,
  /** The agent's sandbox driver and accelerator (e.g. `snapshot (kvm)`), for operators. */
  driver: z.string().optional(),
  /** How the agent's VMs run; `tcg` is software emulation, not a security boundary by QEMU's policy. */
  accel: z.enum(["kvm", "tcg"]).optional(),
});

/** Every error answer of the agent; its status is the code's (agent/api/errors.ts). */
export const ErrorBody = z.object({ code: z.enum(AgentErrorCode), message: z.string() });

export type ErrorBody = z.infer<typeof ErrorBody>;

/**
 * The error an agent's non-2xx answer means for its caller: its own `{code, message}` kept as the
 * same `SandboxdError` code, or `internal` naming what was asked (`what`) when the body is not one
 * (an answer that is not the agent's, or a code this gateway does not know).
 */
export function errorFromAgentAnswer(
  status: number,
  text: string,
  what: string,
  /** The answer's `Retry-After` (seconds), kept so the gateway's own answer carries it on. */
  retryAfter?: string | null,
): SandboxdError {
  let parsed: ErrorBody | undefined;
  try {
    const r = ErrorBody.safeParse(JSON.parse(text));
    if (r.success) parsed = r.data;
  } catch {
    parsed = undefined;
  }
  // Delay-seconds only (RFC 9110); six digits (11 days) is beyond any wait an agent would ask for.
  const retry = retryAfter?.trim();
  const retryAfterSeconds = retry && /^\d{1,6}$/.test(retry) ? Number(retry) : undefined;
  if (parsed) {
    return new SandboxdError(parsed.code, parsed.message, {
      details: retryAfterSeconds === undefined ? { status } : { status, retryAfterSeconds },
    });
  }
  return new SandboxdError("internal", `agent answered ${status} to ${what}: ${text.slice(0, 200)}`);
}
