/**
 * Bodies of the agent's own HTTP API (docs/agent-api.md), defined once and used by both sides:
 * the app parses requests with them into typed calls on the manager, and the client (client.ts)
 * parses answers with them before handing them to the gateway. Field names follow
 * gateway/agent-api.ts (camelCase): this API is internal, between the gateway and its agents.
 */
import { z } from "zod";
import { ReadySpec } from "../api/family-b.ts";
import { SandboxdError } from "../errors.ts";

/** The gateway's template refs: the id, or `<tenantId>.<templateId>` (gateway/agent-api.ts). */
export const TemplateRefParam = z
  .string()
  .regex(/^[A-Za-z0-9][A-Za-z0-9_.-]{0,160}$/)
  .refine((s) => !s.includes(".."));
export const VmIdParam = z.string().regex(/^vm-[0-9a-z-]{1,60}$/);

/** Spec 8 has no exec timeout ceiling; one hour bounds a request the gateway holds open. */
export const MAX_EXEC_TIMEOUT_MS = 3_600_000;

export const FileWrite = z.object({ path: z.string().min(1).max(4096), content: z.string() });

export const RunAction = z.discriminatedUnion("kind", [
  z.object({ kind: z.literal("code"), code: z.string() }),
  z.object({ kind: z.literal("shell"), command: z.string().min(1) }),
  z.object({ kind: z.literal("argv"), commands: z.array(z.array(z.string()).min(1)).min(1).max(64) }),
  z.object({ kind: z.literal("none") }),
]);

export const ExecBody = z.object({
  files: z.array(FileWrite).max(256).default([]),
  run: RunAction,
  timeoutMs: z.int().min(1).max(MAX_EXEC_TIMEOUT_MS).optional(),
  seed: z.string().max(1024).optional(),
  env: z.record(z.string().regex(/^[A-Za-z_][A-Za-z0-9_]*$/), z.string()).optional(),
});
export type ExecBody = z.infer<typeof ExecBody>;

export const CreateBody = z.object({
  template: TemplateRefParam,
  kind: z.enum(["session", "sandbox"]),
  egressAllow: z.array(z.string()).optional(),
});

export const ExecOnceBody = z.object({ template: TemplateRefParam, action: ExecBody });

/** Spec 8: at most 64 children per fork call (Enterprise). */
export const ForkBody = z.object({ count: z.int().min(1).max(64) });

export const OciBuildBody = z.object({
  image: z.string().min(1).max(1024),
  ready: ReadySpec.optional(),
  width: z.int().min(1).optional(),
  expectedWidth: z.int().min(1).optional(),
});

/** Query of `PUT /templates/:ref/upload` (Family A register options, spec 4.1). */
export const UploadQuery = z.object({
  memMib: z.coerce.number().int().min(64).max(65536).optional(),
  vcpuCount: z.coerce.number().int().min(1).max(64).optional(),
  waitSecs: z.coerce.number().int().min(0).max(3600).optional(),
});

export const WidthBody = z.object({ width: z.int().min(1) });

/** `GET /vms/{id}/tunnel?port=N`: a TCP port inside the guest. */
export const TunnelQuery = z.object({ port: z.coerce.number().int().min(1).max(65535) });

export const DeleteQuery = z.object({
  force: z
    .enum(["true", "false", "1", "0"])
    .optional()
    .transform((v) => v === "true" || v === "1"),
});

// ---- answers (checked by the client) -------------------------------------------------------

const Resources = z.object({ vcpus: z.number(), memMib: z.number(), diskBytes: z.number() });

export const CreatedVmSchema = z.object({
  vmId: z.string(),
  forkTimeMs: z.number(),
  createTimeMs: z.number(),
  endpoints: z.record(z.string(), z.string()),
  resources: Resources,
});

export const ExecResultSchema = z.object({
  stdout: z.string(),
  stderr: z.string(),
  exitCode: z.number(),
  execTimeMs: z.number(),
  totalTimeMs: z.number(),
  seedAck: z.string().optional(),
});

export const OneShotResultSchema = ExecResultSchema.extend({ forkTimeMs: z.number() });
export const ForkResultSchema = z.object({ children: z.array(CreatedVmSchema) });
export const SuspendResultSchema = z.object({ memBytes: z.number(), snapshotBytes: z.number() });
export const ResumeResultSchema = z.object({ memBytes: z.number(), resources: Resources });

export const TemplateStatusSchema = z.object({
  status: z.enum(["building", "ready", "failed"]),
  phase: z.enum(["Pending", "Converting", "Distributing", "Live", "Failed"]),
  error: z.string().optional(),
  readyAtMs: z.number().optional(),
  exposedPorts: z.array(z.number()),
  telemetry: z.record(z.string(), z.unknown()),
});

export const HealthSchema = z.object({
  ok: z.boolean(),
  version: z.string(),
  capacity: z.object({
    slotsFree: z.number(),
    slotsTotal: z.number(),
    vcpusFree: z.number(),
    memMibFree: z.number(),
  }),
  driver: z.string().optional(),
});

export const ErrorBody = z.object({ code: z.string(), message: z.string() });

export type ErrorBody = z.infer<typeof ErrorBody>;

/**
 * The error an agent's non-2xx answer means for its caller: its own `{code, message}` kept as the
 * same `SandboxdError` code, or `internal` naming what was asked (`what`) when the body is not one.
 */
export function errorFromAgentAnswer(status: number, text: string, what: string): SandboxdError {
  let parsed: ErrorBody | undefined;
  try {
    const r = ErrorBody.safeParse(JSON.parse(text));
    if (r.success) parsed = r.data;
  } catch {
    parsed = undefined;
  }
  if (parsed) return new SandboxdError(parsed.code, parsed.message, { details: { status } });
  return new SandboxdError("internal", `agent answered ${status} to ${what}: ${text.slice(0, 200)}`);
}
