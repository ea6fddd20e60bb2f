/**
 * The SDK's types. Records the service returns (sandbox info, templates, usage, file listings)
 * are the API's JSON as it is, typed by the zod schemas of contracts/api (type-only imports: the
 * built SDK carries no schema code and no zod). Options the SDK takes and the results of its own
 * verbs (exec, processes) are camelCase.
 */
import type { z } from "zod";
import type * as F from "../../../contracts/api/files.ts";
import type { HealthResponse } from "../../../contracts/api/health.ts";
import type * as P from "../../../contracts/api/processes.ts";
import type * as B from "../../../contracts/api/sandboxes-api.ts";
import type * as A from "../../../contracts/api/sessions-api.ts";

type Out<S extends z.ZodType> = z.output<S>;

// ---- records, as the API sends them ----------------------------------------------------------

export type SandboxInfo = Out<typeof B.SandboxInfo>;
export type SandboxSummary = Out<typeof B.SandboxList>["sandboxes"][number];
export type CreateSandboxResponse = Out<typeof B.CreateSandboxResponse>;
export type ForkResponse = Out<typeof B.ForkResponse>;
export type StateResponse = Out<typeof B.StateResponse>;
/** A sandbox's live metrics, sampled by the host (docs/metrics.md). */
export type SandboxMetrics = Out<typeof B.SandboxMetrics>;
export type MetricsSample = Out<typeof B.MetricsSample>;
export type SnapshotInfo = Out<typeof B.SnapshotInfo>;
export type RestoreResponse = Out<typeof B.RestoreResponse>;
export type CatalogEntry = B.CatalogEntry;
/** A sandboxes API template: its bake phase, error and telemetry. */
export type TemplateB = B.TemplateB;
/** A sessions API template: its build status. */
export type TemplateA = A.TemplateA;
export type BakePhase = B.BakePhase;
export type ReadySpec = B.ReadySpec;
export type RegistryAuth = B.RegistryAuth;
export type UsageResponse = Out<typeof B.UsageResponse>;
export type FileList = Out<typeof F.FileList>;
export type FileEntry = Out<typeof F.FileEntry>;
export type FileWritten = Out<typeof F.FileWritten>;
export type SessionStatus = Out<typeof A.SessionStatus>;
export type SessionSummary = Out<typeof A.SessionList>["sessions"][number];

/** Filters of `sandboxes.list/pages` (docs/lists.md), all AND-ed. */
export interface SandboxListOptions {
  /** Only sandboxes whose labels hold every pair (at most 16; a key must not hold `:`). */
  labels?: Record<string, string>;
  state?: "running" | "suspended";
  /** A template id. */
  template?: string;
  /** Rows per page, 1 to 200 (the service's default: 50). */
  limit?: number;
}

/** Filters of `sessions.list/pages`. */
export interface SessionListOptions {
  templateId?: string;
  /** Rows per page, 1 to 200 (the service's default: 50). */
  limit?: number;
}

/** One page of a list: its rows and the cursor of the next (null: the last page). */
export interface Page<T> {
  items: T[];
  nextCursor: string | null;
}
export type Health = Out<typeof HealthResponse>;
export type Endpoints = Record<string, string>;
export type EgressPolicy = NonNullable<B.CreateSandboxRequest["egress"]>;
export type IdleAction = NonNullable<B.CreateSandboxRequest["idle_action"]>;
/** What the absolute lifetime does at its end: `delete` (the default) or `suspend`. */
export type TimeoutAction = NonNullable<B.CreateSandboxRequest["on_timeout"]>;
export type SetTimeoutResponse = Out<typeof B.SetTimeoutResponse>;
export type SetEgressResponse = Out<typeof B.SetEgressResponse>;
type WireExecResult = Out<typeof B.ExecResponseB> | A.ExecResultA;
type WireProcessInfo = P.ProcessInfo;

// ---- the SDK's own shapes ----------------------------------------------------------------------

/** A finished exec (both APIs): the last command's output and exit code, times in ms. */
export interface ExecResult {
  /** The sandbox or session id (a one-shot exec: the execution's id). */
  id: string;
  stdout: string;
  stderr: string;
  exitCode: number;
  forkTimeMs: number;
  execTimeMs: number;
  totalTimeMs: number;
  /** True when the service cut stdout/stderr at its output cap (the command ran to its end). */
  truncated: boolean;
}

export function execResult(w: WireExecResult): ExecResult {
  return {
    id: w.id,
    stdout: w.stdout,
    stderr: w.stderr,
    exitCode: w.exit_code,
    forkTimeMs: w.fork_time_ms,
    execTimeMs: w.exec_time_ms,
    totalTimeMs: w.total_time_ms,
    truncated: w.truncated === true,
  };
}

/** A chunk of output, as a streamed exec or a followed process log sends it. */
export interface OutputEvent {
  type: "stdout" | "stderr";
  /** The chunk as text (bytes that are not UTF-8 become U+FFFD). */
  data: string;
  /** The chunk's exact bytes. */
  bytes: Uint8Array;
}

/** One event of a streamed exec: output, then exactly one `exit` with the result. */
export type ExecEvent = OutputEvent | { type: "exit"; exitCode: number; result: ExecResult };

/** One event of a followed process log: output, then `exit` once the process has ended. */
export type LogEvent = OutputEvent | { type: "exit"; exitCode: number | null; process: ProcessInfo };

/** A file to place before an exec runs: text (UTF-8) or bytes. */
export type FileContent = string | Uint8Array;

/** Options of every exec form (docs/exec.md "Per-exec options and streamed exec"). */
export interface ExecOptions {
  env?: Record<string, string>;
  /** Absolute working directory (default: the image's WorkingDir). */
  cwd?: string;
  /** A user name of the sandbox's /etc/passwd, or a decimal uid. */
  user?: string;
  /** Standard input: text (UTF-8) or bytes; then closed. */
  stdin?: string | Uint8Array;
  /** Files written, in order, before the command runs: path -> content. */
  files?: Record<string, FileContent>;
  /** The service's limit on the command, seconds. */
  timeoutSeconds?: number;
  /** Cancels the call (for a stream: ends it, and the service kills the command). */
  signal?: AbortSignal;
}

/** A background process (docs/processes-and-pty.md "Background processes"). */
export interface ProcessInfo {
  /** The service's number for it in its sandbox (1, 2, ...), not the guest's pid. */
  pid: number;
  command: string;
  running: boolean;
  /** The shell's way (128+N for signal N); null while it runs or when unknown. */
  exitCode: number | null;
  keepAwake: boolean;
}

export function processInfo(w: WireProcessInfo): ProcessInfo {
  return {
    pid: w.pid,
    command: w.command,
    running: w.running,
    exitCode: w.exit_code,
    keepAwake: w.keep_awake,
  };
}

export interface ProcessLogs {
  stdout: string;
  stderr: string;
  /** Older output was dropped (the last 1 MiB of each stream is kept). */
  truncated: boolean;
  process: ProcessInfo;
}

export interface StartProcessOptions {
  env?: Record<string, string>;
  cwd?: string;
  user?: string;
  /** Keep the sandbox's vCPUs running while this process runs (no idle pause). */
  keepAwake?: boolean;
}

/** Templates as a list, whatever the key's API: the sandboxes API adds the catalog fields. */
export interface TemplateSummary {
  id: string;
  /** The sessions API: whether it is ready to run. */
  ready?: boolean;
  name?: string;
  description?: string;
  visibility?: "public" | "private";
  tier?: string;
}

export type Template = TemplateA | TemplateB;
