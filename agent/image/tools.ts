/**
 * The import's tool runs (skopeo copy, umoci unpack, mkfs.ext4, qemu-img convert); a failure is
 * an ImageError `image_tool_failed` that says the tool's reason.
 */
import { ImageError } from "./errors.ts";

/** How much tool output to keep for an error: the end is where the reason is. */
const TOOL_OUTPUT_TAIL = 4096;

export async function runTool(
  argv: string[],
  env: Record<string, string>,
  log: (m: string) => void,
): Promise<void> {
  const tool = argv[0] as string;
  log(`image: ${argv.join(" ")}`);
  let proc: ReturnType<typeof Bun.spawn>;
  try {
    proc = Bun.spawn(argv, {
      stdin: "ignore",
      stdout: "pipe",
      stderr: "pipe",
      env: { ...process.env, ...env },
    });
  } catch (err) {
    throw new ImageError("image_tool_failed", `cannot run ${tool}`, { cause: err, details: { tool } });
  }
  const [out, errText, code] = await Promise.all([
    new Response(proc.stdout as ReadableStream).text(),
    new Response(proc.stderr as ReadableStream).text(),
    proc.exited,
  ]);
  if (code !== 0) {
    const output = `${out}\n${errText}`.trim().slice(-TOOL_OUTPUT_TAIL);
    const last = output.split("\n").filter(Boolean).pop() ?? "";
    throw new ImageError("image_tool_failed", `${tool} failed (exit ${code}): ${last}`, {
      details: { tool, exitCode: code, output },
    });
  }
}
