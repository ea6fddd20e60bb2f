/**
 * A terminal's options on the agent's API (docs/agent-api.md "Tunnels"): `openPty`'s typed
 * options (`PtyOpen`, bounded by `PtyOpenSchema`), their query string on
 * `GET /vms/{id}/pty` (`ptyQueryOf`, written by the gateway's client) and its parser (`PtyQuery`,
 * read by the agent). One definition for both sides.
 *
 * A terminal is a WebSocket upgrade, so its options ride in the URL: `env` and `argv` as base64url
 * (RFC 4648 section 5, no padding) of their UTF-8 entries each followed by a NUL byte (`NAME=value\0`,
 * `arg\0`): neither a name, a value nor an argument may hold a NUL (execve could not pass it), so
 * the encoding is exact, and its size follows from the bytes the bounds count. `cwd` and `user`
 * are plain query parameters.
 */
import { z } from "zod";
import { ExecOptionFields } from "../api/common.ts";

/**
 * The URL, request line and headers of the agent's HTTP server (Bun.serve) together may be at most
 * 16 KiB (its request header limit; more is 431), so a terminal's options are bounded more
 * tightly than an exec's body. The worst case of the bounds below: env 8,192 + argv 2,732 + cwd
 * 3,072 (every byte percent-encoded) + user 32 characters, about 14 KiB with the path, the
 * sizes, the agent's token and the WebSocket headers.
 */
/** `env` names plus values in UTF-8 bytes, plus 2 per entry (`=` and the NUL): 6 KiB, 8 KiB as base64url. */
export const MAX_PTY_ENV_BYTES = 6 * 1024;
/** Arguments of a terminal's command: a shell and its flags need a few; 64 is far past that. */
export const MAX_PTY_ARGV = 64;
/** The arguments in UTF-8 bytes, plus 1 each (the NUL): 2 KiB, 2,732 characters as base64url. */
export const MAX_PTY_ARGV_BYTES = 2 * 1024;
/** `cwd` in UTF-8 bytes: 1 KiB, at most 3 KiB percent-encoded; deeper paths are rare for a shell. */
export const MAX_PTY_CWD_BYTES = 1024;

const utf8 = (s: string) => Buffer.byteLength(s, "utf8");
/** The bytes the env bound counts (the exec's rule: names, values and 2 per entry). */
export const ptyEnvBytes = (env: Record<string, string>) =>
  Object.entries(env).reduce((n, [k, v]) => n + utf8(k) + utf8(v) + 2, 0);
const argvBytes = (argv: string[]) => argv.reduce((n, a) => n + utf8(a) + 1, 0);

/** A terminal's size in cells: a u16 each, as in struct winsize. */
const Cells = z.int().min(1).max(65535);

/**
 * What a terminal runs and how (`AgentVmApi.openPty`). Without `argv` the guest starts the image
 * user's login shell; `env` goes over the terminal's own environment (the image's Env, the egress
 * proxy, TERM), `cwd` replaces the image's WorkingDir, `user` the image's User (resolved as an
 * exec's `user`). `env`, `cwd` and `user` reuse the exec option rules (contracts/api/common.ts)
 * with the tighter byte bounds above.
 */
export const PtyOpenSchema = z.object({
  cols: Cells,
  rows: Cells,
  argv: z
    .array(z.string().refine((a) => !a.includes("\0"), "argv must not contain NUL"))
    .min(1)
    .max(MAX_PTY_ARGV)
    .refine((a) => argvBytes(a) <= MAX_PTY_ARGV_BYTES, `argv is at most ${MAX_PTY_ARGV_BYTES} bytes`)
    .optional(),
  env: ExecOptionFields.env.refine(
    (e) => e === undefined || ptyEnvBytes(e) <= MAX_PTY_ENV_BYTES,
    `a terminal's env is at most ${MAX_PTY_ENV_BYTES} bytes (names and values)`,
  ),
  cwd: ExecOptionFields.cwd.refine(
    (p) => p === undefined || utf8(p) <= MAX_PTY_CWD_BYTES,
    `a terminal's cwd is at most ${MAX_PTY_CWD_BYTES} bytes`,
  ),
  user: ExecOptionFields.user,
});
export type PtyOpen = z.infer<typeof PtyOpenSchema>;

/** Entries each followed by NUL, as base64url without padding. */
function packNul(items: string[]): string {
  return Buffer.from(items.map((s) => `${s}\0`).join(""), "utf8").toString("base64url");
}

/** The largest base64url text of `n` bytes. */
const b64Chars = (n: number) => Math.ceil((n * 4) / 3);
const B64URL = /^[A-Za-z0-9_-]*$/;

/**
 * `packNul` read back, strictly: only base64url characters that decode to exactly these bytes
 * (Node's decoder skips what it does not know), valid UTF-8, and NUL-terminated entries.
 * `undefined` for anything else.
 */
function unpackNul(text: string): string[] | undefined {
  if (!B64URL.test(text) || text.length % 4 === 1) return undefined;
  const bytes = Buffer.from(text, "base64url");
  if (bytes.toString("base64url") !== text) return undefined; // non-canonical trailing bits
  let s: string;
  try {
    s = new TextDecoder("utf-8", { fatal: true }).decode(bytes);
  } catch {
    return undefined;
  }
  if (s === "" || !s.endsWith("\0")) return undefined;
  return s.slice(0, -1).split("\0");
}

/** The query string of `GET /vms/{id}/pty` for these options (already checked by `PtyOpenSchema`). */
export function ptyQueryOf(o: PtyOpen): string {
  const q = new URLSearchParams({ cols: String(o.cols), rows: String(o.rows) });
  if (o.argv !== undefined) q.set("argv", packNul(o.argv));
  if (o.env !== undefined && Object.keys(o.env).length > 0)
    q.set("env", packNul(Object.entries(o.env).map(([k, v]) => `${k}=${v}`)));
  if (o.cwd !== undefined) q.set("cwd", o.cwd);
  if (o.user !== undefined) q.set("user", o.user);
  return q.toString();
}

/**
 * `GET /vms/{id}/pty`'s query (Hono's `c.req.query()`: the first value of each name) parsed into
 * `PtyOpen`, with every bound of `PtyOpenSchema`. The encoded texts are bounded before they are
 * decoded.
 */
export const PtyQuery = z
  .object({
    cols: z.coerce.number().pipe(Cells),
    rows: z.coerce.number().pipe(Cells),
    argv: z
      .string()
      .max(b64Chars(MAX_PTY_ARGV_BYTES))
      .transform((t, ctx) => {
        const a = unpackNul(t);
        if (a === undefined) ctx.addIssue({ code: "custom", message: "argv: not NUL-terminated base64url" });
        return a ?? [];
      })
      .optional(),
    env: z
      .string()
      .max(b64Chars(MAX_PTY_ENV_BYTES))
      .transform((t, ctx) => {
        const entries = unpackNul(t);
        const env: Record<string, string> = {};
        for (const kv of entries ?? []) {
          const eq = kv.indexOf("=");
          const name = kv.slice(0, Math.max(0, eq));
          if (eq < 1 || Object.hasOwn(env, name)) {
            ctx.addIssue({ code: "custom", message: "env: an entry is not a new NAME=value" });
            return env;
          }
          env[name] = kv.slice(eq + 1);
        }
        if (entries === undefined)
          ctx.addIssue({ code: "custom", message: "env: not NUL-terminated base64url" });
        return env;
      })
      .optional(),
    cwd: z.string().optional(),
    user: z.string().optional(),
  })
  .transform((q) => {
    const o: Record<string, unknown> = { cols: q.cols, rows: q.rows };
    for (const k of ["argv", "env", "cwd", "user"] as const) if (q[k] !== undefined) o[k] = q[k];
    return o;
  })
  .pipe(PtyOpenSchema);
