/**
 * Background processes on the agent's HTTP API (docs/agent-api.md "Background processes"): the
 * wire bodies, used by the agent (agent/api/processes.ts) to parse requests and by the gateway's
 * client (gateway/agents/client.ts) to parse answers. A process is a guest command that outlives
 * the request that started it; the agent keeps its output in a bounded log
 * (agent/sandbox/processes.ts). Its `pid` is the agent's number for it in its sandbox (1, 2, ...);
 * `guestPid` is its pid inside the guest, as the guest reported it when it forked the command.
 */
import { z } from "zod";

export const ProcessStartBody = z.object({
  /** A shell line for /bin/sh -c, or one argv run without a shell. */
  run: z.discriminatedUnion("kind", [
    z.object({ kind: z.literal("shell"), command: z.string().min(1) }),
    z.object({ kind: z.literal("argv"), commands: z.array(z.array(z.string()).min(1)).length(1) }),
  ]),
  env: z.record(z.string().regex(/^[A-Za-z_][A-Za-z0-9_]*$/), z.string()).optional(),
  cwd: z.string().startsWith("/").max(4096).optional(),
  user: z.string().min(1).max(64).optional(),
  /** Keep the VM's vCPUs running while this process runs (no idle pause). */
  keepAwake: z.boolean().default(false),
});
export type ProcessStart = z.input<typeof ProcessStartBody>;

/** 2^31: an agent's counter per sandbox never gets near it; the bound keeps it an int. */
export const ProcessPidParam = z.coerce
  .number()
  .int()
  .min(1)
  .max(2 ** 31);

export const ProcessInfoSchema = z.object({
  pid: z.number().int(),
  /**
   * The command's pid inside the guest (what `$$` prints in its shell). Absent when unknown: a
   * guest agent older than this field (one frozen in a template) does not report it at start.
   */
  guestPid: z.number().int().optional(),
  /** The shell line, or the argv joined by spaces. */
  command: z.string(),
  running: z.boolean(),
  /** The shell's way: 128+N for a signal (137 once killed); null while running or when unknown. */
  exitCode: z.number().int().nullable(),
  keepAwake: z.boolean(),
  startedAtMs: z.number(),
});
export type ProcessInfo = z.infer<typeof ProcessInfoSchema>;

export const ProcessListSchema = z.object({ processes: z.array(ProcessInfoSchema) });

/** The output kept so far, base64 (bytes as the command wrote them). */
export const ProcessLogsSchema = z.object({
  stdoutB64: z.string(),
  stderrB64: z.string(),
  /** Older output was dropped from the bounded log. */
  truncated: z.boolean(),
  process: ProcessInfoSchema,
});
export type ProcessLogs = z.infer<typeof ProcessLogsSchema>;

export const ProcessStdinBody = z.object({
  dataB64: z.base64(),
  /** Close the process's stdin after these bytes. */
  eof: z.boolean().default(false),
});
export type ProcessStdin = z.input<typeof ProcessStdinBody>;
