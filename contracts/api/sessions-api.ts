/**
 * The sessions API bodies (docs/sessions.md "Rules of the sessions API", docs/templates.md "Rules of templates"): stateless exec, batch, sessions and
 * templates registered from an uploaded image.
 */
import { z } from "zod";
import {
  ArgvCommands,
  checkExecOptions,
  ErrorEnvelope,
  ExecOptionFields,
  ExecTruncated,
  FileWrites,
  SessionId,
  TemplateId,
  TimeoutSeconds,
} from "./common.ts";
import {
  MAX_IDLE_TIMEOUT_S,
  MAX_MEM_MIB,
  MAX_VCPUS,
  MAX_WAIT_SECS,
  MIN_MEM_MIB,
  MIN_VCPUS,
  MIN_WAIT_SECS,
} from "./limits.ts";
import { ListCursor, ListLimit, NextCursor } from "./lists.ts";

// ---- exec (2.2, 4.1) -----------------------------------------------------------------------

export const ExecRequestA = z
  .object({
    code: z.string().describe("Source run in a fresh VM."),
    template_id: TemplateId,
    timeout_seconds: TimeoutSeconds.optional().describe("Default 30."),
  })
  .meta({ id: "ExecRequestA" });
export type ExecRequestA = z.infer<typeof ExecRequestA>;

export const ExecResultA = z
  .object({
    id: z.string().describe("Execution id (UUID for one-shot exec, session id for session exec)."),
    stdout: z.string(),
    stderr: z.string(),
    exit_code: z.int(),
    fork_time_ms: z.number().describe("VM spawn time; 0 for a session exec."),
    exec_time_ms: z.number(),
    total_time_ms: z.number(),
    truncated: ExecTruncated,
  })
  .meta({ id: "ExecResultA" });
export type ExecResultA = z.infer<typeof ExecResultA>;

export const BatchExecRequest = z
  .object({
    executions: z.array(ExecRequestA).min(1).describe("One VM each, run in parallel."),
  })
  .meta({ id: "BatchExecRequest" });
export type BatchExecRequest = z.infer<typeof BatchExecRequest>;

/**
 * A batch item that did not run, or whose VM failed: the `{code, message}` envelope a single
 * `/v1/exec` would have answered, with that answer's status (and `Retry-After`, in seconds).
 */
export const BatchItemError = z
  .object({
    status: z.int().describe("The HTTP status this failure has on POST /v1/exec."),
    error: ErrorEnvelope,
    retry_after_seconds: z
      .int()
      .optional()
      .describe("When the failure is worth retrying later (quota, capacity): seconds to wait."),
  })
  .meta({ id: "BatchItemError" });
export type BatchItemError = z.infer<typeof BatchItemError>;

export const BatchExecResponse = z
  .object({
    results: z
      .array(z.union([ExecResultA, BatchItemError]))
      .describe(
        "One per execution, in request order: its exec result, or a BatchItemError for an item that failed (the others are kept).",
      ),
  })
  .meta({ id: "BatchExecResponse" });

// ---- sessions (2.1, 4.1) -------------------------------------------------------------------

export const CreateSessionRequest = z
  .object({
    template_id: TemplateId,
    idle_timeout_seconds: z
      .int()
      .min(1)
      .max(MAX_IDLE_TIMEOUT_S)
      .optional()
      .describe(
        "This session's idle TTL, overriding the operator's (`SANDBOXD_SESSION_IDLE_TTL`): with no exec for this long it is reclaimed and later calls get 410.",
      ),
    idle_action: z
      .literal("delete")
      .optional()
      .describe("Sessions have no suspend: `delete` (reclaim, as the TTL does) is the only action."),
  })
  .meta({ id: "CreateSessionRequest" });

export const CreateSessionResponse = z
  .object({
    session_id: SessionId,
    template_id: TemplateId,
    fork_time_ms: z.number(),
    create_time_ms: z.number(),
  })
  .meta({ id: "CreateSessionResponse" });

/**
 * Session exec: `code`, or `commands`, or `files`; files may accompany either (written first).
 * `code` together with `commands` is rejected: which one the response reflects would be unclear.
 */
export const SessionExecRequest = z
  .object({
    code: z.string().optional(),
    commands: ArgvCommands.optional().describe("Run in order; the response reflects the last one."),
    files: FileWrites.optional().describe("Written before any command runs. Absolute paths."),
    timeout_seconds: TimeoutSeconds.optional(),
    ...ExecOptionFields,
  })
  .refine(checkExecOptions, { message: "send stdin or stdin_b64, not both" })
  .refine((b) => b.code === undefined || (b.stdin === undefined && b.stdin_b64 === undefined), {
    message: "code is the interpreter's stdin: send stdin with commands, not with code",
  })
  .refine((b) => b.code !== undefined || b.commands !== undefined || b.files !== undefined, {
    message: "send code, commands or files",
  })
  .refine((b) => !(b.code !== undefined && b.commands !== undefined), {
    message: "send code or commands, not both",
  })
  .meta({ id: "SessionExecRequest" });
export type SessionExecRequest = z.infer<typeof SessionExecRequest>;

export const ForkSessionResponse = z
  .object({ session_id: SessionId.describe("The child session."), fork_time_ms: z.number() })
  .meta({ id: "ForkSessionResponse" });

export const SessionStatus = z
  .object({
    session_id: SessionId,
    template_id: TemplateId,
    age_secs: z.number(),
    idle_secs: z.number(),
    exec_count: z.int(),
  })
  .meta({ id: "SessionStatus" });

export const SessionList = z
  .object({
    sessions: z.array(z.object({ session_id: SessionId, idle_secs: z.number(), exec_count: z.int() })),
    next_cursor: NextCursor,
  })
  .meta({ id: "SessionList" });

/** `GET /v1/sessions` (docs/lists.md): sessions carry no labels or public states to filter by. */
export const SessionListQuery = z.object({
  template_id: TemplateId.optional().describe("Only sessions of this template id."),
  limit: ListLimit.optional(),
  cursor: ListCursor.optional(),
});

/** `DELETE /v1/sessions/{id}?force=true` aborts an in-flight exec instead of letting it finish. */
export const BooleanQuery = z.enum(["true", "false", "1", "0"]).transform((v) => v === "true" || v === "1");
export const DeleteSessionQuery = z.object({ force: BooleanQuery.optional() });

// ---- templates, uploaded image (2.3, 3.1, 4.1) ---------------------------------------------

const IntQuery = (min: number, max: number) =>
  z
    .string()
    .regex(/^\d{1,9}$/, "a decimal integer")
    .transform(Number)
    .pipe(z.int().min(min).max(max));

/** Query of `POST /v1/templates` (sessions API). Bounds of the sizing options are our choices. */
export const RegisterTemplateQuery = z
  .object({
    id: TemplateId,
    mem_mib: IntQuery(MIN_MEM_MIB, MAX_MEM_MIB)
      .optional()
      .describe(`Guest memory, MiB (${MIN_MEM_MIB} to ${MAX_MEM_MIB}; default 256).`),
    vcpu_count: IntQuery(MIN_VCPUS, MAX_VCPUS)
      .optional()
      .describe(`Guest vCPUs (${MIN_VCPUS} to ${MAX_VCPUS}; default 1).`),
    wait_secs: IntQuery(MIN_WAIT_SECS, MAX_WAIT_SECS)
      .optional()
      .describe(
        `How long the build waits for the template's VM to come up (QEMU start to the guest agent's answer), seconds (${MIN_WAIT_SECS} to ${MAX_WAIT_SECS}; default 60). A VM that has not answered by then fails the build (status \`failed\`, the error names wait_secs).`,
      ),
  })
  .meta({ id: "RegisterTemplateQuery" });
export type RegisterTemplateQuery = z.infer<typeof RegisterTemplateQuery>;

export const TemplateStatusA = z.enum(["building", "ready", "failed"]);

export const RegisterTemplateResponse = z
  .object({ id: TemplateId, status: z.literal("building") })
  .meta({ id: "RegisterTemplateResponse" });

export const TemplateA = z
  .object({
    id: TemplateId,
    status: TemplateStatusA,
    created_at_secs: z.int().optional().describe("Unix seconds; present when ready."),
    error: z.string().optional().describe("Present when failed."),
  })
  .meta({ id: "TemplateA" });
export type TemplateA = z.infer<typeof TemplateA>;

export const TemplateReadyMap = z
  .record(TemplateId, z.object({ ready: z.boolean() }))
  .meta({ id: "TemplateReadyMap" });

export const TemplateListA = z.object({ templates: TemplateReadyMap }).meta({ id: "TemplateListA" });
