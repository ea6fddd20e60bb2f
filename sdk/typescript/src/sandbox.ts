/**
 * A Family B sandbox and a Family A session as objects: their id and the calls on them. Both are
 * cheap handles (no call is made to build one); `info()` asks the service.
 */
import type { Transport } from "./http.ts";
import { type ExecBody, Files, openTerminal, Processes, runExec, streamExec } from "./resources.ts";
import type { Terminal, TerminalOptions } from "./terminal.ts";
import type {
  Endpoints,
  ExecEvent,
  ExecOptions,
  ExecResult,
  ForkResponse,
  SandboxInfo,
  SessionStatus,
  StateResponse,
} from "./types.ts";

/** A command: a line for /bin/sh -c, or one argv (run without a shell). */
export type Command = string | string[];

function commandFields(c: Command): ExecBody {
  return typeof c === "string" ? { command: c } : { commands: [c] };
}

export interface ConnectUrlOptions {
  /** The guest port (one the template exposes). */
  port: number;
  /** How long the URL is valid, s (the service clamps it to 3600). */
  ttlSeconds: number;
  /** `tcp` (default): raw bytes; `cdp`: Chrome DevTools messages. */
  protocol?: "tcp" | "cdp";
}

export class Sandbox {
  readonly files: Files;
  readonly processes: Processes;
  private readonly base: string;

  constructor(
    private readonly t: Transport,
    readonly id: string,
    /** The template it was created from (known after create or get; "" for a bare handle). */
    readonly template = "",
    /** Exposed guest ports -> connect hints (not addresses: use `connectUrl`). */
    readonly endpoints: Endpoints = {},
  ) {
    this.base = `/v1/sandboxes/${encodeURIComponent(id)}`;
    this.files = new Files(t, this.base);
    this.processes = new Processes(t, this.base);
  }

  /** The sandbox's state, age, labels and idle lifetime, as the service reports them now. */
  info(): Promise<SandboxInfo> {
    return this.t.json("GET", this.base);
  }

  /** Runs `command` to its end; a non-zero exit is a result, not an error. */
  async exec(command: Command, opts: ExecOptions = {}): Promise<ExecResult> {
    return runExec(this.t, this.base, commandFields(command), opts);
  }

  /**
   * Runs `command`, yielding its output as it is written and then one `exit` event. Leaving the
   * loop early (or `opts.signal`) cancels the command.
   */
  execStream(command: Command, opts: ExecOptions = {}): AsyncGenerator<ExecEvent> {
    return streamExec(this.t, this.base, commandFields(command), opts);
  }

  /** Copy-on-write children of this sandbox as it is now (memory, disk, running processes). */
  async fork(opts: { count?: number; labels?: string[] } = {}): Promise<Sandbox[]> {
    const r = await this.t.json<ForkResponse>("POST", `${this.base}/fork`, {
      json: { count: opts.count ?? 1, ...(opts.labels ? { labels: opts.labels } : {}) },
    });
    return r.children.map((c) => new Sandbox(this.t, c.id, this.template, c.endpoints));
  }

  /** Snapshots it to disk; metering of CPU and memory stops. */
  suspend(): Promise<StateResponse> {
    return this.t.json("POST", `${this.base}/suspend`);
  }

  resume(): Promise<StateResponse> {
    return this.t.json("POST", `${this.base}/resume`);
  }

  /** A scoped WebSocket URL to a guest port, usable without the API key until it expires. */
  async connectUrl(opts: ConnectUrlOptions): Promise<{ url: string; expiresAt: string }> {
    const r = await this.t.json<{ url: string; expires_at: string }>("POST", `${this.base}/connect-url`, {
      json: {
        port: opts.port,
        ttl_seconds: opts.ttlSeconds,
        ...(opts.protocol ? { protocol: opts.protocol } : {}),
      },
    });
    return { url: r.url, expiresAt: r.expires_at };
  }

  /** An interactive shell in the sandbox. */
  terminal(opts: TerminalOptions = {}): Promise<Terminal> {
    return openTerminal(this.t, this.base, opts);
  }

  /** Destroys it (its VM, processes and files). */
  async delete(): Promise<void> {
    await this.t.json("DELETE", this.base);
  }
}

/** Session exec: `code` for the template's interpreter, or argv commands. */
export type SessionCode = string | { commands: string[][] };

function codeFields(c: SessionCode): ExecBody {
  return typeof c === "string" ? { code: c } : { commands: c.commands };
}

export class Session {
  readonly files: Files;
  readonly processes: Processes;
  private readonly base: string;

  constructor(
    private readonly t: Transport,
    readonly id: string,
    readonly templateId = "",
  ) {
    this.base = `/v1/sessions/${encodeURIComponent(id)}`;
    this.files = new Files(t, this.base);
    this.processes = new Processes(t, this.base);
  }

  info(): Promise<SessionStatus> {
    return this.t.json("GET", this.base);
  }

  /** Runs `code` (the template's interpreter reads it) or `{commands}` to the end. */
  async exec(code: SessionCode, opts: ExecOptions = {}): Promise<ExecResult> {
    return runExec(this.t, this.base, codeFields(code), opts);
  }

  execStream(code: SessionCode, opts: ExecOptions = {}): AsyncGenerator<ExecEvent> {
    return streamExec(this.t, this.base, codeFields(code), opts);
  }

  /** One child session, a copy of this one as it is now. */
  async fork(): Promise<Session> {
    const r = await this.t.json<{ session_id: string }>("POST", `${this.base}/fork`);
    return new Session(this.t, r.session_id, this.templateId);
  }

  terminal(opts: TerminalOptions = {}): Promise<Terminal> {
    return openTerminal(this.t, this.base, opts);
  }

  /** Deletes it; `force` aborts an exec in flight instead of letting it finish. */
  async delete(opts: { force?: boolean } = {}): Promise<void> {
    await this.t.json("DELETE", this.base, { query: { force: opts.force ? "true" : undefined } });
  }
}
