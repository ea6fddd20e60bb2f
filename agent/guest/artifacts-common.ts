/**
 * What the guest artifact builds (artifacts.ts, kernel.ts) share: their error, the tool runner
 * whose failures become that error, the content hash of every cache key, and the rename that
 * publishes a finished temp dir.
 */
import { createHash } from "node:crypto";
import { existsSync } from "node:fs";
import { chmod, rename } from "node:fs/promises";
import { runTool, ToolError } from "../host/tool.ts";

export class GuestArtifactsError extends Error {
  readonly code = "guest_artifacts";
  constructor(message: string, opts?: { cause?: unknown }) {
    super(message, opts);
    this.name = "GuestArtifactsError";
  }
}

export function sha256(b: Buffer): string {
  return createHash("sha256").update(b).digest("hex");
}

/** Renames a finished temp dir into place; if another builder won the race, theirs is kept. */
export async function publishDir(tmp: string, final: string): Promise<void> {
  // mkdtemp makes 0700; the cache is read by whoever runs QEMU, so publish it world-readable.
  await chmod(tmp, 0o755);
  try {
    await rename(tmp, final);
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    if ((code === "ENOTEMPTY" || code === "EEXIST") && existsSync(final)) return;
    throw err;
  }
}

interface RunOptions {
  cwd?: string;
  stdin?: Buffer;
  /** Exit codes that count as success (default: 0). */
  allowExit?: number[];
}

/**
 * Runs a tool to completion (agent/host/tool.ts); a failure or a non-allowed exit is a
 * GuestArtifactsError carrying the tail of its output, the ToolError as its cause.
 */
export async function run(cmd: string, args: string[], opts: RunOptions = {}): Promise<void> {
  try {
    await runTool([cmd, ...args], {
      ...(opts.cwd ? { cwd: opts.cwd } : {}),
      ...(opts.stdin ? { input: opts.stdin } : {}),
      captureStdout: false,
    });
  } catch (err) {
    if (!(err instanceof ToolError)) throw err;
    const code = err.details.exitCode;
    if (err.kind === "exit" && code != null && (opts.allowExit ?? [0]).includes(code)) return;
    if (err.kind === "spawn") throw new GuestArtifactsError(err.message, { cause: err });
    const how = err.kind === "exit" ? (err.details.signal ?? `exit ${code}`) : err.message;
    throw new GuestArtifactsError(`${cmd} ${args.join(" ")} failed (${how}): ${err.details.output ?? ""}`, {
      cause: err,
    });
  }
}
