/**
 * Host side of the guest protocol (docs/guest-protocol.md): one `GuestClient` per connection to
 * a guest agent's port. In production the port is QEMU's chardev unix socket (QEMU listens, we
 * connect: `GuestClient.connect`). In host-mode tests the agent connects to us instead
 * (`GuestListener.listen` + `accept`).
 *
 * Requests are multiplexed by stream id; every public method maps to one op. Every failure is a
 * `GuestError` with a stable `code` (see codec.ts). When the connection drops, every pending
 * request rejects at once with `guest_disconnected`: nothing ever waits on a dead socket.
 */
import { rmSync } from "node:fs";
import { createConnection, createServer, type Server, type Socket } from "node:net";
import {
  FrameType,
  GUEST_STREAM_BIT,
  MAX_PAYLOAD,
  Op,
  StreamFlag,
  Tag,
} from "../../contracts/guest-protocol.ts";
import { decodeTlv, FrameDecoder, GuestError, type TlvRecords, TlvWriter } from "./codec.ts";
import { Outbox, SEND_STALL_MS } from "./outbox.ts";
import { CLOSE_ANSWER_MS, GuestTunnel } from "./tunnel.ts";

export { GuestError, type GuestErrorCode } from "./codec.ts";
export { MAX_QUEUED_TO_GUEST, SEND_STALL_MS } from "./outbox.ts";
export { GuestTunnel } from "./tunnel.ts";

export interface GuestClientOptions {
  /** Bound on the HELLO round trip. 10 s: a restored VM answers its first frame in ~150 ms under
   * TCG (~1 ms on KVM); a guest silent for 10 s on a loaded host is treated as dead. */
  helloTimeoutMs?: number;
  /** Bound on every non-exec op. 60 s: the slowest is a 1 MiB WRITE_FILE or a SYNC of a dirty
   * disk under TCG, seconds at worst; beyond a minute the guest is stuck, not slow. */
  requestTimeoutMs?: number;
  /** Added to an exec's own `timeoutMs` before the client gives up on it: the guest enforces the
   * timeout itself (SIGKILL of the group, 20 ms drain, one frame back), so the client only waits
   * that much longer for the answer to travel. 10 s covers a loaded TCG guest. The same grace
   * bounds the wait for the answer after a CANCEL. */
  execGraceMs?: number;
  /** Diagnostics lines the guest sends as LOG frames. */
  onLog?: (line: string) => void;
  /** How long bytes may wait towards a guest that reads none of them (default SEND_STALL_MS). */
  sendStallMs?: number;
  /** How long a tunnel the guest opened may carry no byte either way (default GUEST_TUNNEL_IDLE_MS). */
  guestTunnelIdleMs?: number;
  /** How long a CLOSE we sent may wait for the guest's (default CLOSE_ANSWER_MS, tunnel.ts). */
  closeAnswerMs?: number;
}

/** `GuestClient.openPty`: the terminal's size, and who runs which shell where. */
export interface PtyOptions {
  cols: number;
  rows: number;
  argv?: string[];
  /** `NAME=value` entries; the guest adds login defaults for the names missing. */
  env?: string[];
  cwd?: string;
  uid?: number;
  gid?: number;
}

export interface HelloInfo {
  protoVersion: number;
  agentVersion: string;
  bootId: string;
  uptimeMs: number;
}

export interface ExecOptions {
  argv: string[];
  /** The whole environment; `argv[0]` is searched in its PATH. */
  env?: Record<string, string> | string[];
  cwd?: string;
  uid?: number;
  gid?: number;
  /** Guest-side timeout: the whole process group is killed (`timedOut`, `signal` 9). */
  timeoutMs?: number;
  /** Inline stdin (sent with the request), or chunks streamed as STDIN frames then EOF. */
  stdin?: string | Uint8Array | AsyncIterable<Uint8Array | string>;
  /** Per-stream capture cap in bytes (guest default 1 MiB). Streamed output is capped here too. */
  maxOutput?: number;
  /** Bytes mixed into the guest's entropy pool before the command runs. */
  seed?: Uint8Array;
  /** Given either callback, output is streamed as it is produced (and still collected). */
  onStdout?: (chunk: Buffer) => void;
  /** `false`: streamed output goes to the callbacks only, none is kept for the result. */
  collect?: boolean;
  onStderr?: (chunk: Buffer) => void;
  /** Aborting sends CANCEL: the group is killed and the result comes back with `signal` 9. */
  signal?: AbortSignal;
  /**
   * Called once the guest has forked the command (a STARTED frame): its cwd and argv were
   * accepted, before any output. A refusal (a bad cwd) rejects the exec without calling it.
   */
  onStarted?: () => void;
}

export interface ExecResult {
  exitCode: number | null;
  signal: number | null;
  timedOut: boolean;
  stdout: Buffer;
  stderr: Buffer;
  stdoutTruncated: boolean;
  stderrTruncated: boolean;
  durationUs: number;
  pid: number;
  /** True when a `seed` was given and the guest mixed it in and reseeded. */
  seedAck: boolean;
}

export interface ReadFileResult {
  data: Buffer;
  /** Size of the file (bytes read, for files without a size such as procfs). */
  size: number;
  truncated: boolean;
}

export interface FileOptions {
  /** Base for a relative path (default "/"). */
  cwd?: string;
  /** Whom the guest does the op as (its filesystem uid/gid); default root. */
  fsUid?: number;
  fsGid?: number;
}

export interface WriteFileOptions extends FileOptions {
  mode?: number;
  uid?: number;
  gid?: number;
}

const DEFAULT_MAX_OUTPUT = 1 << 20;
/** STDIN frames are cut to this size so one exec's stdin does not hog the port. */
const STDIN_CHUNK = 64 * 1024;
/**
 * Chunks of a streamed file write (WRITE_FILE_STREAM). 256 KiB: few frames for a large file (a
 * 10 MiB file is 40 frames), while a small control frame never waits behind more than one.
 */
const FILE_CHUNK = 256 * 1024;

// ---- bounds on what a guest can make the host hold -----------------------------------------
// The guest controls every byte it sends. Each queue it can fill has a bound below (and in
// outbox.ts for the bytes waiting for it to read); overflowing one ends the channel with a
// `protocol_error` (`details.reason` names the bound) and the sandbox above fails with it: the
// host never grows without limit for one guest.

/**
 * Tunnels the guest opened (OPEN) that the host still holds. The guest agent never has more than
 * 128 tunnels at once (MAX_TUNNELS in guest/agent.h, docs/guest-protocol.md "Limits")
 * and the host drops its entry as soon as the guest's CLOSE arrives, in order, so an honest guest
 * never has more than 128 here; one more OPEN is a guest breaking its own rule. 128 also bounds
 * what its windows can hold on the host: 128 x TUNNEL_WINDOW = 32 MiB.
 */
export const MAX_GUEST_TUNNELS = 128;
/**
 * Requests awaiting the guest's answer. The manager runs one exec at a time per sandbox (plus
 * its file writes), and a CONNECT waits at most 10 s in the guest, answered at once past the
 * guest's 128 tunnels; 1,024 unanswered requests is a guest sitting on them, not load.
 */
export const MAX_REQUESTS_IN_FLIGHT = 1024;
/**
 * A tunnel the guest opened that carries no byte either way for this long is closed by the host.
 * Egress connections idle legitimately (pooled keep-alive connections, a quiet database
 * session), so the bound is a proxy's usual idle read timeout (squid's `read_timeout`, 15 min),
 * not a short one; the tunnel count above is what bounds memory meanwhile.
 */
export const GUEST_TUNNEL_IDLE_MS = 15 * 60_000;

interface Pending {
  resolve: (records: TlvRecords) => void;
  reject: (err: GuestError) => void;
  onFrame?: (type: number, payload: Buffer) => void;
  timer?: ReturnType<typeof setTimeout>;
}

interface RequestOptions {
  timeoutMs?: number | undefined;
  onFrame?: (type: number, payload: Buffer) => void;
  /** Runs with the stream id just before the REQUEST is written. */
  beforeSend?: (stream: number) => void;
}

export class GuestClient {
  private readonly decoder = new FrameDecoder();
  private readonly pending = new Map<number, Pending>();
  /** Open tunnels by stream id (docs "Tunnels"); an id stays taken until the guest's CLOSE. */
  private readonly tunnels = new Map<number, GuestTunnel>();
  private nextStream = 1;
  private incoming: ((t: GuestTunnel) => void) | undefined;
  private helloWaiter: { promise: Promise<HelloInfo>; resolve: (h: HelloInfo) => void } | undefined;
  private closedWith: GuestError | undefined;
  private lastSocketError: Error | undefined;
  private readonly closeListeners: Array<(err: GuestError) => void> = [];
  private readonly opts: Required<Omit<GuestClientOptions, "onLog">> & Pick<GuestClientOptions, "onLog">;
  /** Tunnels in `tunnels` that the guest opened (the MAX_GUEST_TUNNELS bound). */
  private guestTunnels = 0;
  /** What waits for the guest to read it (bounded in bytes and time). */
  private readonly outbox: Outbox;
  /** Outstanding `pauseReading` calls. */
  private pauses = 0;

  private constructor(
    private readonly socket: Socket,
    opts: GuestClientOptions,
  ) {
    this.opts = {
      helloTimeoutMs: opts.helloTimeoutMs ?? 10_000,
      requestTimeoutMs: opts.requestTimeoutMs ?? 60_000,
      execGraceMs: opts.execGraceMs ?? 10_000,
      sendStallMs: opts.sendStallMs ?? SEND_STALL_MS,
      guestTunnelIdleMs: opts.guestTunnelIdleMs ?? GUEST_TUNNEL_IDLE_MS,
      closeAnswerMs: opts.closeAnswerMs ?? CLOSE_ANSWER_MS,
      onLog: opts.onLog,
    };
    this.outbox = new Outbox(socket, this.opts.sendStallMs, (err) => this.fail(err));
    socket.on("data", (chunk: Buffer) => this.onData(chunk));
    socket.on("error", (err) => {
      this.lastSocketError = err;
    });
    socket.on("close", () =>
      this.fail(
        new GuestError("guest_disconnected", "guest connection closed", {
          cause: this.lastSocketError,
        }),
      ),
    );
  }

  /** Connects to a guest port's unix socket (QEMU's chardev) and completes HELLO. */
  static async connect(path: string, opts: GuestClientOptions = {}): Promise<GuestClient> {
    const socket = await new Promise<Socket>((resolve, reject) => {
      const s = createConnection({ path });
      const onError = (err: Error) => {
        s.destroy();
        reject(new GuestError("guest_disconnected", `cannot connect to guest port ${path}`, { cause: err }));
      };
      s.once("error", onError);
      s.once("connect", () => {
        s.off("error", onError);
        resolve(s);
      });
    });
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

  get closed(): boolean {
    return this.closedWith !== undefined;
  }

  /**
   * Why the channel ended, once it has. A `protocol_error` is the guest's doing (bytes that break
   * the protocol, or a bound above overflowed): the sandbox above fails with it.
   */
  get failure(): GuestError | undefined {
    return this.closedWith;
  }

  /** What this channel holds now, for tests and diagnostics. */
  get load(): { tunnels: number; guestTunnels: number; inFlight: number; queuedBytes: number } {
    return {
      tunnels: this.tunnels.size,
      guestTunnels: this.guestTunnels,
      inFlight: this.pending.size,
      queuedBytes: this.outbox.queuedBytes,
    };
  }

  /** Called once when the connection ends, with the error every pending request got. */
  onClose(listener: (err: GuestError) => void): void {
    if (this.closedWith) listener(this.closedWith);
    else this.closeListeners.push(listener);
  }

  close(): void {
    this.fail(new GuestError("guest_disconnected", "guest client closed"));
  }

  /**
   * Stops reading the guest's frames until every pause is matched by `resumeReading`: the
   * back-pressure of a streamed exec whose consumer is behind. The guest's port then fills, its
   * queue passes its high mark and it stops reading its commands' output (and its tunnels'), so
   * the process writing blocks on its pipe; nothing grows on either side meanwhile.
   */
  pauseReading(): void {
    if (this.pauses++ === 0) this.socket.pause();
  }

  resumeReading(): void {
    if (this.pauses === 0) return;
    if (--this.pauses === 0) this.socket.resume();
  }

  /**
   * Sends HELLO and waits for the guest's answer; concurrent calls share one round trip. The
   * guest drops every tunnel on a HELLO (docs "Tunnels"), so ours end here too.
   */
  hello(timeoutMs = this.opts.helloTimeoutMs): Promise<HelloInfo> {
    if (this.helloWaiter) return this.helloWaiter.promise;
    for (const t of [...this.tunnels.values()]) {
      t.disconnected(new GuestError("guest_disconnected", `tunnel ${t.stream} ended by a new HELLO`));
    }
    this.tunnels.clear();
    this.guestTunnels = 0;
    let resolveFn!: (h: HelloInfo) => void;
    let rejectFn!: (e: GuestError) => void;
    const promise = new Promise<HelloInfo>((resolve, reject) => {
      resolveFn = resolve;
      rejectFn = reject;
    });
    const timer = setTimeout(() => {
      this.helloWaiter = undefined;
      this.closeListenersRemove(onClose);
      rejectFn(new GuestError("guest_timeout", `no HELLO answer within ${timeoutMs} ms`));
    }, timeoutMs);
    const onClose = (err: GuestError) => {
      clearTimeout(timer);
      this.helloWaiter = undefined;
      rejectFn(err);
    };
    this.helloWaiter = {
      promise,
      resolve: (h) => {
        clearTimeout(timer);
        this.helloWaiter = undefined;
        this.closeListenersRemove(onClose);
        resolveFn(h);
      },
    };
    this.onClose(onClose);
    try {
      this.send(FrameType.HELLO, 0, new TlvWriter().u32(Tag.PROTO_VERSION, 1).finish());
    } catch (err) {
      onClose(err as GuestError);
    }
    return promise;
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
        o.onStarted?.();
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
    try {
      await promise;
    } catch (err) {
      tunnel?.disconnected(err as GuestError);
      throw err;
    }
    // The guest's DATA and even its CLOSE (a server that answers and hangs up at once) may have
    // arrived with the RESPONSE: they wait in the tunnel for the caller to read.
    const t = tunnel!;
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
   * Who takes the tunnels the guest opens (OPEN frames: connections to the guest's egress proxy
   * port, docs "Egress"). Without a handler each one is closed at once, so the guest program
   * sees its connection end instead of waiting.
   */
  onIncomingTunnel(handler: ((t: GuestTunnel) => void) | undefined): void {
    this.incoming = handler;
  }

  /**
   * A tunnel on `stream`, known to this client until the guest's CLOSE frees the id (or the
   * guest does not answer our CLOSE in time, tunnel.ts CLOSE_ANSWER_MS).
   */
  private registerTunnel(stream: number, port: number): GuestTunnel {
    const byGuest = (stream & GUEST_STREAM_BIT) !== 0;
    const tunnel: GuestTunnel = new GuestTunnel(
      stream,
      port,
      {
        send: (type, payload) => this.send(type, stream, payload),
        congested: () => this.outbox.congested(),
        drained: () => this.outbox.drained(),
        release: () => {
          if (this.tunnels.get(stream) !== tunnel) return;
          this.tunnels.delete(stream);
          if (byGuest) this.guestTunnels--;
        },
      },
      {
        closeAnswerMs: this.opts.closeAnswerMs,
        ...(byGuest ? { idleMs: this.opts.guestTunnelIdleMs } : {}),
      },
    );
    this.tunnels.set(stream, tunnel);
    if (byGuest) this.guestTunnels++;
    return tunnel;
  }

  private acceptTunnel(stream: number, payload: Buffer): void {
    if ((stream & GUEST_STREAM_BIT) === 0 || this.tunnels.has(stream)) {
      this.fail(
        new GuestError("protocol_error", `OPEN on stream ${stream}: not a free guest stream id`, {
          details: { reason: "open" },
        }),
      );
      return;
    }
    if (this.guestTunnels >= MAX_GUEST_TUNNELS) {
      this.fail(
        misbehaved(
          "too_many_tunnels",
          `too many open tunnels (the guest opened more than ${MAX_GUEST_TUNNELS})`,
        ),
      );
      return;
    }
    const d = decodeTlv(payload);
    const port = d.ok ? (d.records.u32(Tag.PORT) ?? 0) : 0;
    const tunnel = this.registerTunnel(stream, port);
    tunnel.opened();
    if (this.incoming) this.incoming(tunnel);
    else tunnel.close();
  }

  // -------------------------------------------------------------------------------------------

  private async request(w: TlvWriter): Promise<TlvRecords> {
    return (await this.start(w, { timeoutMs: this.opts.requestTimeoutMs })).promise;
  }

  /**
   * Sends a REQUEST once the socket has room (back-pressure: a guest that reads slowly slows its
   * callers; one that stops reading fails the channel after SEND_STALL_MS) and registers it.
   */
  private async start(
    w: TlvWriter,
    ro: RequestOptions,
  ): Promise<{ stream: number; promise: Promise<TlvRecords> }> {
    // No await between this check and the write below: concurrent callers each see the socket
    // as the previous one left it.
    while (this.outbox.congested()) await this.outbox.drained();
    const stream = this.allocStream();
    const promise = new Promise<TlvRecords>((resolve, reject) => {
      if (this.closedWith) {
        reject(
          new GuestError("guest_disconnected", "guest connection is closed", { cause: this.closedWith }),
        );
        return;
      }
      if (this.pending.size >= MAX_REQUESTS_IN_FLIGHT) {
        const err = misbehaved(
          "requests_in_flight",
          `${MAX_REQUESTS_IN_FLIGHT} requests left unanswered by the guest`,
        );
        this.fail(err);
        reject(err);
        return;
      }
      const p: Pending = { resolve, reject };
      if (ro.onFrame) p.onFrame = ro.onFrame;
      this.pending.set(stream, p);
      if (ro.timeoutMs !== undefined) this.armTimer(stream, ro.timeoutMs, "no answer");
      ro.beforeSend?.(stream);
      try {
        this.send(FrameType.REQUEST, stream, w.finish());
      } catch (err) {
        this.settle(stream)?.reject(err as GuestError);
      }
    });
    return { stream, promise };
  }

  private armTimer(stream: number, ms: number, what: string): void {
    const p = this.pending.get(stream);
    if (!p) return;
    if (p.timer) clearTimeout(p.timer);
    p.timer = setTimeout(() => {
      // A late answer for this stream is dropped by onFrame (unknown stream).
      this.settle(stream)?.reject(
        new GuestError("guest_timeout", `${what} within ${ms} ms (stream ${stream})`),
      );
    }, ms);
  }

  private settle(stream: number): Pending | undefined {
    const p = this.pending.get(stream);
    if (!p) return undefined;
    this.pending.delete(stream);
    if (p.timer) clearTimeout(p.timer);
    return p;
  }

  private allocStream(): number {
    // Non-zero and unique among requests in flight (docs "Streams"); wraps below
    // GUEST_STREAM_BIT, which marks the ids of tunnels the guest opens (OPEN).
    for (;;) {
      const s = this.nextStream;
      this.nextStream = s >= GUEST_STREAM_BIT - 1 ? 1 : s + 1;
      if (!this.pending.has(s) && !this.tunnels.has(s)) return s;
    }
  }

  /** `uncopied`: a payload its caller never changes afterwards (Outbox.send). */
  private send(type: number, stream: number, payload?: Uint8Array, uncopied = false): boolean {
    if (!this.closedWith) {
      const ok = this.outbox.send(type, stream, payload, uncopied);
      if (!this.closedWith) return ok;
    }
    // Closed before, or by this write crossing the outbox's bound.
    throw new GuestError("guest_disconnected", "guest connection is closed", { cause: this.closedWith });
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

  private onData(chunk: Buffer): void {
    for (const ev of this.decoder.push(chunk)) {
      // A frame earlier in this chunk may have ended the channel: nothing after it counts.
      if (this.closedWith) return;
      if (ev.kind === "error") {
        // A framing error cannot be recovered from on this connection (docs "Framing").
        this.fail(ev.error);
        return;
      }
      this.onFrame(ev.frame.type, ev.frame.stream, ev.frame.payload);
    }
  }

  private onFrame(type: number, stream: number, payload: Buffer): void {
    switch (type) {
      case FrameType.HELLO: {
        const d = decodeTlv(payload);
        if (!d.ok) {
          this.fail(d.error);
          return;
        }
        this.helloWaiter?.resolve({
          protoVersion: d.records.u32(Tag.PROTO_VERSION) ?? 0,
          agentVersion: d.records.str(Tag.AGENT_VERSION) ?? "",
          bootId: d.records.str(Tag.BOOT_ID) ?? "",
          uptimeMs: Number(d.records.u64(Tag.UPTIME_MS) ?? 0n),
        });
        return;
      }
      case FrameType.LOG:
        this.opts.onLog?.(payload.toString("utf8"));
        return;
      case FrameType.STDOUT:
      case FrameType.STDERR:
      case FrameType.STARTED:
        this.pending.get(stream)?.onFrame?.(type, payload);
        return;
      case FrameType.RESPONSE: {
        const p = this.settle(stream);
        if (!p) return; // late answer to a request that timed out: dropped
        const d = decodeTlv(payload);
        if (!d.ok) {
          p.reject(d.error);
          return;
        }
        const status = d.records.u32(Tag.STATUS) ?? 0;
        if (status !== 0) {
          const text = d.records.str(Tag.ERROR) ?? `errno ${status}`;
          p.reject(new GuestError("guest_error", text, { errno: status }));
          return;
        }
        p.resolve(d.records);
        return;
      }
      case FrameType.OPEN:
        this.acceptTunnel(stream, payload);
        return;
      case FrameType.DATA:
      case FrameType.CREDIT:
      case FrameType.CLOSE: {
        // Unknown stream: a tunnel we already finished (frames crossing our CLOSE): dropped.
        const err = this.tunnels.get(stream)?.onFrame(type, payload);
        if (err) this.fail(err);
        return;
      }
      default:
        return; // newer frame types: ignored
    }
  }

  private fail(err: GuestError): void {
    if (this.closedWith) return;
    this.closedWith = err;
    this.outbox.close();
    this.socket.destroy();
    for (const stream of [...this.pending.keys()]) {
      const p = this.settle(stream);
      p?.reject(
        err.code === "protocol_error"
          ? err
          : new GuestError("guest_disconnected", `guest disconnected (stream ${stream})`, { cause: err }),
      );
    }
    for (const t of [...this.tunnels.values()]) {
      t.disconnected(
        new GuestError("guest_disconnected", `guest disconnected (tunnel ${t.stream})`, { cause: err }),
      );
    }
    this.tunnels.clear();
    this.guestTunnels = 0;
    for (const l of this.closeListeners.splice(0)) {
      try {
        l(err);
      } catch {
        // a listener's failure is its own: the others still learn the channel ended
      }
    }
  }

  private closeListenersRemove(l: (err: GuestError) => void): void {
    const i = this.closeListeners.indexOf(l);
    if (i >= 0) this.closeListeners.splice(i, 1);
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

/** The channel error for a guest that broke a bound: `reason` names it (details.reason). */
function misbehaved(reason: string, message: string): GuestError {
  return new GuestError("protocol_error", message, { details: { reason } });
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

/**
 * Host test mode: listens on a unix socket that a host-mode agent (`sandboxd-agent --port PATH`)
 * connects to, and hands out one GuestClient per accepted connection. The agent reconnects every
 * 50 ms after a disconnect, as the guest does after a restore.
 */
export class GuestListener {
  private readonly queue: Socket[] = [];
  private readonly waiters: Array<(s: Socket) => void> = [];

  private constructor(
    readonly path: string,
    private readonly server: Server,
  ) {
    server.on("connection", (s: Socket) => {
      const w = this.waiters.shift();
      if (w) w(s);
      else this.queue.push(s);
    });
  }

  static async listen(path: string): Promise<GuestListener> {
    rmSync(path, { force: true }); // a stale socket file from a crashed run
    const server = createServer();
    await new Promise<void>((resolve, reject) => {
      server.once("error", reject);
      server.listen(path, () => {
        server.off("error", reject);
        resolve();
      });
    });
    return new GuestListener(path, server);
  }

  /** Waits for the agent's next connection and completes HELLO on it. `timeoutMs` (default
   * 10 s) bounds the wait for the connection: a live agent retries every 50 ms. */
  async accept(opts: GuestClientOptions & { timeoutMs?: number } = {}): Promise<GuestClient> {
    const timeoutMs = opts.timeoutMs ?? 10_000;
    let socket = this.queue.shift();
    while (socket?.destroyed) socket = this.queue.shift(); // closed while queued
    if (!socket) {
      socket = await new Promise<Socket>((resolve, reject) => {
        const waiter = (s: Socket) => {
          clearTimeout(timer);
          resolve(s);
        };
        const timer = setTimeout(() => {
          const i = this.waiters.indexOf(waiter);
          if (i >= 0) this.waiters.splice(i, 1);
          reject(
            new GuestError("guest_timeout", `no agent connected to ${this.path} within ${timeoutMs} ms`),
          );
        }, timeoutMs);
        this.waiters.push(waiter);
      });
    }
    return GuestClient.fromSocket(socket, opts);
  }

  async close(): Promise<void> {
    for (const s of this.queue.splice(0)) s.destroy();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
    rmSync(this.path, { force: true });
  }
}
