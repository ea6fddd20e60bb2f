/**
 * What sandboxes (sandboxes API) and sessions (sessions API) share: the same routes under
 * `/v1/sandboxes/{id}` and `/v1/sessions/{id}` for streamed exec, files, background processes and
 * the terminal.
 */
import { fromBase64, text, toBase64, utf8 } from "./bytes.ts";
import { SandboxdError } from "./errors.ts";
import type { Body, Transport } from "./http.ts";
import { readSse } from "./sse.ts";
import { Terminal, type TerminalOptions } from "./terminal.ts";
import {
  type ExecEvent,
  type ExecOptions,
  type ExecResult,
  execResult,
  type FileContent,
  type FileList,
  type FileWritten,
  type LogEvent,
  type OutputEvent,
  type ProcessInfo,
  type ProcessLogs,
  processInfo,
  type StartProcessOptions,
} from "./types.ts";

/** Slack on top of an exec's own limit before the SDK stops waiting: the service answers first. */
const EXEC_DEADLINE_SLACK_MS = 60_000;

export type ExecBody = Record<string, unknown>;

/** The wire fields of the per-exec options. */
export function execOptionFields(o: ExecOptions): ExecBody {
  const b: ExecBody = {};
  if (o.env) b.env = o.env;
  if (o.cwd) b.cwd = o.cwd;
  if (o.user) b.user = o.user;
  if (typeof o.stdin === "string") b.stdin = o.stdin;
  else if (o.stdin) b.stdin_b64 = toBase64(o.stdin);
  if (o.timeoutSeconds !== undefined) b.timeout_seconds = o.timeoutSeconds;
  if (o.files) {
    b.files = Object.entries(o.files).map(([path, c]: [string, FileContent]) =>
      typeof c === "string" ? { path, content: c } : { path, content: toBase64(c), encoding: "base64" },
    );
  }
  return b;
}

/** The deadline of an exec call: the client's, or the command's own limit and some slack. */
export function execTimeoutMs(t: Transport, o: ExecOptions): number {
  const own = o.timeoutSeconds === undefined ? 0 : o.timeoutSeconds * 1000 + EXEC_DEADLINE_SLACK_MS;
  return Math.max(t.o.timeoutMs, own);
}

/** Reads a streamed exec's (or followed log's) events; `exitOf` reads the exit event's data. */
export async function* execEvents<E>(
  t: Transport,
  path: string,
  opts: { json?: unknown; method: "POST" | "GET"; signal?: AbortSignal | undefined; timeoutMs: number },
  onExit: (data: unknown) => E,
): AsyncGenerator<OutputEvent | E> {
  // Our own controller: leaving the loop early (break, throw) aborts the request, which the
  // service takes as "cancel the command".
  const ctl = new AbortController();
  const onAbort = () => ctl.abort(opts.signal?.reason);
  opts.signal?.addEventListener("abort", onAbort, { once: true });
  try {
    const res = await t.send(opts.method, path, {
      json: opts.json,
      headers: { accept: "text/event-stream" },
      signal: ctl.signal,
      timeoutMs: opts.timeoutMs,
    });
    if (!res.body)
      throw new SandboxdError({ code: "protocol", status: res.status, message: "no event stream" });
    let ended = false;
    for await (const ev of readSse(res.body)) {
      const data = parseEventData(ev.data);
      if (ev.event === "stdout" || ev.event === "stderr") {
        const bytes =
          typeof data.data_b64 === "string" ? fromBase64(data.data_b64) : utf8(String(data.data ?? ""));
        yield {
          type: ev.event,
          data: typeof data.data === "string" ? data.data : text(bytes),
          bytes,
        };
      } else if (ev.event === "exit") {
        ended = true;
        yield onExit(data);
        return;
      } else if (ev.event === "error") {
        throw new SandboxdError({
          code: String(data.code ?? "internal"),
          status: res.status,
          message: String(data.message ?? "the stream failed"),
        });
      }
    }
    if (!ended) {
      throw new SandboxdError({
        code: "network",
        status: res.status,
        message: `${path}: the stream ended early`,
      });
    }
  } catch (err) {
    if (err instanceof SandboxdError) throw err;
    throw new SandboxdError({
      code: ctl.signal.aborted ? "aborted" : "network",
      status: 0,
      message: `${path}: ${err instanceof Error ? err.message : String(err)}`,
      cause: err,
    });
  } finally {
    opts.signal?.removeEventListener("abort", onAbort);
    ctl.abort();
  }
}

function parseEventData(data: string): Record<string, unknown> {
  try {
    return JSON.parse(data) as Record<string, unknown>;
  } catch (cause) {
    throw new SandboxdError({ code: "protocol", status: 200, message: `bad event data: ${data}`, cause });
  }
}

/** `POST {base}/exec` with `fields` (the command) and the options, to its end. */
export async function runExec(
  t: Transport,
  base: string,
  fields: ExecBody,
  opts: ExecOptions,
): Promise<ExecResult> {
  const w = await t.json<Parameters<typeof execResult>[0]>("POST", `${base}/exec`, {
    json: { ...fields, ...execOptionFields(opts) },
    timeoutMs: execTimeoutMs(t, opts),
    signal: opts.signal,
  });
  return execResult(w);
}

/** The streamed form of `runExec`: output events as written, then the exit event. */
export function streamExec(
  t: Transport,
  base: string,
  fields: ExecBody,
  opts: ExecOptions,
): AsyncGenerator<ExecEvent> {
  return execEvents(
    t,
    `${base}/exec`,
    {
      method: "POST",
      json: { ...fields, ...execOptionFields(opts) },
      signal: opts.signal,
      timeoutMs: execTimeoutMs(t, opts),
    },
    execExit,
  );
}

/** The exit event of a streamed exec: the route's JSON result. */
export function execExit(data: unknown): ExecEvent {
  const result = execResult(data as Parameters<typeof execResult>[0]);
  return { type: "exit", exitCode: result.exitCode, result };
}

/** Files of a sandbox or session (docs/files.md "The file API"). */
export class Files {
  constructor(
    private readonly t: Transport,
    private readonly base: string,
  ) {}

  /**
   * Writes a file (parent directories created, replaced atomically): text is written as UTF-8.
   * A `ReadableStream` is streamed through as it is read (never retried: it cannot be replayed).
   */
  write(path: string, data: Body, opts: { user?: string } = {}): Promise<FileWritten> {
    return this.t.json("PUT", `${this.base}/files`, {
      query: { path, user: opts.user },
      body: typeof data === "string" ? utf8(data) : data,
      timeoutMs: 0,
    });
  }

  /** The file's bytes. */
  async read(path: string, opts: { user?: string } = {}): Promise<Uint8Array> {
    const res = await this.t.send("GET", `${this.base}/files`, { query: { path, user: opts.user } });
    try {
      return new Uint8Array(await res.arrayBuffer());
    } catch (cause) {
      throw new SandboxdError({
        code: "network",
        status: res.status,
        message: `read ${path}: cut off`,
        cause,
      });
    }
  }

  /** The file as UTF-8 text. */
  async readText(path: string, opts: { user?: string } = {}): Promise<string> {
    return text(await this.read(path, opts));
  }

  /** The file as a stream, for files too large to hold. */
  async readStream(path: string, opts: { user?: string; signal?: AbortSignal } = {}) {
    const res = await this.t.send("GET", `${this.base}/files`, {
      query: { path, user: opts.user },
      signal: opts.signal,
    });
    if (!res.body) throw new SandboxdError({ code: "protocol", status: res.status, message: "no body" });
    return res.body;
  }

  /** A directory's entries (at most 10,000; `truncated` says more were left out). */
  list(path: string, opts: { user?: string } = {}): Promise<FileList> {
    return this.t.json("GET", `${this.base}/files`, { query: { path, list: "true", user: opts.user } });
  }

  /** Removes a file, symlink or empty directory. */
  async remove(path: string, opts: { user?: string } = {}): Promise<void> {
    await this.t.json("DELETE", `${this.base}/files`, { query: { path, user: opts.user } });
  }
}

/** Background processes of a sandbox or session (docs/processes-and-pty.md "Background processes"). */
export class Processes {
  constructor(
    private readonly t: Transport,
    private readonly base: string,
  ) {}

  /** Starts `command` (a line for /bin/sh -c) or an argv (no shell). */
  async start(command: string | string[], opts: StartProcessOptions = {}): Promise<ProcessInfo> {
    const body: Record<string, unknown> = typeof command === "string" ? { command } : { argv: command };
    if (opts.env) body.env = opts.env;
    if (opts.cwd) body.cwd = opts.cwd;
    if (opts.user) body.user = opts.user;
    if (opts.keepAwake !== undefined) body.keep_awake = opts.keepAwake;
    return processInfo(await this.t.json("POST", `${this.base}/processes`, { json: body }));
  }

  async list(): Promise<ProcessInfo[]> {
    const r = await this.t.json<{ processes: Parameters<typeof processInfo>[0][] }>(
      "GET",
      `${this.base}/processes`,
    );
    return r.processes.map(processInfo);
  }

  /** The output kept so far (the last 1 MiB of each stream). */
  async logs(pid: number): Promise<ProcessLogs> {
    const r = await this.t.json<{
      stdout: string;
      stderr: string;
      truncated: boolean;
      process: Parameters<typeof processInfo>[0];
    }>("GET", `${this.base}/processes/${pid}/logs`);
    return { stdout: r.stdout, stderr: r.stderr, truncated: r.truncated, process: processInfo(r.process) };
  }

  /**
   * Follows the output: what was kept, then new output as it is written, then one `exit` event
   * once the process has ended. Leaving the loop stops following; the process runs on.
   */
  follow(pid: number, opts: { signal?: AbortSignal } = {}): AsyncGenerator<LogEvent> {
    return execEvents(
      this.t,
      `${this.base}/processes/${pid}/logs`,
      { method: "GET", signal: opts.signal, timeoutMs: this.t.o.timeoutMs },
      (data): LogEvent => {
        const process = processInfo(data as Parameters<typeof processInfo>[0]);
        return { type: "exit", exitCode: process.exitCode, process };
      },
    );
  }

  /** Writes to its standard input; `eof` closes it afterwards. */
  async stdin(pid: number, data: string | Uint8Array, opts: { eof?: boolean } = {}): Promise<number> {
    const json: Record<string, unknown> = typeof data === "string" ? { data } : { data_b64: toBase64(data) };
    if (opts.eof) json.eof = true;
    const r = await this.t.json<{ bytes: number }>("POST", `${this.base}/processes/${pid}/stdin`, { json });
    return r.bytes;
  }

  /** Kills its process group (SIGKILL); resolves with its info once it has ended. */
  async kill(pid: number): Promise<ProcessInfo> {
    return processInfo(await this.t.json("DELETE", `${this.base}/processes/${pid}`));
  }
}

/** Opens the terminal route of `base` with the client's key. */
export function openTerminal(t: Transport, base: string, opts: TerminalOptions): Promise<Terminal> {
  const url = t.url(`${base}/pty`, { cols: opts.cols, rows: opts.rows });
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  return Terminal.open(url, t.authHeaders(), t.o.timeoutMs);
}
