/**
 * Shared pieces of the public API (docs/api.md "Rules every route shares"; docs/keys-and-auth.md "Rules of authentication"): ids, API key format, the error
 * envelope, labels and file writes (tiers and APIs: tiers.ts). Every request and response schema of both
 * endpoint APIs is built from these; openapi.yaml is generated from them (gateway/openapi.ts).
 */
import { z } from "zod";
import { PublicErrorCode } from "../errors.ts";
import {
  MAX_EXEC_COMMANDS,
  MAX_EXEC_CWD_CHARS,
  MAX_EXEC_ENV_BYTES,
  MAX_EXEC_ENV_ENTRIES,
  MAX_EXEC_FILES,
  MAX_EXEC_OUTPUT_BYTES,
  MAX_EXEC_RESPONSE_BYTES,
  MAX_EXEC_STDIN_BYTES,
  MAX_EXEC_USER_CHARS,
  MAX_LABEL_KEY_CHARS,
  MAX_LABEL_VALUE_CHARS,
  MAX_LABELS,
  MAX_PATH_CHARS,
} from "./limits.ts";

// ---- API keys: the format, its parser and how a request presents a key live in api-key.ts -------

// ---- ids -----------------------------------------------------------------------------------

/** docs/templates.md "Rules of templates"; docs/limits.md "Public API limits": template ids are 1 to 64 characters of `[a-zA-Z0-9_-]`. */
export const TEMPLATE_ID_PATTERN = /^[a-zA-Z0-9_-]{1,64}$/;
export const TemplateId = z.string().regex(TEMPLATE_ID_PATTERN, "template id: 1 to 64 of [a-zA-Z0-9_-]");

/** Opaque random part of our ids: 20 lowercase base36 characters (about 103 bits). */
export const OPAQUE_ID_CHARS = 20;
export const SESSION_ID_PATTERN = /^sess_[a-z0-9]{20}$/;
export const SANDBOX_ID_PATTERN = /^sbx_[a-z0-9]{20}$/;
/** docs/sessions.md "Rules of the sessions API": session ids are opaque with prefix `sess_`. */
export const SessionId = z.string().regex(/^sess_[A-Za-z0-9]+$/, "session id: sess_...");
/** docs/sandboxes.md "Rules of the sandboxes API": sandbox ids have prefix `sbx_`. */
export const SandboxId = z.string().regex(/^sbx_[A-Za-z0-9]+$/, "sandbox id: sbx_...");
/** docs/snapshots.md: snapshot ids have prefix `snap_`. */
export const SnapshotId = z.string().regex(/^snap_[A-Za-z0-9]+$/, "snapshot id: snap_...");

// ---- error envelope (docs/api.md "Rules every route shares") ---------------------------------------------

export const ErrorCode = z.enum(PublicErrorCode);
export const ErrorEnvelope = z
  .object({
    code: ErrorCode.describe("Stable machine code; branch on this, never on message."),
    message: z.string().describe("Human-readable explanation."),
    details: z
      .record(z.string(), z.unknown())
      .optional()
      .describe(
        "Machine-readable facts, only for the codes that document them: `size_unavailable` gives `sizes`, the sizes the template or snapshot has (`[{vcpus, memory_mib}]`).",
      ),
  })
  .meta({ id: "Error" });
export type ErrorEnvelope = z.infer<typeof ErrorEnvelope>;

// ---- small shared shapes -------------------------------------------------------------------

export const Labels = z
  .record(z.string().min(1).max(MAX_LABEL_KEY_CHARS), z.string().max(MAX_LABEL_VALUE_CHARS))
  .refine((r) => Object.keys(r).length <= MAX_LABELS, `at most ${MAX_LABELS} labels`)
  .meta({ id: "Labels" });

/** Map of exposed guest port (decimal string) to a connect hint; not a dialable address (2.5). */
export const Endpoints = z.record(z.string(), z.string()).meta({ id: "Endpoints" });
export type Endpoints = z.infer<typeof Endpoints>;

/** How a file's `content` is written: text as UTF-8 (the default), or base64 for any bytes. */
export const FileEncoding = z.enum(["utf8", "base64"]);
export type FileEncoding = z.infer<typeof FileEncoding>;
/**
 * Standard base64 (RFC 4648 section 4) with its padding: what `Buffer.from(s, "base64")` reads
 * whole. One character class and a length check, not a grouped pattern, so a 10 MiB content is
 * checked in one linear pass with no backtracking.
 */
const BASE64_CHARS = /^[A-Za-z0-9+/]*={0,2}$/;
export function isBase64(s: string): boolean {
  return s.length % 4 === 0 && BASE64_CHARS.test(s);
}

/** A file's bytes as the request gives them (`encoding` checked by the schema already). */
export function fileBytes(f: { content: string; encoding?: FileEncoding | undefined }): Buffer {
  return Buffer.from(f.content, f.encoding === "base64" ? "base64" : "utf8");
}

export const FileWrite = z
  .object({
    path: z
      .string()
      .min(1)
      .max(MAX_PATH_CHARS)
      .refine((p) => !p.includes("\0"), "path must not contain NUL"),
    content: z.string(),
    encoding: FileEncoding.optional().describe(
      "How `content` is written: `utf8` (default) as its UTF-8 bytes, `base64` decoded, for binary files.",
    ),
  })
  .refine((f) => f.encoding !== "base64" || isBase64(f.content), {
    message: "content is not valid base64 (encoding: base64)",
    path: ["content"],
  })
  .meta({ id: "FileWrite" });
export const FileWrites = z.array(FileWrite).max(MAX_EXEC_FILES);

/** Argv arrays: each command is a non-empty list of strings, run without a shell. */
export const ArgvCommands = z.array(z.array(z.string()).min(1)).min(1).max(MAX_EXEC_COMMANDS);

/**
 * An exec response's `truncated`: present (true) only when output was cut, so a response whose
 * output fits is exactly what it was before the field existed.
 */
export const ExecTruncated = z
  .literal(true)
  .optional()
  .describe(
    `Present, and true, only when stdout and stderr were cut: together they carry at most ${MAX_EXEC_OUTPUT_BYTES} bytes of the command's output (when both are long, the shorter keeps up to half). The command itself ran to its end; what it wrote past the cap was discarded. JSON escaping makes a response at most ${MAX_EXEC_RESPONSE_BYTES} bytes.`,
  );

/** An environment variable name as POSIX shells accept it. */
const EnvName = z.string().regex(/^[A-Za-z_][A-Za-z0-9_]*$/, "an environment variable name");

/**
 * The params key of a refinement whose failure means "too large" rather than "malformed": the
 * gateway answers it 413 `payload_too_large` (gateway/http.ts `validate`), as a body over its
 * byte bound is.
 */
export const TOO_LARGE = "tooLarge";
/** A stdin over MAX_EXEC_STDIN_BYTES: 413 (TOO_LARGE). */
export const stdinTooLarge = {
  message: `stdin is at most ${MAX_EXEC_STDIN_BYTES} bytes`,
  params: { [TOO_LARGE]: true },
};
/** The exact number of bytes a base64 text decodes to (padded or not). */
export function base64Bytes(s: string): number {
  const pad = s.endsWith("==") ? 2 : s.endsWith("=") ? 1 : 0;
  return Math.floor((s.length * 3) / 4) - pad;
}

/**
 * The per-exec options both exec forms take (sessions API session exec, sandboxes API sandbox exec): the
 * fields are spread into each request object, and `checkExecOptions` is refined on it.
 */
export const ExecOptionFields = {
  env: z
    .record(
      EnvName,
      z.string().refine((v) => !v.includes("\0"), "env values must not contain NUL"),
    )
    .refine(
      (r) => Object.keys(r).length <= MAX_EXEC_ENV_ENTRIES,
      `at most ${MAX_EXEC_ENV_ENTRIES} env entries`,
    )
    .refine(
      (r) =>
        Object.entries(r).reduce((n, [k, v]) => n + Buffer.byteLength(k) + Buffer.byteLength(v) + 2, 0) <=
        MAX_EXEC_ENV_BYTES,
      `env is at most ${MAX_EXEC_ENV_BYTES} bytes (names and values)`,
    )
    .optional()
    .describe(
      `Added to the image's environment for this exec only; a name here wins over the image's. At most ${MAX_EXEC_ENV_ENTRIES} entries and ${MAX_EXEC_ENV_BYTES} bytes.`,
    ),
  cwd: z
    .string()
    .startsWith("/", "cwd must be an absolute path")
    .max(MAX_EXEC_CWD_CHARS)
    .refine((p) => !p.includes("\0"), "cwd must not contain NUL")
    .optional()
    .describe(
      "Working directory inside the guest for the files' relative paths and the commands (default: the image's WorkingDir). A directory that does not exist is 400 `bad_request`.",
    ),
  user: z
    .string()
    .min(1)
    .max(MAX_EXEC_USER_CHARS)
    .regex(/^[A-Za-z0-9_][A-Za-z0-9_.-]*\$?$/, "a user name or a decimal uid")
    .optional()
    .describe(
      "Run as this user: a name looked up in the guest's /etc/passwd (its group and home from there) or a decimal uid (default: the image's User). An unknown name is 400 `bad_request`.",
    ),
  stdin: z
    .string()
    .refine((s) => Buffer.byteLength(s) <= MAX_EXEC_STDIN_BYTES, stdinTooLarge)
    .optional()
    .describe("UTF-8 text given to the command's standard input, which is then closed."),
  stdin_b64: z
    .base64()
    .refine((s) => base64Bytes(s) <= MAX_EXEC_STDIN_BYTES, stdinTooLarge)
    .optional()
    .describe("Standard input as base64, for bytes that are not UTF-8; not together with `stdin`."),
};

/** The checks across the option fields: one stdin form at most. */
export function checkExecOptions(b: { stdin?: string | undefined; stdin_b64?: string | undefined }): boolean {
  return b.stdin === undefined || b.stdin_b64 === undefined;
}

/** Positive integer seconds; the upper bound is the deployment's `maxExecTimeoutS` (at most EXEC_TIMEOUT_CEILING_S). */
export const TimeoutSeconds = z.int().min(1);

/** RFC 3339 timestamp with an explicit offset or Z. */
export const Rfc3339 = z.iso.datetime({ offset: true });

// ---- terminals (GET .../pty, docs/processes-and-pty.md "Terminal") ------------------------------------------

/** A terminal dimension in cells: a u16 in the kernel's struct winsize; 0 is not a size. */
export const PTY_DIM_MAX = 65535;
const PtyDim = z.int().min(1).max(PTY_DIM_MAX);
const PtyDimQuery = z
  .string()
  .regex(/^\d{1,5}$/)
  .transform(Number)
  .pipe(PtyDim);

export const PtyQuery = z.object({
  cols: PtyDimQuery.optional().describe("Terminal width in cells (default 80)."),
  rows: PtyDimQuery.optional().describe("Terminal height in cells (default 24)."),
  lines: z
    .enum(["true", "false"])
    .optional()
    .describe(
      "true: each text message is one typed line and the Enter key (CR) is added after it, for " +
        "line-based clients such as wscat that send a line without its newline. Default false " +
        "(text is typed as it is, as xterm.js sends keystrokes).",
    ),
});

/** The one text message a terminal client sends that is not typed input. */
export const PtyResize = z.object({ type: z.literal("resize"), cols: PtyDim, rows: PtyDim });
export type PtyResize = z.infer<typeof PtyResize>;

/**
 * A text message that is a resize request, else undefined (the text is typed input: xterm.js's
 * attach addon sends keystrokes as text messages). Cheap for ordinary keystrokes: only text that
 * starts with `{"` is parsed.
 */
export function parsePtyResize(text: string): PtyResize | undefined {
  if (!text.startsWith('{"')) return undefined;
  try {
    const r = PtyResize.safeParse(JSON.parse(text));
    return r.success ? r.data : undefined;
  } catch {
    return undefined;
  }
}
