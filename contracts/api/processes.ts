/**
 * Public bodies of the background-process routes of both APIs (`/v1/sandboxes/{id}/processes`
 * and `/v1/sessions/{id}/processes`, docs/processes-and-pty.md "Background processes"). A process runs beside
 * the foreground exec (never `busy`); its `pid` is the service's number for it in its sandbox
 * (1, 2, ...), not the guest's pid.
 */
import { z } from "zod";
import { ExecOptionFields, stdinTooLarge } from "./common.ts";
import { MAX_EXEC_STDIN_BYTES } from "./limits.ts";

export const StartProcessRequest = z
  .object({
    command: z.string().min(1).optional().describe("A command line, run by /bin/sh -c."),
    argv: z.array(z.string()).min(1).optional().describe("One argv, run without a shell."),
    env: ExecOptionFields.env,
    cwd: ExecOptionFields.cwd,
    user: ExecOptionFields.user,
    keep_awake: z
      .boolean()
      .optional()
      .describe(
        "Keep the sandbox's vCPUs running while this process runs. Without it an idle sandbox is paused with its processes (they continue on its next call or connection).",
      ),
  })
  .refine((b) => (b.command === undefined) !== (b.argv === undefined), {
    message: "send command or argv (one of them)",
  })
  .meta({ id: "StartProcessRequest" });
export type StartProcessRequest = z.infer<typeof StartProcessRequest>;

export const ProcessInfo = z
  .object({
    pid: z.int().describe("The service's number for the process in this sandbox (1, 2, ...)."),
    command: z.string().describe("The command line, or the argv joined by spaces."),
    running: z.boolean(),
    exit_code: z
      .int()
      .nullable()
      .describe("The shell's way (128+N for signal N: 137 once killed); null while running or when unknown."),
    keep_awake: z.boolean(),
  })
  .meta({ id: "ProcessInfo" });
export type ProcessInfo = z.infer<typeof ProcessInfo>;

export const ProcessList = z.object({ processes: z.array(ProcessInfo) }).meta({ id: "ProcessList" });
export type ProcessList = z.infer<typeof ProcessList>;

export const ProcessLogsResponse = z
  .object({
    stdout: z.string().describe("The kept standard output (UTF-8; bytes that are not become U+FFFD)."),
    stderr: z.string(),
    truncated: z.boolean().describe("Older output was dropped: the last 1 MiB of each stream is kept."),
    process: ProcessInfo,
  })
  .meta({ id: "ProcessLogs" });
export type ProcessLogsResponse = z.infer<typeof ProcessLogsResponse>;

export const ProcessStdinRequest = z
  .object({
    data: z
      .string()
      .refine((s) => Buffer.byteLength(s) <= MAX_EXEC_STDIN_BYTES, stdinTooLarge)
      .optional()
      .describe("UTF-8 text written to the process's standard input."),
    data_b64: ExecOptionFields.stdin_b64.describe("Bytes written to its standard input, base64."),
    eof: z.boolean().optional().describe("Close its standard input after these bytes."),
  })
  .refine((b) => !(b.data !== undefined && b.data_b64 !== undefined), {
    message: "send data or data_b64, not both",
  })
  .meta({ id: "ProcessStdinRequest" });
export type ProcessStdinRequest = z.infer<typeof ProcessStdinRequest>;

export const ProcessStdinResponse = z
  .object({ pid: z.int(), bytes: z.int().describe("Bytes accepted for its standard input.") })
  .meta({ id: "ProcessStdinResponse" });

/** The raw-body form of stdin: `?eof=true` closes standard input after the body. */
export const ProcessStdinQuery = z.object({
  eof: z.enum(["true", "false"]).optional().describe("Raw body only: close standard input after it."),
});

/** The followed form of the logs route (gateway/routes/exec-sse.ts). */
export const PROCESS_LOG_EVENTS =
  "With `Accept: text/event-stream` the logs are followed as Server-Sent Events in the streamed " +
  "exec's format: first the kept output, then new output as the process writes it " +
  '(`event: stdout` / `event: stderr`, data `{"data": "<UTF-8>"}` or `{"data_b64": "<base64>"}`), ' +
  "then one `event: exit` whose data is the process's info once it has ended. The stream opens " +
  "with a comment line (`: open`) so that a quiet process still answers at once. Closing the " +
  "connection stops following; the process runs on. Revoking the key that opened the stream ends " +
  "it with an `event: error` of code `unauthorized`; the process runs on.";
