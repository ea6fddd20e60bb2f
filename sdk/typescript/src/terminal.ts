/**
 * An interactive terminal in a sandbox or session (`GET .../pty`, docs/processes-and-pty.md "Terminal"): a
 * duplex of bytes. Input is sent as binary messages (a text message that happens to look like
 * `{"type":"resize",...}` would be taken as a resize; binary never is); `resize` sends the one
 * text message the service reads as a resize.
 */
import { utf8 } from "./bytes.ts";
import { WsConnection } from "./websocket.ts";

export interface TerminalOptions {
  /** Width in cells (default 80). */
  cols?: number;
  /** Height in cells (default 24). */
  rows?: number;
}

export interface TerminalExit {
  /** The WebSocket close code: 1000 when the shell exited, 1001 when the sandbox went away. */
  code: number;
  reason: string;
}

export class Terminal {
  private readonly listeners = new Set<(data: Uint8Array) => void>();
  /** Output that came before anyone listened (the prompt): handed to the first listener. */
  private early: Uint8Array[] = [];
  private ws!: WsConnection;
  /** Resolves when the terminal has ended, however it ended. */
  readonly closed: Promise<TerminalExit>;
  private ended!: (e: TerminalExit) => void;

  private constructor() {
    this.closed = new Promise((resolve) => {
      this.ended = resolve;
    });
  }

  /** @internal Opened by `Sandbox.terminal()` / `Session.terminal()`. */
  static async open(url: URL, headers: Record<string, string>, timeoutMs: number): Promise<Terminal> {
    const t = new Terminal();
    t.ws = await WsConnection.open(
      url,
      headers,
      {
        onMessage: (data) => t.emit(data),
        onClose: (code, reason) => t.ended({ code, reason }),
      },
      timeoutMs,
    );
    return t;
  }

  private emit(data: Uint8Array): void {
    if (this.listeners.size === 0) {
      this.early.push(data);
      return;
    }
    for (const f of this.listeners) f(data);
  }

  /** Types `data` (text as UTF-8, or bytes: control keys, pasted binary). */
  write(data: string | Uint8Array): void {
    this.ws.sendBinary(typeof data === "string" ? utf8(data) : data);
  }

  /** Calls `f` with each chunk of output; returns a function that stops it. */
  onData(f: (data: Uint8Array) => void): () => void {
    this.listeners.add(f);
    const early = this.early;
    this.early = [];
    for (const d of early) f(d);
    return () => this.listeners.delete(f);
  }

  /** Calls `f` once the terminal has ended. */
  onExit(f: (e: TerminalExit) => void): void {
    void this.closed.then(f);
  }

  /** Resizes the terminal; the shell's foreground job gets SIGWINCH. */
  resize(cols: number, rows: number): void {
    this.ws.sendText(JSON.stringify({ type: "resize", cols, rows }));
  }

  /** Hangs the terminal up (the shell and its session are killed); resolves once it has ended. */
  close(): Promise<TerminalExit> {
    this.ws.close(1000, "");
    return this.closed;
  }
}
