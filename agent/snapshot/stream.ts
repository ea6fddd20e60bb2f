/**
 * Migration streams the agent carries itself: QEMU never spawns a helper. QEMU 7.2 has no `file:`
 * migration URI (added in 8.2), and an `exec` URI makes QEMU run `/bin/sh`, which a seccomp
 * filter with `spawn=deny` forbids; so state goes through a unix socket in the VM's own directory
 * (the only directory a jailed QEMU sees), and the agent copies between that socket and the
 * state file.
 *
 * - Save (`startSave` / `saveToFile`): the agent listens on `<vm dir>/mig-out.sock`, runs
 *   `migrate uri=unix:...`, accepts QEMU's one connection and writes what arrives to the file with
 *   back-pressure. The file is whole only when QEMU reports `completed`, the socket reached EOF and
 *   the last write (and fsync, when asked) finished; any failure removes the partial file.
 * - Load (`loadFromFile`): `migrate-incoming uri=unix:<vm dir>/mig-in.sock` makes QEMU listen;
 *   the agent connects and streams the file into it, then waits for `completed`.
 *
 * Both are bounded: one deadline for the whole exchange, and a save stops (and fails) past
 * `maxBytes`, so a QEMU that keeps sending cannot fill the disk.
 */

import { constants } from "node:fs";
import { chmod, type FileHandle, lchown, open, rm } from "node:fs/promises";
import { createConnection, createServer, type Server, type Socket } from "node:net";
import { join } from "node:path";
import { awaitedLater, settled } from "../../contracts/best-effort.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import type { VmProcess } from "../qemu/launch.ts";
import { SnapshotError } from "./errors.ts";
import { type MigrateInfo, qmp, waitMigration } from "./migrate.ts";
import { RamSplitter, type SplitTarget } from "./ram-split.ts";

/**
 * File names of the two sockets inside the VM directory (one migration per QEMU at a time). Short:
 * a unix socket path has at most 107 bytes, and these sit beside QEMU's own qmp.sock and agent.sock.
 */
export const SAVE_SOCKET = "mig-out.sock";
export const LOAD_SOCKET = "mig-in.sock";

/**
 * Who may connect to the save socket the agent creates: its mode, and optionally its owner. QEMU
 * running as another uid than the agent needs one of them (0o666 in a directory only that uid can
 * traverse, or the socket chowned to that uid).
 */
export interface SocketAccess {
  mode: number;
  uid?: number;
  gid?: number;
}

/** The agent's own QEMU runs as the agent's uid: only it may connect. */
export const DEFAULT_SOCKET_ACCESS: SocketAccess = { mode: 0o600 };

/** Slack on top of guest RAM in a save's byte cap: page headers, device state, ROM/firmware blocks. */
const CAP_MARGIN_BYTES = 64 * 1024 ** 2;

/**
 * Byte cap of a save of a guest with `memMib` of RAM. `passes` > 1 for a live precopy, which sends
 * pages the guest dirties again (a guest that keeps dirtying more than that fails its fork).
 */
export function migrationByteCap(memMib: number, passes = 1): number {
  return passes * memMib * 1024 ** 2 + CAP_MARGIN_BYTES;
}

/** Linux's O_PATH (not among node's fs.constants): a handle on the path itself, never opened. */
const O_PATH = 0o10000000;

/** How long `loadFromFile` retries connecting while QEMU's listening socket is not there yet. */
const CONNECT_RETRY_MS = 2;

/** Reads of the state file on load: large enough that a full RAM image is few writes. */
const LOAD_CHUNK_BYTES = 1024 * 1024;

/**
 * What these functions need of a QEMU: its QMP, its directory, and how the socket it connects to
 * must be opened (`migrationSocket`, the default otherwise).
 */
export type StreamVm = Pick<
  VmProcess,
  "qmp" | "kill" | "isAlive" | "exited" | "stderrTail" | "pid" | "dir"
> & {
  migrationSocket?: SocketAccess;
};

export interface SaveOptions {
  /** The state file (replaced; removed again if the save fails). */
  path: string;
  /** Past this many bytes the save fails. */
  maxBytes: number;
  /** Deadline of the whole save, from the `migrate` command to the last byte written. */
  timeoutMs: number;
  /** fsync the file before it counts as written (state that must survive a host crash). */
  fsync?: boolean;
  /**
   * When the file cannot take the stream (a write fails, the cap is passed), keep reading QEMU's
   * stream to its end and drop it, and fail only then, instead of cutting the socket. For a
   * background snapshot: QEMU 7.2 leaves a guest vCPU blocked in a userfaultfd write fault when
   * such a migration fails midway (seen from the host: the thread waits in handle_userfault and
   * the guest never answers again); a migration that completes releases every page.
   */
  drainOnError?: boolean;
  /**
   * Split the stream as it arrives (ram-split.ts): the RAM block's pages into `split.ramPath`, the
   * rest into `split.statePath` (which must then be `path`). Both are removed if the save fails.
   */
  split?: SplitTarget;
}

/** Where a save's bytes go: the state file as it comes, or a splitter. */
interface SaveSink {
  /** Reads QEMU's stream from the socket to its end into the sink, with back-pressure. */
  readFrom(c: Socket): Promise<Read>;
  /** The stream ended: the last write done (and synced when asked). */
  end(): Promise<void>;
  /** Closes and removes what was written (or only closes, `remove` false). */
  close(remove: boolean): Promise<void>;
}

async function openSink(o: SaveOptions): Promise<SaveSink> {
  if (o.split) {
    if (o.split.statePath !== o.path)
      throw new SandboxdError("internal", "a split save's state file must be its path");
    const splitter = await RamSplitter.open(o.split);
    let ended = false;
    return {
      readFrom: (c) => pushAll(c, splitter, o),
      async end() {
        await splitter.end();
        ended = true;
      },
      async close(remove) {
        if (remove || !ended) await splitter.abort();
      },
    };
  }
  const file = await open(o.path, constants.O_WRONLY | constants.O_CREAT | constants.O_TRUNC, 0o600);
  const write = async (chunk: Buffer) => {
    let off = 0;
    while (off < chunk.length) off += (await file.write(chunk, off, chunk.length - off)).bytesWritten;
  };
  return {
    readFrom: (c) => writeAll(c, write, o),
    async end() {
      if (o.fsync) await file.sync();
    },
    async close(remove) {
      await settled(file.close()); // a handle we abandon: the stream's failure is the error
      if (remove) await rm(o.path, { force: true });
    },
  };
}

/** A save in flight: the caller drives QEMU through the statuses it wants, then `finish`es. */
export interface SaveStream {
  /** Waits for a migration status; fails at once if the stream broke (its own error wins). */
  waitFor(until: string[], timeoutMs?: number): Promise<MigrateInfo>;
  /** Waits for `completed`, EOF and the last write; returns the bytes written. Aborts on failure. */
  finish(): Promise<number>;
  /** Drops the socket and the connection and removes the partial file. Idempotent. */
  abort(): Promise<void>;
}

function streamError(message: string, cause?: unknown): SnapshotError {
  return new SnapshotError("migration_failed", message, cause === undefined ? undefined : { cause });
}

function listen(server: Server, path: string): Promise<void> {
  return new Promise((resolve, reject) => {
    server.once("error", reject);
    server.listen(path, () => {
      server.off("error", reject);
      resolve();
    });
  });
}

/**
 * Starts an outgoing migration of `vm` into `o.path` through a socket in `vm.dir`. The returned
 * stream is already receiving; on any error here nothing is left behind.
 */
export async function startSave(vm: StreamVm, o: SaveOptions): Promise<SaveStream> {
  const sockPath = join(vm.dir, SAVE_SOCKET);
  const access = vm.migrationSocket ?? DEFAULT_SOCKET_ACCESS;
  const deadline = performance.now() + o.timeoutMs;
  let sink: SaveSink | undefined;
  let conn: Socket | undefined;
  let failure: SnapshotError | undefined;
  let onFailure: ((e: SnapshotError) => void) | undefined;
  const failed = new Promise<never>((_, reject) => {
    onFailure = reject;
  });
  awaitedLater(failed);
  const server = createServer();
  const fail = (e: SnapshotError) => {
    if (failure) return;
    failure = e;
    conn?.destroy();
    server.close();
    onFailure?.(e);
  };
  const timer = setTimeout(
    () => fail(streamError(`migration stream to ${o.path} did not finish within ${o.timeoutMs} ms`)),
    o.timeoutMs,
  );
  let cleaned = false;
  const cleanup = async (removeFile: boolean) => {
    if (cleaned) return;
    cleaned = true;
    clearTimeout(timer);
    conn?.destroy();
    server.close();
    await rm(sockPath, { force: true });
    if (sink) await sink.close(removeFile);
    else if (removeFile) await rm(o.path, { force: true });
  };

  let received: Promise<number> | undefined;
  try {
    await rm(sockPath, { force: true });
    sink = await openSink(o);
    const out = sink;
    received = new Promise<number>((resolve) => {
      server.once("connection", (c: Socket) => {
        // One connection, QEMU's: nobody else may follow it in.
        server.close();
        conn = c;
        if (failure) {
          c.destroy();
          return;
        }
        resolve(copyInto(c, out, o, fail));
      });
    });
    awaitedLater(received);
    await listen(server, sockPath);
    // A jailed QEMU owns its directory and could swap the socket for a symlink: the mode is set
    // through a handle opened without following one, the owner by lchown, which never does.
    const fh = await open(sockPath, O_PATH | constants.O_NOFOLLOW);
    try {
      await chmod(`/proc/self/fd/${fh.fd}`, access.mode);
    } finally {
      await fh.close();
    }
    if (access.uid !== undefined || access.gid !== undefined)
      await lchown(sockPath, access.uid ?? -1, access.gid ?? -1);
    await qmp(vm, "migrate", { uri: `unix:${sockPath}` });
  } catch (err) {
    await cleanup(true);
    throw err;
  }

  const waitFor = async (until: string[], timeoutMs?: number): Promise<MigrateInfo> => {
    if (failure) throw failure;
    const left = Math.max(0, deadline - performance.now());
    const status = waitMigration(vm, until, Math.min(timeoutMs ?? left, left));
    awaitedLater(status);
    return Promise.race([status, failed]);
  };
  const got = received;
  return {
    waitFor,
    async finish() {
      try {
        await waitFor(["completed"]);
        const bytes = await Promise.race([got, failed]);
        // A stream cut by the deadline may still end "normally": the failure decides.
        if (failure) throw failure;
        await cleanup(false);
        return bytes;
      } catch (err) {
        await cleanup(true);
        throw err;
      }
    },
    abort: () => cleanup(true),
  };
}

/**
 * Bytes a splitter may hold unparsed before the socket is paused: QEMU then waits on its socket
 * (a stopped guest's save finishes later; a background snapshot's guest runs on). 32 MiB: half a
 * 256 MiB guest's pages, so a stop-and-copy save rarely waits on the parse.
 */
const PUSH_BACKLOG_BYTES = 32 * 1024 * 1024;

/** What reading QEMU's stream came to: its bytes, and (drainOnError) the sink's failure. */
interface Read {
  bytes: number;
  sinkError: unknown;
}

const capError = (o: SaveOptions) =>
  streamError(`migration stream to ${o.path} exceeded its cap of ${o.maxBytes} bytes`);

/** Copies the socket into the sink until EOF; resolves with the byte count once it is written. */
async function copyInto(
  c: Socket,
  out: SaveSink,
  o: SaveOptions,
  fail: (e: SnapshotError) => void,
): Promise<number> {
  try {
    const r = await out.readFrom(c);
    if (r.sinkError !== undefined) throw r.sinkError;
    await out.end();
    return r.bytes;
  } catch (err) {
    const e =
      err instanceof SnapshotError
        ? err
        : streamError(`writing the migration stream to ${o.path} failed`, err);
    fail(e);
    throw e;
  }
}

/** Each chunk written before the next is read: back-pressure by async iteration. */
async function writeAll(c: Socket, write: (chunk: Buffer) => Promise<void>, o: SaveOptions): Promise<Read> {
  const r: Read = { bytes: 0, sinkError: undefined };
  for await (const chunk of c as AsyncIterable<Buffer>) {
    r.bytes += chunk.length;
    if (r.sinkError !== undefined) continue; // drained, not written (bounded by the deadline)
    try {
      if (r.bytes > o.maxBytes) throw capError(o);
      await write(chunk);
    } catch (err) {
      if (!o.drainOnError) throw err;
      r.sinkError = err;
    }
  }
  return r;
}

/**
 * A splitter's: chunks pushed as they come, the socket paused past the backlog bound. QEMU's
 * background snapshot flushes its stream page by page, ~20,000 socket reads for a 256 MiB guest;
 * a promise per chunk cost the agent ~8 us of CPU each, beside QEMU on the same cores.
 */
function pushAll(c: Socket, splitter: RamSplitter, o: SaveOptions): Promise<Read> {
  const r: Read = { bytes: 0, sinkError: undefined };
  return new Promise<Read>((resolve, reject) => {
    let paused = false;
    c.on("data", (chunk: Buffer) => {
      r.bytes += chunk.length;
      if (r.sinkError !== undefined) return; // drained, not parsed (bounded by the deadline)
      const broke = r.bytes > o.maxBytes ? capError(o) : splitter.failed;
      if (broke !== undefined) {
        if (!o.drainOnError) reject(broke);
        else r.sinkError = broke;
        return;
      }
      splitter.push(chunk);
      if (!paused && splitter.backlog > PUSH_BACKLOG_BYTES) {
        paused = true;
        c.pause();
        void splitter.drained().then(() => {
          paused = false;
          c.resume();
        });
      }
    });
    c.once("end", () => resolve(r));
    c.once("error", reject);
    // Closed without an end (cut by the deadline): the splitter's end says what is missing.
    c.once("close", () => resolve(r));
  });
}

/** Saves `vm` into `o.path`: `migrate`, wait for `completed`, all written. Returns the bytes. */
export async function saveToFile(vm: StreamVm, o: SaveOptions): Promise<number> {
  const s = await startSave(vm, o);
  return s.finish();
}

/**
 * On a QEMU started with `-incoming defer`: QEMU listens on a socket in its directory, the agent
 * streams the state file into it, then waits for `completed`.
 */
export async function loadFromFile(vm: StreamVm, path: string, timeoutMs: number): Promise<MigrateInfo> {
  const deadline = performance.now() + timeoutMs;
  const sockPath = join(vm.dir, LOAD_SOCKET);
  // Open first: a missing state file is a clear error, not a QEMU that waits for bytes.
  const file = await open(path, "r").catch((err) => {
    throw streamError(`cannot read the state file ${path}`, err);
  });
  let conn: Socket | undefined;
  try {
    await rm(sockPath, { force: true });
    await qmp(vm, "migrate-incoming", { uri: `unix:${sockPath}` });
    conn = await connectUnix(sockPath, deadline);
    // QEMU's status is the verdict: `completed` means it read the whole stream (a write that
    // failed after that changes nothing), and a stream cut short makes the load fail at once.
    const c = conn;
    sendFile(file, c, path).catch(() => c.destroy());
    return await waitMigration(vm, ["completed"], Math.max(0, deadline - performance.now()));
  } finally {
    conn?.destroy();
    await settled(file.close()); // as above: QEMU's status is the verdict
    await rm(sockPath, { force: true });
  }
}

async function sendFile(file: FileHandle, conn: Socket, path: string): Promise<void> {
  try {
    let left = (await file.stat()).size;
    while (left > 0) {
      const buf = Buffer.allocUnsafe(Math.min(left, LOAD_CHUNK_BYTES));
      const { bytesRead } = await file.read(buf, 0, buf.length, null);
      if (bytesRead === 0) break;
      left -= bytesRead;
      if (!conn.write(buf.subarray(0, bytesRead))) await drained(conn);
    }
    conn.end();
  } catch (err) {
    throw streamError(`streaming ${path} into QEMU failed`, err);
  }
}

/** Resolves when the socket can take more; rejects if it closes first (QEMU stopped reading). */
function drained(conn: Socket): Promise<void> {
  return new Promise<void>((resolve, reject) => {
    const done = (err?: Error) => {
      conn.off("drain", onDrain);
      conn.off("close", onClose);
      if (err) reject(err);
      else resolve();
    };
    const onDrain = () => done();
    const onClose = () => done(new SandboxdError("internal", "QEMU closed the migration socket"));
    conn.once("drain", onDrain);
    conn.once("close", onClose);
  });
}

async function connectUnix(path: string, deadline: number): Promise<Socket> {
  for (;;) {
    try {
      return await new Promise<Socket>((resolve, reject) => {
        const s = createConnection({ path });
        s.once("connect", () => {
          s.off("error", reject);
          resolve(s);
        });
        s.once("error", reject);
      });
    } catch (err) {
      if (performance.now() > deadline)
        throw streamError(`QEMU's migration socket ${path} did not accept a connection in time`, err);
      await Bun.sleep(CONNECT_RETRY_MS);
    }
  }
}
