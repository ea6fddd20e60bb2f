import type { Socket } from "node:net";
import { connectSocketAt } from "../../host/socket-path.ts";
import {
  QmpCommandError,
  QmpDisconnectedError,
  QmpError,
  QmpProtocolError,
  QmpTimeoutError,
} from "./errors.ts";
import {
  encodeQmpCommand,
  LineSplitter,
  parseQmpLine,
  type QmpEvent,
  type QmpGreeting,
  type QmpMessage,
} from "./framing.ts";

export type { QmpEvent, QmpGreeting } from "./framing.ts";

/**
 * Default deadline for one command. Every command we send (query-status, stop, cont,
 * migrate-incoming, blockdev-snapshot-sync...) answers in milliseconds even under TCG; `migrate`
 * itself returns at once and reports progress by events. 10 s means QEMU is wedged, not slow.
 */
export const DEFAULT_COMMAND_TIMEOUT_MS = 10_000;

/**
 * How often `connect` retries while QEMU has not created the socket yet (~30-40 ms after its start
 * under TCG). Each attempt costs ~0.1 ms of CPU; at 2 ms the socket is noticed ~4 ms sooner on
 * average than at 10 ms for ~1-2 ms more CPU per launch.
 */
const CONNECT_RETRY_MS = 2;

export interface QmpConnectOptions {
  /** Whole budget for: socket appearing + connect + greeting + qmp_capabilities. */
  timeoutMs: number;
  /** Aborting stops the retry loop at once, e.g. when the QEMU process exits during startup. */
  signal?: AbortSignal;
  log?: (msg: string) => void;
}

export interface QmpExecuteOptions {
  timeoutMs?: number;
}

export interface WaitEventOptions {
  timeoutMs: number;
  filter?: (ev: QmpEvent) => boolean;
}

type Listener = (ev: QmpEvent) => void;

interface Pending {
  command: string;
  resolve: (v: unknown) => void;
  reject: (e: Error) => void;
  timer: ReturnType<typeof setTimeout> | undefined;
}

/**
 * A QMP client for one QEMU process over its unix socket.
 *
 * - Every command carries our own id; answers are matched through a pending map, and answers
 *   with ids we do not know (e.g. the late answer to a command that timed out) are dropped.
 * - Events go to listeners registered before the command that causes them: register with
 *   `on`/`waitEvent`, then `execute`.
 * - When the socket closes, every pending command and waiter is rejected with
 *   `QmpDisconnectedError`; events sent while no client was connected are lost for good, so
 *   after a reconnect ask `query-status` / `query-migrate` instead of waiting for events.
 */
export class QmpClient {
  readonly greeting: QmpGreeting;
  private readonly socket: Socket;
  private readonly pending = new Map<string, Pending>();
  private readonly listeners = new Map<string, Set<Listener>>();
  private readonly closeWaiters = new Set<(err: QmpError) => void>();
  private nextId = 1;
  private closedWith: QmpError | undefined;
  private readonly log: (msg: string) => void;
  /** Resolves (never rejects) when the connection is gone, with the reason. */
  readonly closed: Promise<QmpError>;

  private constructor(
    socket: Socket,
    greeting: QmpGreeting,
    splitter: LineSplitter,
    log: (msg: string) => void,
  ) {
    this.socket = socket;
    this.greeting = greeting;
    this.log = log;
    this.closed = new Promise((resolve) => this.closeWaiters.add(resolve));
    socket.on("data", (chunk: Buffer) => {
      let lines: string[];
      try {
        lines = splitter.push(chunk);
      } catch (err) {
        this.fail(err instanceof QmpError ? err : new QmpProtocolError("bad QMP framing", { cause: err }));
        return;
      }
      for (const line of lines) {
        if (this.closedWith) return;
        let msg: QmpMessage;
        try {
          msg = parseQmpLine(line);
        } catch (err) {
          // QEMU never sends non-QMP on this socket: whatever is on the other end cannot be
          // trusted to answer our commands, so the connection is failed as a whole.
          this.fail(err instanceof QmpError ? err : new QmpProtocolError("bad QMP message", { cause: err }));
          return;
        }
        this.dispatch(msg);
      }
    });
    socket.on("error", (err) =>
      this.fail(new QmpDisconnectedError(`QMP socket error: ${err.message}`, { cause: err })),
    );
    socket.on("close", () => this.fail(new QmpDisconnectedError("QMP connection closed")));
  }

  /**
   * Connects to QEMU's QMP socket: retries while the socket is missing or refusing (QEMU creates
   * it while starting), waits for the greeting, then negotiates with `qmp_capabilities`, the only
   * command QEMU accepts before it.
   */
  static async connect(path: string, opts: QmpConnectOptions): Promise<QmpClient> {
    const log = opts.log ?? (() => {});
    const deadline = Date.now() + opts.timeoutMs;
    for (;;) {
      if (opts.signal?.aborted) {
        throw new QmpDisconnectedError(`QMP connect to ${path} aborted`, { cause: opts.signal.reason });
      }
      const remaining = deadline - Date.now();
      if (remaining <= 0) throw new QmpTimeoutError("connect", opts.timeoutMs, "connection");
      let attempt: { socket: Socket; greeting: QmpGreeting; splitter: LineSplitter } | "retry";
      try {
        attempt = await QmpClient.tryConnect(path, remaining, opts.signal);
      } catch (err) {
        if (err instanceof QmpError) throw err;
        throw new QmpDisconnectedError(`QMP connect to ${path} failed`, { cause: err });
      }
      if (attempt === "retry") {
        await new Promise((r) => setTimeout(r, CONNECT_RETRY_MS));
        continue;
      }
      const client = new QmpClient(attempt.socket, attempt.greeting, attempt.splitter, log);
      try {
        await client.execute("qmp_capabilities", undefined, {
          timeoutMs: Math.max(1, deadline - Date.now()),
        });
      } catch (err) {
        client.close();
        throw err;
      }
      return client;
    }
  }

  /** One connect attempt: the greeting, or "retry" when the socket is not (yet) listening. */
  private static async tryConnect(
    path: string,
    timeoutMs: number,
    signal: AbortSignal | undefined,
  ): Promise<{ socket: Socket; greeting: QmpGreeting; splitter: LineSplitter } | "retry"> {
    const c = await connectSocketAt(path);
    if ("found" in c) {
      if (c.found === "missing") return "retry";
      throw new QmpDisconnectedError(`QMP socket ${path} is ${c.found}: not connected to`);
    }
    if ("error" in c) {
      if (c.error.code === "ENOENT" || c.error.code === "ECONNREFUSED") return "retry";
      throw new QmpDisconnectedError(`QMP connect to ${path} failed: ${c.error.message}`, { cause: c.error });
    }
    return QmpClient.greeting(c.socket, path, timeoutMs, signal);
  }

  /** QEMU's greeting on a connected QMP socket, within `timeoutMs`. */
  private static greeting(
    socket: Socket,
    path: string,
    timeoutMs: number,
    signal: AbortSignal | undefined,
  ): Promise<{ socket: Socket; greeting: QmpGreeting; splitter: LineSplitter }> {
    return new Promise((resolve, reject) => {
      const splitter = new LineSplitter();
      const done = (fn: () => void) => {
        clearTimeout(timer);
        signal?.removeEventListener("abort", onAbort);
        socket.removeAllListeners("data");
        socket.removeAllListeners("error");
        socket.removeAllListeners("close");
        fn();
      };
      const onAbort = () =>
        done(() => {
          socket.destroy();
          reject(new QmpDisconnectedError(`QMP connect to ${path} aborted`, { cause: signal?.reason }));
        });
      signal?.addEventListener("abort", onAbort, { once: true });
      const timer = setTimeout(
        () =>
          done(() => {
            socket.destroy();
            reject(new QmpTimeoutError("greeting", timeoutMs, "connection"));
          }),
        timeoutMs,
      );
      socket.on("error", (err: NodeJS.ErrnoException) => {
        done(() => {
          socket.destroy();
          reject(new QmpDisconnectedError(`QMP connect to ${path} failed: ${err.message}`, { cause: err }));
        });
      });
      socket.on("close", () =>
        done(() => reject(new QmpDisconnectedError(`QMP socket ${path} closed before the greeting`))),
      );
      socket.on("data", (chunk: Buffer) => {
        let lines: string[];
        try {
          lines = splitter.push(chunk);
        } catch (err) {
          done(() => {
            socket.destroy();
            reject(err);
          });
          return;
        }
        if (lines.length === 0) return;
        done(() => {
          try {
            const first = lines[0] ?? "";
            const msg = parseQmpLine(first);
            if (msg.kind !== "greeting")
              throw new QmpProtocolError(`expected the QMP greeting, got a ${msg.kind}`);
            // QEMU sends nothing else before qmp_capabilities, so no line after the greeting
            // can be pending here; if one were, it is not QMP.
            if (lines.length > 1) throw new QmpProtocolError("unexpected data after the QMP greeting");
            resolve({ socket, greeting: msg, splitter });
          } catch (err) {
            socket.destroy();
            reject(err);
          }
        });
      });
    });
  }

  get isClosed(): boolean {
    return this.closedWith !== undefined;
  }

  /**
   * Runs one command and resolves with its `return` value. Rejects with `QmpCommandError` for an
   * error reply, `QmpTimeoutError` when no answer came in time (kill the VM then: the command may
   * still be running and blocks every command behind it), `QmpDisconnectedError` when the
   * connection goes away first.
   */
  execute<T = unknown>(
    command: string,
    args?: Record<string, unknown>,
    opts?: QmpExecuteOptions,
  ): Promise<T> {
    if (this.closedWith) {
      return Promise.reject(
        new QmpDisconnectedError(`QMP ${command}: connection is closed`, { cause: this.closedWith }),
      );
    }
    const id = `cmd-${this.nextId++}`;
    const timeoutMs = opts?.timeoutMs ?? DEFAULT_COMMAND_TIMEOUT_MS;
    return new Promise<T>((resolve, reject) => {
      const entry: Pending = {
        command,
        resolve: resolve as (v: unknown) => void,
        reject,
        timer: undefined,
      };
      entry.timer = setTimeout(() => {
        // Forget the id: a late answer then counts as unknown and is dropped.
        this.pending.delete(id);
        reject(new QmpTimeoutError(command, timeoutMs));
      }, timeoutMs);
      this.pending.set(id, entry);
      this.socket.write(encodeQmpCommand(id, command, args));
    });
  }

  /** Subscribes to one event name, or every event with "*". Returns the unsubscribe function. */
  on(event: string, listener: Listener): () => void {
    let set = this.listeners.get(event);
    if (!set) {
      set = new Set();
      this.listeners.set(event, set);
    }
    set.add(listener);
    return () => {
      const s = this.listeners.get(event);
      s?.delete(listener);
      if (s && s.size === 0) this.listeners.delete(event);
    };
  }

  /**
   * Resolves with the next `name` event passing `filter`. The listener is registered when this is
   * called, so call it BEFORE executing the command that causes the event, then await it.
   * Rejects with `QmpTimeoutError` or `QmpDisconnectedError`. If you may end up not awaiting it,
   * attach a `.catch` so a later rejection is not unhandled.
   */
  waitEvent(name: string, opts: WaitEventOptions): Promise<QmpEvent> {
    if (this.closedWith) {
      return Promise.reject(
        new QmpDisconnectedError(`waiting for ${name}: connection is closed`, { cause: this.closedWith }),
      );
    }
    return new Promise<QmpEvent>((resolve, reject) => {
      const finish = () => {
        clearTimeout(timer);
        off();
        this.closeWaiters.delete(onClose);
      };
      const off = this.on(name, (ev) => {
        if (opts.filter && !opts.filter(ev)) return;
        finish();
        resolve(ev);
      });
      const onClose = (err: QmpError) => {
        finish();
        reject(new QmpDisconnectedError(`connection closed while waiting for event ${name}`, { cause: err }));
      };
      this.closeWaiters.add(onClose);
      const timer = setTimeout(() => {
        finish();
        reject(new QmpTimeoutError(name, opts.timeoutMs, "event"));
      }, opts.timeoutMs);
    });
  }

  /** Closes the connection; pending commands and waiters reject with `QmpDisconnectedError`. */
  close(): void {
    this.fail(new QmpDisconnectedError("QMP connection closed by us"));
    this.socket.destroy();
  }

  private dispatch(msg: QmpMessage): void {
    switch (msg.kind) {
      case "event": {
        for (const key of [msg.event, "*"]) {
          const set = this.listeners.get(key);
          if (!set) continue;
          for (const l of [...set]) {
            try {
              l(msg);
            } catch (err) {
              // A faulty listener must not break the connection for everyone else.
              this.log(`QMP event listener for ${msg.event} threw: ${String(err)}`);
            }
          }
        }
        return;
      }
      case "return":
      case "error": {
        const entry = msg.id === undefined ? undefined : this.pending.get(msg.id);
        if (!entry || msg.id === undefined) {
          // An answer for a command that already timed out, or not ours (QEMU answers a command it
          // could not parse without an id): nobody waits for it.
          this.log(`QMP: dropping ${msg.kind} for unknown id ${String(msg.id)}`);
          return;
        }
        this.pending.delete(msg.id);
        clearTimeout(entry.timer);
        if (msg.kind === "return") entry.resolve(msg.value);
        else entry.reject(new QmpCommandError(entry.command, msg.errorClass, msg.desc));
        return;
      }
      case "greeting":
        this.log("QMP: dropping a second greeting");
        return;
    }
  }

  private fail(err: QmpError): void {
    if (this.closedWith) return;
    this.closedWith = err;
    this.socket.destroy();
    for (const [id, entry] of this.pending) {
      clearTimeout(entry.timer);
      this.pending.delete(id);
      entry.reject(
        err instanceof QmpDisconnectedError
          ? new QmpDisconnectedError(`QMP ${entry.command}: ${err.message}`, { cause: err })
          : err,
      );
    }
    for (const w of [...this.closeWaiters]) w(err);
    this.closeWaiters.clear();
  }
}
