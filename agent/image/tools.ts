/**
 * The import's tool runs (skopeo copy, umoci unpack, mkfs.ext4, qemu-img convert) go through the
 * agent's one runner with a deadline; a failure is an ImageError `image_tool_failed` that says
 * the tool's reason and keeps the ToolError as its cause.
 */
import { SandboxdError } from "../../contracts/errors.ts";
import { runTool, ToolError } from "../host/tool.ts";
import { ImageError } from "./errors.ts";

/**
 * Deadline for one tool run of an import. What a tool handles is bounded by the import limits
 * (8 GiB unpacked, a million entries): copying, unpacking, building an ext4 of that size or
 * converting it takes minutes even on a slow disk. 30 minutes stops a hung tool without failing
 * an import that is merely big.
 */
export const IMPORT_TOOL_TIMEOUT_MS = 30 * 60_000;

export interface ImageToolOptions {
  /** Extra environment (TMPDIR for skopeo and umoci). */
  env?: Record<string, string>;
  log: (m: string) => void;
  timeoutMs?: number;
  /** The import's cancel: kills the tool and its process group at once. */
  signal?: AbortSignal | undefined;
}

/** Runs one tool of the import; resolves on exit 0, else throws `image_tool_failed`. */
export async function runImageTool(argv: string[], o: ImageToolOptions): Promise<void> {
  const tool = argv[0] as string;
  try {
    await runTool(argv, {
      env: o.env,
      timeoutMs: o.timeoutMs ?? IMPORT_TOOL_TIMEOUT_MS,
      log: (line) => o.log(`image: ${line}`),
      ...(o.signal ? { signal: o.signal } : {}),
    });
  } catch (err) {
    if (!(err instanceof ToolError)) throw err;
    if (err.kind === "aborted")
      throw new SandboxdError("gone", "the image import was cancelled", { cause: err, details: { tool } });
    if (err.kind === "spawn")
      throw new ImageError("image_tool_failed", `cannot run ${tool}`, { cause: err, details: { tool } });
    // Exit: "<tool> failed (exit N): <its last line>"; a deadline: "<tool>: no answer within N s".
    throw new ImageError("image_tool_failed", err.message, {
      cause: err,
      details: { tool, exitCode: err.details.exitCode, output: err.details.output },
    });
  }
}
