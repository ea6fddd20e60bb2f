/**
 * The agent's one runner for short-lived host tools (qemu-img, mkfs.ext4, skopeo, umoci,
 * debootstrap, gcc, ...). Long-lived children (QEMU itself) are not tools: `agent/vm/` owns them.
 *
 * Every run has a deadline and an optional abort signal (either kills the tool with SIGKILL and
 * its own process group), keeps a bounded tail of stderr for the error, and keeps at most
 * `maxStdoutBytes` of stdout. A failure is one `ToolError` whose `kind` says what went wrong;
 * callers wrap it into their own error (ImageError, StorageError, ...) keeping it as the cause.
 */
import { spawn } from "node:child_process";

/** How much stderr (and stdout, on failure) an error keeps: the end is where the reason is. */
export const TOOL_OUTPUT_TAIL = 4096;

/**
 * Default deadline. The slowest tool the agent runs is debootstrap of the catalog image (about a
 * minute on a 2-core host from a local mirror); callers with a known shorter or longer bound pass
 * their own.
 */
export const TOOL_DEFAULT_TIMEOUT_MS = 10 * 60_000;

/** Default cap on captured stdout: tools whose stdout we parse (qemu-img info, skopeo inspect)
 *  print kilobytes; 16 MiB bounds a tool that misbehaves. */
export const TOOL_DEFAULT_MAX_STDOUT = 16 * 1024 * 1024;

export type ToolFailure = "spawn" | "exit" | "signal" | "timeout" | "aborted" | "output_too_large";

export class ToolError extends Error {
  override readonly name = "ToolError";
  constructor(
    readonly kind: ToolFailure,
    readonly tool: string,
    message: string,
    readonly details: { exitCode?: number | null; signal?: string | null; output?: string } = {},
    options?: { cause?: unknown },
  ) {
    super(message, options);
  }
  /** The last non-empty line of the tool's output: usually its reason. */
  get reason(): string {
    return (
      (this.details.output ?? "")
        .split("\n")
        .filter((l) => l.trim() !== "")
        .pop() ?? ""
    );
  }
}

export interface ToolOptions {
  /** Extra environment on top of the agent's own (or instead of it with `replaceEnv`). */
  env?: Record<string, string | undefined>;
  replaceEnv?: boolean;
  cwd?: string;
  timeoutMs?: number;
  signal?: AbortSignal;
  /** Bytes written to the tool's stdin, then closed. Default: stdin is /dev/null. */
  input?: string | Uint8Array;
  /** Keep stdout? Default true; false sends it to /dev/null (tools whose output we never read). */
  captureStdout?: boolean;
  maxStdoutBytes?: number;
  /** Called with each line logged about the run (the argv before it starts). */
  log?: (line: string) => void;
}

export interface ToolResult {
  stdout: Buffer;
  /** The last TOOL_OUTPUT_TAIL characters of stderr. */
  stderr: string;
}

/** Runs `argv[0]` with `argv.slice(1)`; resolves on exit 0, else rejects with a ToolError. */
export function runTool(argv: readonly string[], o: ToolOptions = {}): Promise<ToolResult> {
  const tool = argv[0];
  if (!tool) return Promise.reject(new ToolError("spawn", "", "runTool: empty argv"));
  const timeoutMs = o.timeoutMs ?? TOOL_DEFAULT_TIMEOUT_MS;
  const maxStdout = o.maxStdoutBytes ?? TOOL_DEFAULT_MAX_STDOUT;
  o.log?.(`run: ${argv.join(" ")}`);
  if (o.signal?.aborted) return Promise.reject(new ToolError("aborted", tool, `${tool}: cancelled`));

  return new Promise((resolve, reject) => {
    const env = o.replaceEnv ? { ...o.env } : { ...process.env, ...o.env };
    const child = spawn(tool, argv.slice(1), {
      cwd: o.cwd,
      env: env as NodeJS.ProcessEnv,
      // Its own process group, so a kill reaches what the tool started (debootstrap's chroot
      // helpers, skopeo's children) and nothing outlives the deadline.
      detached: true,
      stdio: [
        o.input === undefined ? "ignore" : "pipe",
        o.captureStdout === false ? "ignore" : "pipe",
        "pipe",
      ],
    });
    const chunks: Buffer[] = [];
    let outBytes = 0;
    let errTail = "";
    let why: "timeout" | "aborted" | "output_too_large" | undefined;
    let settled = false;

    const killGroup = () => {
      try {
        if (child.pid) process.kill(-child.pid, "SIGKILL");
      } catch {
        child.kill("SIGKILL");
      }
    };
    const timer = setTimeout(() => {
      why ??= "timeout";
      killGroup();
    }, timeoutMs);
    const onAbort = () => {
      why ??= "aborted";
      killGroup();
    };
    o.signal?.addEventListener("abort", onAbort, { once: true });
    const done = () => {
      clearTimeout(timer);
      o.signal?.removeEventListener("abort", onAbort);
    };

    child.stdout?.on("data", (d: Buffer) => {
      outBytes += d.length;
      if (outBytes > maxStdout) {
        why ??= "output_too_large";
        killGroup();
        return;
      }
      chunks.push(d);
    });
    child.stderr?.on("data", (d: Buffer) => {
      errTail = (errTail + d.toString("utf8")).slice(-TOOL_OUTPUT_TAIL);
    });
    if (o.input !== undefined && child.stdin) {
      // A tool that exits without reading its stdin makes the write fail with EPIPE: its exit
      // status is the answer, not the pipe error.
      child.stdin.on("error", () => {});
      child.stdin.end(o.input);
    }
    child.on("error", (e) => {
      if (settled) return;
      settled = true;
      done();
      reject(new ToolError("spawn", tool, `cannot run ${tool}: ${e.message}`, {}, { cause: e }));
    });
    child.on("close", (code, signal) => {
      if (settled) return;
      settled = true;
      done();
      const r = outcome(tool, {
        why,
        code,
        signal,
        stdout: Buffer.concat(chunks),
        errTail,
        timeoutMs,
        maxStdout,
      });
      if (r instanceof ToolError) reject(r);
      else resolve(r);
    });
  });
}

/** How a run that ended was stopped or exited, with what it printed. */
interface Ended {
  why: "timeout" | "aborted" | "output_too_large" | undefined;
  code: number | null;
  signal: NodeJS.Signals | null;
  stdout: Buffer;
  errTail: string;
  timeoutMs: number;
  maxStdout: number;
}

/** The result of a run that ended: its output on exit 0, else the ToolError that says why. */
function outcome(tool: string, e: Ended): ToolResult | ToolError {
  const { why, code, signal, stdout, errTail, timeoutMs, maxStdout } = e;
  const output = `${stdout.toString("utf8").slice(-TOOL_OUTPUT_TAIL)}\n${errTail}`
    .trim()
    .slice(-TOOL_OUTPUT_TAIL);
  if (why === "timeout")
    return new ToolError("timeout", tool, `${tool}: no answer within ${Math.round(timeoutMs / 1000)} s`, {
      output,
    });
  if (why === "aborted") return new ToolError("aborted", tool, `${tool}: cancelled`, { output });
  if (why === "output_too_large")
    return new ToolError("output_too_large", tool, `${tool}: more than ${maxStdout} bytes of output`, {
      output,
    });
  if (code === 0) return { stdout, stderr: errTail };
  const err = new ToolError("exit", tool, "", { exitCode: code, signal, output });
  const how = code === null ? `killed by ${signal}` : `exit ${code}`;
  Object.defineProperty(err, "message", { value: `${tool} failed (${how}): ${err.reason}` });
  return err;
}
