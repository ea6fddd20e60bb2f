/**
 * A sandboxes API sandbox and a sessions API session as objects: their id and the calls on them. Both are
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
  RestoreResponse,
  SandboxInfo,
  SandboxMetrics,
  SessionStatus,
  SetEgressResponse,
  SetTimeoutResponse,
  SnapshotInfo,
  StateResponse,
  TimeoutAction,
} from "./types.ts";

/** A command: a line for /bin/sh -c, or one argv (run without a shell). */
export type Command = string | string[];

export interface ConnectUrlOptions {
  /** The guest port (one the template exposes). */
  port: number;
  /** How long the URL is valid, s (the service clamps it to 3600). */
  ttlSeconds: number;
  /** `tcp` (default): raw bytes; `cdp`: Chrome DevTools messages. */
  protocol?: "tcp" | "cdp";
}

/**
 * What a sandbox and a session have alike: the same routes under their own base path. `C` is
 * what their exec runs (a command line or argv; a session's code), `I` what `info()` answers.
 */
abstract class Workspace<C, I> {
  readonly files: Files;
  readonly processes: Processes;
  protected readonly base: string;

  constructor(
    protected readonly t: Transport,
    collection: "sandboxes" | "sessions",
    readonly id: string,
  ) {
    this.base = `/v1/${collection}/${encodeURIComponent(id)}`;
    this.files = new Files(t, this.base);
    this.processes = new Processes(t, this.base);
  }

  /** The exec request's fields for `c`. */
  protected abstract fields(c: C): ExecBody;

  /** Its state as the service reports it now. */
  info(): Promise<I> {
    return this.t.json("GET", this.base);
  }

  /** Runs `c` to its end; a non-zero exit is a result, not an error. */
  exec(c: C, opts: ExecOptions = {}): Promise<ExecResult> {
    return runExec(this.t, this.base, this.fields(c), opts);
  }

  /**
   * Runs `c`, yielding its output as it is written and then one `exit` event. Leaving the loop
   * early (or `opts.signal`) cancels the command.
   */
  execStream(c: C, opts: ExecOptions = {}): AsyncGenerator<ExecEvent> {
    return streamExec(this.t, this.base, this.fields(c), opts);
  }

  /** An interactive shell in it. */
  terminal(opts: TerminalOptions = {}): Promise<Terminal> {
    return openTerminal(this.t, this.base, opts);
  }
}

export class Sandbox extends Workspace<Command, SandboxInfo> {
  constructor(
    t: Transport,
    id: string,
    /** The template it was created from (known after create or get; "" for a bare handle). */
    readonly template = "",
    /** Exposed guest ports -> connect hints (not addresses: use `connectUrl`). */
    readonly endpoints: Endpoints = {},
  ) {
    super(t, "sandboxes", id);
  }

  protected fields(c: Command): ExecBody {
    return typeof c === "string" ? { command: c } : { commands: [c] };
  }

  /** Copy-on-write children of this sandbox as it is now (memory, disk, running processes). */
  async fork(opts: { count?: number; labels?: string[] } = {}): Promise<Sandbox[]> {
    const r = await this.t.json<ForkResponse>("POST", `${this.base}/fork`, {
      json: { count: opts.count ?? 1, ...(opts.labels ? { labels: opts.labels } : {}) },
    });
    return r.children.map((c) => new Sandbox(this.t, c.id, this.template, c.endpoints));
  }

  /**
   * Keeps its memory and disk as a snapshot (it runs on after a short stall); create sandboxes
   * from it with `sandboxes.create({ snapshot: id })`.
   */
  snapshot(opts: { name?: string; labels?: Record<string, string> } = {}): Promise<SnapshotInfo> {
    return this.t.json("POST", `${this.base}/snapshots`, { json: opts });
  }

  /**
   * Rolls it back to snapshot `snapshot` in place: the same sandbox, its memory, processes and
   * files as they were then. Open tunnels and background processes end (they lived in the memory
   * replaced).
   */
  restore(snapshot: string): Promise<RestoreResponse> {
    return this.t.json("POST", `${this.base}/restore`, { json: { snapshot } });
  }

  /** Snapshots it to disk; metering of CPU and memory stops. */
  suspend(): Promise<StateResponse> {
    return this.t.json("POST", `${this.base}/suspend`);
  }

  resume(): Promise<StateResponse> {
    return this.t.json("POST", `${this.base}/resume`);
  }

  /**
   * Its CPU %, memory and disk over the last two minutes, sampled by the host every 2 s
   * (docs/metrics.md); asking neither resumes it nor counts as use.
   */
  metrics(): Promise<SandboxMetrics> {
    return this.t.json("GET", `${this.base}/metrics`);
  }

  /** A new absolute lifetime, counted from this call (`onTimeout` absent: the sandbox's own). */
  setTimeout(timeoutSeconds: number, onTimeout?: TimeoutAction): Promise<SetTimeoutResponse> {
    return this.t.json("POST", `${this.base}/timeout`, {
      json: { timeout_seconds: timeoutSeconds, on_timeout: onTimeout },
    });
  }

  /**
   * Replaces its egress allow-list (docs/egress.md): new connections follow it at once, open ones
   * it no longer allows are closed; a suspended sandbox resumes under it.
   */
  setEgress(allow: string[]): Promise<SetEgressResponse> {
    return this.t.json("PUT", `${this.base}/egress`, { json: { allow } });
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

  /** Destroys it (its VM, processes and files). */
  async delete(): Promise<void> {
    await this.t.json("DELETE", this.base);
  }
}

/** Session exec: `code` for the template's interpreter, or argv commands. */
export type SessionCode = string | { commands: string[][] };

export class Session extends Workspace<SessionCode, SessionStatus> {
  constructor(
    t: Transport,
    id: string,
    readonly templateId = "",
  ) {
    super(t, "sessions", id);
  }

  protected fields(c: SessionCode): ExecBody {
    return typeof c === "string" ? { code: c } : { commands: c.commands };
  }

  /** One child session, a copy of this one as it is now. */
  async fork(): Promise<Session> {
    const r = await this.t.json<{ session_id: string }>("POST", `${this.base}/fork`);
    return new Session(this.t, r.session_id, this.templateId);
  }

  /** Deletes it; `force` aborts an exec in flight instead of letting it finish. */
  async delete(opts: { force?: boolean } = {}): Promise<void> {
    await this.t.json("DELETE", this.base, { query: { force: opts.force ? "true" : undefined } });
  }
}
