/**
 * What a client command is given: its streams and environment (passed in, never read from
 * globals in the handlers, so a test can run a command in-process with buffers).
 */
import { processEnv } from "../settings.ts";
import type { CommandSpec, Parsed } from "./args.ts";

export interface Ctx {
  stdout: NodeJS.WritableStream & { isTTY?: boolean };
  stderr: NodeJS.WritableStream & { isTTY?: boolean };
  stdin: NodeJS.ReadStream;
  env: NodeJS.ProcessEnv;
}

/** One subcommand: parsed arguments in, exit code out; failures are thrown (index.ts maps them). */
export type Handler = (p: Parsed, spec: CommandSpec, ctx: Ctx) => Promise<number>;

/** The process's own streams and environment. */
export function processCtx(): Ctx {
  return { stdout: process.stdout, stderr: process.stderr, stdin: process.stdin, env: processEnv() };
}
