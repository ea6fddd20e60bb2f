/**
 * The host's ops on a guest (docs/guest-protocol.md): exec, files, tunnels and PTYs, each one
 * request on the connection GuestChannel keeps (channel.ts: framing, stream ids, timeouts, the
 * end of every pending request when the connection drops). In production the port is QEMU's
 * chardev unix socket (QEMU listens, we connect: `GuestClient.connect`). In host-mode tests the
 * agent connects to us instead (`GuestListener.listen` + `accept`, listener.ts).
 *
 * Every public method maps to one op. Every failure is a `GuestError` with a stable `code` (see
 * codec.ts).
 */

import type { Socket } from "node:net";
import { FrameType, MAX_PAYLOAD, Op, StreamFlag, Tag } from "../../contracts/guest-protocol.ts";
import { connectSocketAt } from "../host/socket-path.ts";
import { GuestChannel } from "./channel.ts";
import type {
  ExecOptions,
  ExecResult,
  FileOptions,
  GuestClientOptions,
  PtyOptions,
  ReadFileResult,
  WriteFileOptions,
} from "./client-types.ts";
import { GuestError, type TlvRecords, TlvWriter } from "./codec.ts";
import type { GuestTunnel } from "./tunnel.ts";

export { GUEST_TUNNEL_IDLE_MS, MAX_GUEST_TUNNELS, MAX_REQUESTS_IN_FLIGHT } from "./channel.ts";
export type {
  ExecOptions,
  ExecResult,
  FileOptions,
  GuestClientOptions,
  HelloInfo,
  PtyOptions,
  ReadFileResult,
  WriteFileOptions,
} from "./client-types.ts";
export { GuestError, type GuestErrorCode } from "./codec.ts";
export { MAX_QUEUED_TO_GUEST, SEND_STALL_MS } from "./outbox.ts";
export { GuestTunnel } from "./tunnel.ts";

const DEFAULT_MAX_OUTPUT = 1 << 20;
/** STDIN frames are cut to this size so one exec's stdin does not hog the port. */
const STDIN_CHUNK = 64 * 1024;
/**
 * Chunks of a streamed file write (WRITE_FILE_STREAM). 256 KiB: few frames for a large file (a
 * 10 MiB file is 40 frames), while a small control frame never waits behind more than one.
 */
const FILE_CHUNK = 256 * 1024;

export class GuestClient extends GuestChannel {
  private constructor(socket: Socket, opts: GuestClientOptions) {
    super(socket, opts);
  }

  /** Connects to a guest port's unix socket (QEMU's chardev) and completes HELLO. */
  static async connect(path: string, opts: GuestClientOptions = {}): Promise<GuestClient> {
    const c = await connectSocketAt(path);
    if ("found" in c)
      throw new GuestError("guest_disconnected", `guest port ${path} is ${c.found}: not connected to`);
    if ("error" in c)
      throw new GuestError("guest_disconnected", `cannot connect to guest port ${path}`, { cause: c.error });
    const socket = c.socket;
    return GuestClient.fromSocket(socket, opts);
  }

  /** Wraps an already connected socket (e.g. one accepted by GuestListener) and completes HELLO. */
  static async fromSocket(socket: Socket, opts: GuestClientOptions = {}): Promise<GuestClient> {
    const client = new GuestClient(socket, opts);
    try {
      await client.hello();
    } catch (err) {
      client.close();
      throw err;
    }
    return client;
  }

  async ping(): Promise<void> {
    await this.request(new TlvWriter().u32(Tag.OP, Op.PING));
  }

  async exec(o: ExecOptions): Promise<ExecResult> {
    if (o.argv.length === 0) throw new GuestError("guest_error", "exec: empty argv", { errno: 22 });
    const w = new TlvWriter().u32(Tag.OP, Op.EXEC);
    for (const a of o.argv) w.str(Tag.ARGV, a);
    const env = Array.isArray(o.env) ? o.env : Object.entries(o.env ?? {}).map(([k, v]) => `${k}=${v}`);
    for (const e of env) w.str(Tag.ENV, e);
    if (o.cwd !== undefined) w.str(Tag.CWD, o.cwd);
    if (o.uid !== undefined) w.u32(Tag.UID, o.uid);
    if (o.gid !== undefined) w.u32(Tag.GID, o.gid);
    if (o.timeoutMs !== undefined) w.u32(Tag.TIMEOUT_MS, o.timeoutMs);
    const maxOutput = o.maxOutput ?? DEFAULT_MAX_OUTPUT;
    if (o.maxOutput !== undefined) w.u32(Tag.MAX_OUTPUT, o.maxOutput);
    const streaming = o.onStdout !== undefined || o.onStderr !== undefined;
    const streamedStdin =
      o.stdin !== undefined && typeof o.stdin !== "string" && !(o.stdin instanceof Uint8Array);
    w.u32(
      Tag.STREAM,
      (streaming ? StreamFlag.OUTPUT : 0) |
        (streamedStdin ? StreamFlag.STDIN : 0) |
        (o.onStarted ? StreamFlag.STARTED : 0),
    );
    if (o.seed !== undefined) w.bytes(Tag.SEED, o.seed);
    if (typeof o.stdin === "string" || o.stdin instanceof Uint8Array) w.bytes(Tag.STDIN, o.stdin);

    // Streamed output is collected here with the same cap the guest applies to captured output.
    const keep = o.collect === false ? 0 : maxOutput;
    const out = new Collector(keep);
    const err = new Collector(keep);
    const onFrame = (type: number, payload: Buffer) => {
      if (type === FrameType.STDOUT) {
        out.add(payload);
        o.onStdout?.(payload);
      } else if (type === FrameType.STDERR) {
        err.add(payload);
        o.onStderr?.(payload);
      } else if (type === FrameType.STARTED) {
        // 4 bytes: the guest pid (u32 LE); empty: an older guest agent that does not say it.
        o.onStarted?.(payload.length === 4 ? payload.readUInt32LE(0) : undefined);
      }
    };
    // No client timeout without a guest timeout: a command may legitimately run for ever; the
    // caller bounds it with `signal`. With one, see execGraceMs.
    const timeoutMs = o.timeoutMs ? o.timeoutMs + this.opts.execGraceMs : undefined;
    const { stream, promise } = await this.start(w, { timeoutMs, onFrame });

    const onAbort = () => {
      if (!this.pending.has(stream)) return;
      try {
        this.send(FrameType.CANCEL, stream);
      } catch {
        return; // disconnected: the pending request is rejected already
      }
      // The RESPONSE still comes after a CANCEL (docs: CANCEL); bound the wait for it.
      this.armTimer(stream, this.opts.execGraceMs, "no exec answer after CANCEL");
    };
    if (o.signal) {
      if (o.signal.aborted) onAbort();
      else o.signal.addEventListener("abort", onAbort, { once: true });
    }
    if (streamedStdin) void this.pumpStdin(stream, o.stdin as AsyncIterable<Uint8Array | string>);

    try {
      const r = await promise;
      return {
        exitCode: r.has(Tag.EXIT_CODE) ? (r.i32(Tag.EXIT_CODE) ?? null) : null,
        signal: r.has(Tag.SIGNAL) ? (r.i32(Tag.SIGNAL) ?? null) : null,
        timedOut: r.u32(Tag.TIMED_OUT) === 1,
        stdout: streaming ? out.result() : (r.get(Tag.STDOUT) ?? Buffer.alloc(0)),
        stderr: streaming ? err.result() : (r.get(Tag.STDERR) ?? Buffer.alloc(0)),
        stdoutTruncated: r.u32(Tag.STDOUT_TRUNC) === 1 || (keep > 0 && out.truncated),
        stderrTruncated: r.u32(Tag.STDERR_TRUNC) === 1 || (keep > 0 && err.truncated),
        durationUs: Number(r.u64(Tag.DURATION_US) ?? 0n),
        pid: r.u32(Tag.PID) ?? 0,
        seedAck: r.u32(Tag.SEED_ACK) === 1,
      };
    } finally {
      o.signal?.removeEventListener("abort", onAbort);
    }
  }

  /**
   * Writes a file in the guest, replaced atomically (temp file + rename). Content that fits one
   * frame goes in the REQUEST (WRITE_FILE); larger content follows it in FILE_CHUNK pieces
   * (WRITE_FILE_STREAM), so a file is bounded by the guest's disk, not by MAX_PAYLOAD. A refusal
   * (bad path, permission, ENOSPC) is a `guest_error` with the guest's errno and text; the guest
   * then leaves no temp file and the old file, if any, untouched.
   */
  async writeFile(path: string, data: Uint8Array | string, opts: WriteFileOptions = {}): Promise<void> {
    const bytes = typeof data === "string" ? Buffer.from(data) : data;
    const head = (op: number) => writeHead(op, path, opts);
    const w = head(Op.WRITE_FILE);
    // The TLV header of DATA (6 bytes) and slack for the frame: the whole REQUEST in one frame.
    if (w.length + bytes.length + 64 <= MAX_PAYLOAD) {
      await this.request(w.bytes(Tag.DATA, bytes));
      return;
    }
    if (w.length + 64 > MAX_PAYLOAD) {
      throw new GuestError(
        "protocol_error",
        `writeFile: a path of ${path.length} characters does not fit a frame`,
        {
          details: { reason: "oversize" },
        },
      );
    }
    const { stream, promise } = await this.start(head(Op.WRITE_FILE_STREAM), {
      timeoutMs: this.opts.requestTimeoutMs,
    });
    void this.pumpFile(stream, [bytes]);
    const r = await promise;
    const size = Number(r.u64(Tag.SIZE) ?? 0n);
    if (size !== bytes.length) {
      throw new GuestError("protocol_error", `writeFile: the guest wrote ${size} of ${bytes.length} bytes`, {
        details: { reason: "short_write" },
      });
    }
  }

  /**
   * WRITE_FILE_STREAM from a source of any length: each piece is read from `source` only once
   * the port has drained (back-pressure reaches the source's producer), and a source that fails
   * cancels the write (the guest removes its temp file; the old file stays). The size written.
   */
  async writeFileFrom(path: string, source: AsyncIterable<Uint8Array>, opts: WriteFileOptions = {}) {
    const { stream, promise } = await this.start(writeHead(Op.WRITE_FILE_STREAM, path, opts), {
      timeoutMs: this.opts.requestTimeoutMs,
    });
    void this.pumpFile(stream, source);
    return Number((await promise).u64(Tag.SIZE) ?? 0n);
  }

  /** One request, one answer (the file ops of fs-ops.ts). */
  call(w: TlvWriter): Promise<TlvRecords> {
    return this.request(w);
  }

  async readFile(
    path: string,
    opts: FileOptions & { maxBytes?: number; offset?: number } = {},
  ): Promise<ReadFileResult> {
    const w = new TlvWriter().u32(Tag.OP, Op.READ_FILE).str(Tag.PATH, path);
    if (opts.cwd !== undefined) w.str(Tag.CWD, opts.cwd);
    if (opts.maxBytes !== undefined) w.u32(Tag.MAX_BYTES, opts.maxBytes);
    if (opts.offset) w.u64(Tag.OFFSET, BigInt(opts.offset));
    fsIdentity(w, opts);
    const r = await this.request(w);
    return {
      data: r.get(Tag.DATA) ?? Buffer.alloc(0),
      size: Number(r.u64(Tag.SIZE) ?? 0n),
      truncated: r.u32(Tag.TRUNCATED) === 1,
    };
  }

  async entropy(bytes: Uint8Array): Promise<void> {
    await this.request(new TlvWriter().u32(Tag.OP, Op.ENTROPY).bytes(Tag.DATA, bytes));
  }

  async setClock(time: Date | bigint): Promise<void> {
    const ns = typeof time === "bigint" ? time : BigInt(time.getTime()) * 1_000_000n;
    await this.request(new TlvWriter().u32(Tag.OP, Op.SET_CLOCK).u64(Tag.REALTIME_NS, ns));
  }

  /** Sets the hostname and, with `bootId` (a lowercase UUID), the boot id the guest reports. */
  async setHostname(name: string, opts: { bootId?: string } = {}): Promise<void> {
    const w = new TlvWriter().u32(Tag.OP, Op.SET_HOSTNAME).str(Tag.HOSTNAME, name);
    if (opts.bootId !== undefined) w.str(Tag.BOOT_ID, opts.bootId);
    await this.request(w);
  }

  async sync(): Promise<void> {
    await this.request(new TlvWriter().u32(Tag.OP, Op.SYNC));
  }

  /**
   * Opens a byte tunnel to `host:port` inside the guest (default 127.0.0.1): resolves once the
   * guest's connect succeeded; a refused or failed connect is a `guest_error` with its errno
   * (111 ECONNREFUSED). See tunnel.ts for flow control and closing.
   */
  async openTunnel(port: number, opts: { host?: string } = {}): Promise<GuestTunnel> {
    if (!Number.isInteger(port) || port < 1 || port > 65535) {
      throw new GuestError("guest_error", `tunnel port ${port} is not in 1..65535`, { errno: 22 });
    }
    const w = new TlvWriter().u32(Tag.OP, Op.CONNECT).u32(Tag.PORT, port);
    if (opts.host !== undefined) w.str(Tag.HOST, opts.host);
    return this.startTunnel(w, port);
  }

  /** Sends a request whose success turns its stream into a tunnel (CONNECT, PTY). */
  private async startTunnel(w: TlvWriter, port: number): Promise<GuestTunnel> {
    let tunnel: GuestTunnel | undefined;
    // The tunnel is registered before the request goes out: its first DATA may follow the
    // RESPONSE in the same read, before our await resumes.
    const { promise } = await this.start(w, {
      timeoutMs: this.opts.requestTimeoutMs,
      beforeSend: (s) => {
        tunnel = this.registerTunnel(s, port);
      },
    });
    let answer: Awaited<typeof promise>;
    try {
      answer = await promise;
    } catch (err) {
      tunnel?.disconnected(err as GuestError);
      throw err;
    }
    // The guest's DATA and even its CLOSE (a server that answers and hangs up at once) may have
    // arrived with the RESPONSE: they wait in the tunnel for the caller to read.
    const t = tunnel!;
    t.pid = answer.u32(Tag.PID); // a PTY's shell; a CONNECT answer has none
    t.opened();
    return t;
  }

  /**
   * Starts an interactive shell on a new pseudo-terminal in the guest (Op.PTY): resolves with a
   * tunnel whose far end is the PTY master (flow control and closing as for `openTunnel`, plus
   * `resize`). Without `argv` the guest runs /bin/bash, else /bin/sh, as a login shell; what
   * `env` leaves out (TERM, PATH, HOME, USER, LOGNAME, SHELL) the guest fills in from the user's
   * passwd entry. Closing the tunnel hangs up the terminal and kills the shell's session.
   */
  async openPty(opts: PtyOptions): Promise<GuestTunnel> {
    const w = new TlvWriter().u32(Tag.OP, Op.PTY).u32(Tag.COLS, opts.cols).u32(Tag.ROWS, opts.rows);
    for (const a of opts.argv ?? []) w.str(Tag.ARGV, a);
    for (const e of opts.env ?? []) w.str(Tag.ENV, e);
    if (opts.cwd !== undefined) w.str(Tag.CWD, opts.cwd);
    if (opts.uid !== undefined) w.u32(Tag.UID, opts.uid);
    if (opts.gid !== undefined) w.u32(Tag.GID, opts.gid);
    return this.startTunnel(w, 0); // port 0: no guest port, the far end is the PTY master
  }

  /**
   * A streamed write's content as STDIN frames, then the empty one (EOF). Each chunk waits for the
   * port to drain (back-pressure; the next piece of an async source is not even asked for before)
   * and re-arms the request's timer: the bound is on progress, so a large file on a slow guest is
   * not cut while its bytes still move. A source that fails sends CANCEL.
   */
  private async pumpFile(stream: number, source: Iterable<Uint8Array> | AsyncIterable<Uint8Array>) {
    try {
      for await (const piece of source) {
        for (let off = 0; off < piece.length; off += FILE_CHUNK) {
          while (this.outbox.congested()) await this.outbox.drained();
          if (!this.pending.has(stream)) return; // refused (answered early) or failed
          this.send(FrameType.STDIN, stream, piece.subarray(off, off + FILE_CHUNK), true);
          this.armTimer(stream, this.opts.requestTimeoutMs, "no answer to a file write");
        }
      }
      if (this.pending.has(stream)) this.send(FrameType.STDIN, stream); // empty: EOF
    } catch {
      // The source failed: the guest drops the file (its answer, ECANCELED, rejects the request).
      // Or disconnected: the pending request is rejected already.
      try {
        if (this.pending.has(stream) && !this.closedWith) this.send(FrameType.CANCEL, stream);
      } catch {
        // disconnected meanwhile
      }
    }
  }

  private async pumpStdin(stream: number, source: AsyncIterable<Uint8Array | string>): Promise<void> {
    try {
      for await (const piece of source) {
        const buf = typeof piece === "string" ? Buffer.from(piece) : Buffer.from(piece);
        for (let off = 0; off < buf.length; off += STDIN_CHUNK) {
          // Before the write, with no await between check and write: writers never pile up on a
          // full socket.
          while (this.outbox.congested()) await this.outbox.drained();
          if (!this.pending.has(stream)) return; // answered or failed: the guest drops more stdin
          this.send(FrameType.STDIN, stream, buf.subarray(off, off + STDIN_CHUNK));
        }
      }
    } catch {
      // The source failed or the connection dropped: end stdin below if we still can.
    }
    if (this.pending.has(stream) && !this.closedWith) {
      try {
        this.send(FrameType.STDIN, stream); // empty STDIN frame = EOF
      } catch {
        // disconnected meanwhile: the request is rejected already
      }
    }
  }
}

/** The head of a WRITE_FILE or WRITE_FILE_STREAM request. */
function writeHead(op: number, path: string, opts: WriteFileOptions): TlvWriter {
  const w = new TlvWriter().u32(Tag.OP, op).str(Tag.PATH, path);
  if (opts.cwd !== undefined) w.str(Tag.CWD, opts.cwd);
  if (opts.mode !== undefined) w.u32(Tag.MODE, opts.mode);
  if (opts.uid !== undefined) w.u32(Tag.UID, opts.uid);
  if (opts.gid !== undefined) w.u32(Tag.GID, opts.gid);
  return fsIdentity(w, opts);
}

/** The FS_UID/FS_GID of a file op, when it names who does it. */
export function fsIdentity(w: TlvWriter, o: { fsUid?: number; fsGid?: number }): TlvWriter {
  if (o.fsUid !== undefined) w.u32(Tag.FS_UID, o.fsUid);
  if (o.fsGid !== undefined) w.u32(Tag.FS_GID, o.fsGid);
  return w;
}

/** Collects streamed output up to a cap, remembering whether more came. */
class Collector {
  private chunks: Buffer[] = [];
  private size = 0;
  truncated = false;
  constructor(private readonly cap: number) {}
  add(b: Buffer): void {
    const room = this.cap - this.size;
    if (b.length > room) this.truncated = true;
    const keep = Math.min(room, b.length);
    if (keep > 0) {
      this.chunks.push(b.subarray(0, keep));
      this.size += keep;
    }
  }
  result(): Buffer {
    return Buffer.concat(this.chunks, this.size);
  }
}
