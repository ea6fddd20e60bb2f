/**
 * One line for a failed client command on stderr: the server's refusal as `code: message` (its
 * error envelope, as the SDK's `SandboxdError` carries it), anything else (the server cannot be
 * reached, a local file cannot be read) as `error: message`.
 */
import { SandboxdError } from "../../sdk/typescript/src/index.ts";

export function errorLine(err: unknown): string {
  if (err instanceof SandboxdError) return `${err.code}: ${err.message}`;
  if (err instanceof Error) return `error: ${err.message}`;
  return `error: ${String(err)}`;
}
