/**
 * The local side of `sandboxd sbx shell`: our terminal in raw mode (every key, Ctrl-C included,
 * goes to the sandbox's shell, which echoes and edits), its size sent on start and on each
 * SIGWINCH, and the terminal restored however the session ends: the shell's exit, a closed
 * connection, SIGTERM/SIGHUP, or an exception. (Piped input does not come here: sbx.ts runs it
 * as a script through exec.)
 */
import type { Terminal } from "../../sdk/typescript/src/index.ts";

/** The remote end: the SDK's `Terminal` (`sbx.terminal()`), or a stand-in in tests. */
export type RemoteTerminal = Pick<Terminal, "write" | "onData" | "resize" | "close" | "closed">;

/** The WebSocket close code the service ends a terminal with when its shell exited. */
const SHELL_EXITED = 1000;

/** Our own terminal: process.stdin / process.stdout, or stand-ins in tests. */
export interface LocalTty {
  stdin: NodeJS.ReadStream;
  stdout: NodeJS.WriteStream;
  /** Adds and removes the signal handlers (process.on / process.off). */
  on(signal: "SIGWINCH" | "SIGTERM" | "SIGHUP", fn: () => void): void;
  off(signal: "SIGWINCH" | "SIGTERM" | "SIGHUP", fn: () => void): void;
}

/** The terminal size to ask for: ours on a terminal, else the classic 80x24. */
export function localSize(stdout: NodeJS.WriteStream): { cols: number; rows: number } {
  const cols = stdout.isTTY && stdout.columns > 0 ? stdout.columns : 80;
  const rows = stdout.isTTY && stdout.rows > 0 ? stdout.rows : 24;
  return { cols, rows };
}

/**
 * Puts `stdin` in raw mode when it is a terminal; returns the undo, safe to call more than once
 * and run again at process exit (a crash between must not leave the user's terminal raw).
 */
export function rawMode(stdin: NodeJS.ReadStream): () => void {
  if (!stdin.isTTY) return () => {};
  stdin.setRawMode(true);
  let restored = false;
  const restore = () => {
    if (restored) return;
    restored = true;
    stdin.setRawMode(false);
  };
  process.once("exit", restore);
  return restore;
}

/**
 * Joins our terminal to `remote` until either end closes; returns the exit status for the
 * command: 0 when the shell exited (the protocol carries no exit code), 1 when the connection was
 * lost or we were told to stop.
 */
export async function attach(remote: RemoteTerminal, tty: LocalTty): Promise<number> {
  const restore = rawMode(tty.stdin);
  let stopped = false;
  const onWinch = () => {
    const { cols, rows } = localSize(tty.stdout);
    remote.resize(cols, rows);
  };
  const stop = () => {
    stopped = true;
    void remote.close();
  };
  const onInput = (b: Buffer) => remote.write(new Uint8Array(b.buffer, b.byteOffset, b.byteLength));
  remote.onData((d) => tty.stdout.write(d));
  tty.on("SIGWINCH", onWinch);
  tty.on("SIGTERM", stop);
  tty.on("SIGHUP", stop);
  tty.stdin.on("data", onInput);
  tty.stdin.resume();
  try {
    const end = await remote.closed;
    if (stopped) return 1;
    if (end.code === SHELL_EXITED) return 0;
    process.stderr.write(
      `\r\nsandboxd: terminal closed (${end.code}${end.reason ? `: ${end.reason}` : ""})\r\n`,
    );
    return 1;
  } finally {
    tty.off("SIGWINCH", onWinch);
    tty.off("SIGTERM", stop);
    tty.off("SIGHUP", stop);
    tty.stdin.off("data", onInput);
    tty.stdin.pause();
    restore();
  }
}
