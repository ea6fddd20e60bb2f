/**
 * The guest's serial console, bounded on disk. QEMU's `-serial file:` appends for ever (a guest
 * writing 200 MB to /dev/console grew the data dir by 200 MB), so QEMU instead serves the serial
 * port on a unix socket in the VM directory (`console.sock`) and the agent drains it into
 * `console.log`, rotated to `console.log.1` whenever it would pass CONSOLE_FILE_BYTES: at most
 * CONSOLE_DISK_BYTES on disk per VM, the newest output always readable (`consoleTail`).
 *
 * What QEMU 7.2 does with the serial port's bytes (hw/char/serial.c, chardev/char-socket.c):
 * - no client connected (before the agent connects, after it died or restarted): the write fails
 *   with EIO and the UART drops the byte; the guest never waits for a reader.
 * - a client connected but not reading: writes return EAGAIN and the UART waits for the socket to
 *   become writable, so a reader that stops would stall the guest's console. The drain therefore
 *   reads continuously and pauses only while its own bounded buffer is written to disk.
 * - one client at a time: a second connect waits in the listen backlog until the first closes,
 *   which is how the next agent process takes a detached VM's console over (adoption).
 *
 * The socket lives in the VM directory like QMP's and the agent channel's, so a QEMU confined to
 * that directory serves it unchanged; QEMU itself never writes the log.
 */

import { constants } from "node:fs";
import { type FileHandle, open, rename, rm } from "node:fs/promises";
import type { Socket } from "node:net";
import { settled } from "../../contracts/best-effort.ts";
import { connectSocketAt } from "../host/socket-path.ts";

/** The chardev id behind `-serial`; not part of any snapshot's device state. */
export const CONSOLE_CHARDEV = "console0";
/** Bytes `console.log` may reach before it is rotated to `console.log.1`. */
export const CONSOLE_FILE_BYTES = 512 * 1024;
/** The most a VM's console keeps on disk: `console.log` plus `console.log.1`. */
export const CONSOLE_DISK_BYTES = 2 * CONSOLE_FILE_BYTES;
/**
 * Bytes read but not yet written before the drain pauses the socket. QEMU then sees EAGAIN and
 * holds the byte in the UART until the disk write finishes (milliseconds), never longer.
 */
const PENDING_HIGH_BYTES = 256 * 1024;
/** How long `startConsoleDrain` keeps retrying a socket QEMU has not created yet. */
const CONNECT_BUDGET_MS = 5_000;
const CONNECT_RETRY_MS = 10;
/** Delay before reconnecting after QEMU dropped a live connection (it does on a write error). */
const RECONNECT_DELAY_MS = 200;

/** The QEMU options that put the serial console on `socketPath`. */
export function consoleArgs(socketPath: string, waitForReader: boolean): string[] {
  return [
    "-chardev",
    `socket,id=${CONSOLE_CHARDEV},path=${socketPath},server=on,wait=${waitForReader ? "on" : "off"}`,
    "-serial",
    `chardev:${CONSOLE_CHARDEV}`,
  ];
}

export interface ConsoleDrain {
  /** Resolves once connected, or once the drain gave up (no socket: a QEMU without one). */
  readonly ready: Promise<boolean>;
  /** Stops reading, writes what was read, closes the log. Idempotent. */
  close(): Promise<void>;
}

/**
 * Connects to QEMU's console socket (retrying while QEMU creates it) and keeps `logPath` as a
 * two-file ring. Never throws and never rejects: a disk error drops that chunk (logged once per
 * kind) and the drain goes on, so the guest is never blocked by a failing disk.
 */
export function startConsoleDrain(
  socketPath: string,
  logPath: string,
  log: (msg: string) => void = () => {},
): ConsoleDrain {
  let closed = false;
  let socket: Socket | undefined;
  const ring = logRing(logPath, log);
  let pending: Buffer[] = [];
  let pendingBytes = 0;
  let writing: Promise<void> | undefined;
  const flush = async () => {
    while (pending.length > 0) {
      const chunk = pending.length === 1 ? pending[0]! : Buffer.concat(pending, pendingBytes);
      pending = [];
      pendingBytes = 0;
      if (!closed) socket?.resume();
      try {
        await ring.append(chunk);
      } catch (err) {
        await ring.failed(err);
      }
    }
  };
  const kick = () => {
    writing ??= flush().finally(() => {
      writing = undefined;
      if (pending.length > 0) kick();
    });
  };

  const attach = (s: Socket) => {
    socket = s;
    s.on("data", (b: Buffer) => {
      pending.push(b);
      pendingBytes += b.length;
      if (pendingBytes >= PENDING_HIGH_BYTES) s.pause();
      kick();
    });
    s.on("error", () => {}); // "close" follows; the cause does not change what we do
    s.on("close", () => {
      if (socket === s) socket = undefined;
      if (closed) return;
      // QEMU drops a client whose write failed; it still listens while it runs. A socket that
      // stopped listening (QEMU gone) refuses, which ends the drain.
      setTimeout(() => void connect(RECONNECT_DELAY_MS).then((ok) => ok || void close()), RECONNECT_DELAY_MS);
    });
  };

  const connect = async (budgetMs: number): Promise<boolean> => {
    const deadline = performance.now() + budgetMs;
    while (!closed) {
      const s = await tryConnect(socketPath);
      if (s !== "retry") {
        if (closed) {
          s.destroy();
          return false;
        }
        attach(s);
        return true;
      }
      if (performance.now() >= deadline) return false;
      await Bun.sleep(CONNECT_RETRY_MS);
    }
    return false;
  };

  let closing: Promise<void> | undefined;
  const close = () => {
    closing ??= (async () => {
      closed = true;
      socket?.destroy();
      socket = undefined;
      while (writing) await writing;
      await ring.close();
    })();
    return closing;
  };

  const ready = connect(CONNECT_BUDGET_MS).then((ok) => {
    if (!ok && !closed) log(`console ${socketPath}: no console socket to drain`);
    return ok;
  });
  return { ready, close };
}

/**
 * `logPath` kept as a two-file ring of CONSOLE_FILE_BYTES each (`<log>.1` the older half). A disk
 * error is reported once per kind; the file is reopened for the next chunk.
 */
function logRing(
  logPath: string,
  log: (msg: string) => void,
): { append(chunk: Buffer): Promise<void>; failed(err: unknown): Promise<void>; close(): Promise<void> } {
  let file: FileHandle | undefined;
  let fileSize = 0;
  const reported = new Set<string>();
  const report = (what: string, err: unknown) => {
    const code = (err as NodeJS.ErrnoException).code ?? String(err);
    if (reported.has(`${what}:${code}`)) return;
    reported.add(`${what}:${code}`);
    log(`console ${logPath}: ${what}: ${(err as Error).message ?? err} (dropping console output)`);
  };

  const openLog = async (): Promise<FileHandle> => {
    if (file) return file;
    const fh = await openOwnLog(logPath, false);
    fileSize = (await fh.stat()).size;
    file = fh;
    return fh;
  };
  const rotate = async (): Promise<FileHandle> => {
    // The log is diagnostic: a close of the file being rotated away that fails costs its tail.
    await settled(file?.close());
    file = undefined;
    await rename(logPath, `${logPath}.1`).catch((err: NodeJS.ErrnoException) => {
      if (err.code !== "ENOENT") throw err;
    });
    const fh = await openOwnLog(logPath, true);
    fileSize = 0;
    file = fh;
    return fh;
  };
  const append = async (chunk: Buffer) => {
    // A chunk longer than a whole file keeps only its newest bytes.
    const data =
      chunk.length > CONSOLE_FILE_BYTES ? chunk.subarray(chunk.length - CONSOLE_FILE_BYTES) : chunk;
    let fh = await openLog();
    if (fileSize > 0 && fileSize + data.length > CONSOLE_FILE_BYTES) fh = await rotate();
    await fh.write(data);
    fileSize += data.length;
  };
  return {
    append,
    failed: async (err) => {
      report("write", err);
      await settled(file?.close()); // the write's error is reported just above
      file = undefined;
    },
    close: async () => {
      await settled(file?.close()); // the VM is going: nothing more is written
      file = undefined;
    },
  };
}

/**
 * One connect attempt: the socket, or "retry" (not there yet / refused). A name that is not a
 * socket (a symlink an escaped QEMU put there) is never connected to: "retry" until the budget
 * ends and the drain gives up.
 */
async function tryConnect(socketPath: string): Promise<Socket | "retry"> {
  const c = await connectSocketAt(socketPath);
  return "socket" in c ? c.socket : "retry";
}

/**
 * The last `bytes` of the console as text: the end of `console.log.1` followed by `console.log`,
 * read without loading either file whole.
 */
export async function consoleTail(logPath: string, bytes: number): Promise<string> {
  const current = await fileTail(logPath, bytes);
  const older =
    current.length < bytes ? await fileTail(`${logPath}.1`, bytes - current.length) : Buffer.alloc(0);
  return Buffer.concat([older, current]).toString("utf8");
}

async function fileTail(path: string, bytes: number): Promise<Buffer> {
  let fh: FileHandle | undefined;
  try {
    // O_NOFOLLOW: the file is in the jailed QEMU's own directory, where it could be a symlink
    // to a host file whose tail would then reach an error message.
    fh = await open(path, constants.O_RDONLY | constants.O_NOFOLLOW);
    const size = (await fh.stat()).size;
    const n = Math.min(size, bytes);
    const buf = Buffer.alloc(n);
    const { bytesRead } = await fh.read(buf, 0, n, size - n);
    return buf.subarray(0, bytesRead);
  } catch {
    return Buffer.alloc(0);
  } finally {
    await settled(fh?.close()); // read-only: the bytes read are already in hand
  }
}

/**
 * Opens the console log for appending (or truncated, after a rotation) as the agent, which runs
 * as root, in a directory the jailed QEMU owns: QEMU could have put a symlink there (to make
 * root append guest bytes to a host file) or a hard link to another file of that directory. The
 * last component is never followed (O_NOFOLLOW), and a file that is not a plain file with one
 * link is removed and made anew, exclusively.
 */
async function openOwnLog(path: string, truncate: boolean): Promise<FileHandle> {
  const flags =
    constants.O_WRONLY |
    constants.O_CREAT |
    constants.O_APPEND |
    constants.O_NOFOLLOW |
    constants.O_NONBLOCK |
    (truncate ? constants.O_TRUNC : 0);
  let fh: FileHandle | undefined;
  try {
    fh = await open(path, flags, 0o600);
    const st = await fh.stat();
    if (st.isFile() && st.nlink === 1) return fh;
  } catch (err) {
    // ELOOP: a symlink; ENXIO: a FIFO nobody reads (O_NONBLOCK: the open fails, never waits).
    if (!["ELOOP", "ENXIO"].includes((err as NodeJS.ErrnoException).code ?? "")) throw err;
  }
  await settled(fh?.close()); // the file is removed next
  await rm(path, { force: true });
  return open(
    path,
    constants.O_WRONLY |
      constants.O_CREAT |
      constants.O_EXCL |
      constants.O_APPEND |
      constants.O_NOFOLLOW |
      constants.O_NONBLOCK,
    0o600,
  );
}
