/**
 * Host end of one guest tunnel (OP CONNECT, docs/guest-protocol.md "Tunnels"): a raw byte duplex
 * to a TCP socket inside the guest, as web streams, with the protocol's credit flow control.
 *
 * - guest -> host: the guest sends DATA only within the credit we granted (TUNNEL_WINDOW to
 *   start). Bytes wait here until the consumer reads them; only then is their credit returned.
 *   So a slow reader stops the guest from reading its socket, and what waits here is bounded by
 *   one window.
 * - host -> guest: `writable` sends DATA only within the credit the guest granted; a write waits
 *   for CREDIT (and for the unix socket to drain), so a slow guest reader slows the writer.
 * - Closing: no half-close. Our `close()` (or the writable's end, or cancelling the readable)
 *   sends CLOSE; the guest flushes what we sent into its socket, closes it and answers CLOSE.
 *   The guest's CLOSE (its socket's EOF or error) ends `readable` after the bytes already here.
 *   The stream id is released when the guest's CLOSE arrives or the connection drops, or when
 *   the guest leaves our CLOSE unanswered for CLOSE_ANSWER_MS: a guest cannot pin host state by
 *   withholding CLOSE.
 * - A guest that grants more credit than the bytes we sent it could have freed (more than one
 *   window outstanding), or sends DATA beyond the credit we granted, breaks the protocol: the
 *   channel fails. So nothing here ever holds more than one window of guest bytes.
 */
import { FrameType, TUNNEL_WINDOW } from "../../contracts/guest-protocol.ts";
import { decodeClose, decodeCredit, encodeCredit, GuestError } from "./codec.ts";

/** DATA frames carry at most this much: one 64 KiB frame does not hog the shared port for long. */
export const TUNNEL_CHUNK = 64 * 1024;
/** Credit goes back in batches of a quarter window (or when everything here was consumed). */
const GRANT_BATCH = TUNNEL_WINDOW / 4;
/**
 * How long our CLOSE waits for the guest's before the id is released anyway. The guest answers
 * once it has written what we sent into its socket, for at most 5 s (TUNNEL_LINGER_MS in
 * guest/tunnel.c); 30 s adds room for frames queued behind on a loaded TCG host.
 */
export const CLOSE_ANSWER_MS = 30_000;

export interface TunnelOptions {
  /** Ends the tunnel when no byte moved either way for this long (tunnels the guest opened). */
  idleMs?: number;
  /** See CLOSE_ANSWER_MS. */
  closeAnswerMs?: number;
}

/** What a tunnel needs from its GuestClient. */
export interface TunnelLink {
  /** Sends one frame on the tunnel's stream; false when the socket's buffer is full. Throws
   * `guest_disconnected` once the connection is gone. */
  send(type: number, payload?: Uint8Array): boolean;
  /** True while the socket holds bytes above its high-water mark: large frames wait. */
  congested(): boolean;
  /** Resolves when the socket drained (or closed). */
  drained(): Promise<void>;
  /** The tunnel is finished: its stream id may be reused. */
  release(): void;
}

type Phase = "connecting" | "open" | "closing" | "closed";

export class GuestTunnel {
  readonly readable: ReadableStream<Uint8Array>;
  readonly writable: WritableStream<Uint8Array>;
  /** Resolves once the tunnel is finished on both sides (or the connection dropped). Never rejects. */
  readonly closed: Promise<void>;
  /** Why it ended when it did not end cleanly (guest socket error, disconnect); else undefined. */
  error: Error | undefined;
  /** Bytes moved each way, for metrics and tests. */
  bytesIn = 0;
  bytesOut = 0;
  /** Most guest bytes ever waiting here for the consumer (bounded by TUNNEL_WINDOW). */
  peakBuffered = 0;
  /** A terminal's (Op.PTY) shell: its pid in the guest, from the open answer; else undefined. */
  pid: number | undefined;

  private phase: Phase = "connecting";
  private readonly queue: Buffer[] = [];
  private queued = 0;
  private ungranted = 0;
  private recvCredit = TUNNEL_WINDOW;
  private sendCredit = 0;
  private remoteEnded = false;
  private remoteError: GuestError | undefined;
  private readController!: ReadableStreamDefaultController<Uint8Array>;
  private writeController!: WritableStreamDefaultController;
  private readableDone = false;
  private wakeReader: (() => void) | undefined;
  private wakeWriter: (() => void) | undefined;
  private resolveClosed!: () => void;
  private readonly listeners: Array<() => void> = [];
  /** The idle timeout (opts.idleMs) or, once our CLOSE is out, the wait for the guest's. */
  private timer: ReturnType<typeof setTimeout> | undefined;
  private lastActivityMs = performance.now();

  constructor(
    readonly stream: number,
    readonly port: number,
    private readonly link: TunnelLink,
    private readonly opts: TunnelOptions = {},
  ) {
    this.closed = new Promise((resolve) => {
      this.resolveClosed = resolve;
    });
    this.armIdle();
    this.readable = new ReadableStream<Uint8Array>(
      {
        start: (c) => {
          this.readController = c;
        },
        pull: (c) => this.pull(c),
        cancel: () => this.close(),
      },
      // highWaterMark 0: pull runs only when a read is pending, so bytes stay in our queue (and
      // their credit stays unreturned) until the consumer really takes them.
      { highWaterMark: 0 },
    );
    this.writable = new WritableStream<Uint8Array>(
      {
        start: (c) => {
          this.writeController = c;
        },
        write: (chunk) => this.write(chunk),
        close: () => this.close(true),
        abort: () => this.close(),
      },
      { highWaterMark: 1 },
    );
  }

  /** Called by every end of the tunnel once; `onEnd` listeners (the manager's bookkeeping). */
  onEnd(cb: () => void): void {
    if (this.phase === "closed") cb();
    else this.listeners.push(cb);
  }

  get isClosed(): boolean {
    return this.phase === "closed";
  }

  /** Sends CLOSE (once); readable ends, writes fail. Idempotent. */
  close(fromWritable = false): void {
    if (this.phase === "closing" || this.phase === "closed") return;
    if (this.phase === "connecting" || this.remoteEnded) {
      this.finish(undefined);
      return;
    }
    this.phase = "closing";
    this.endReadable(undefined, true);
    // The writable's own close is already settling it; erroring it then would fail that close.
    if (!fromWritable) this.failWriter(new GuestError("guest_error", "tunnel closed"));
    try {
      this.link.send(FrameType.CLOSE);
    } catch {
      this.finish(undefined); // disconnected: nothing to wait for
      return;
    }
    const ms = this.opts.closeAnswerMs ?? CLOSE_ANSWER_MS;
    this.setTimer(ms, () => {
      this.finish(new GuestError("guest_timeout", `tunnel ${this.stream}: no CLOSE answer within ${ms} ms`));
    });
  }

  /**
   * Ends the tunnel now with `err` (the VM is being destroyed, failed or suspended): readable
   * and writable fail with it; the guest is told with a CLOSE when it can still hear it.
   */
  abort(err: Error): void {
    if (this.phase === "closed") return;
    if (this.phase === "open") {
      try {
        this.link.send(FrameType.CLOSE);
      } catch {
        // disconnected already
      }
    }
    this.error ??= err;
    this.endReadable(err, true);
    this.failWriter(err);
    this.finish(undefined);
  }

  /**
   * PTY tunnels (GuestClient.openPty): sets the terminal's size. Sizes are clamped to 1..65535
   * (u16 on the wire, as in struct winsize). A no-op once the tunnel is closing.
   */
  resize(cols: number, rows: number): void {
    if (this.phase !== "open" || this.remoteEnded) return;
    const clamp = (n: number) => Math.max(1, Math.min(0xffff, Math.floor(n)));
    const p = Buffer.alloc(4);
    p.writeUInt16LE(clamp(cols), 0);
    p.writeUInt16LE(clamp(rows), 2);
    try {
      this.link.send(FrameType.RESIZE, p);
    } catch {
      // disconnected: `disconnected` ends everything
    }
  }

  // ---- called by GuestClient ---------------------------------------------------------------

  /** The CONNECT succeeded: DATA may flow. */
  opened(): void {
    if (this.phase !== "connecting") return;
    this.phase = "open";
    this.sendCredit = TUNNEL_WINDOW;
    this.wakeWriter?.();
  }

  /** Returns a protocol error when the guest broke the rules (the connection should fail). */
  onFrame(type: number, payload: Buffer): GuestError | undefined {
    switch (type) {
      case FrameType.DATA: {
        if (this.phase === "closing" || this.phase === "closed" || this.remoteEnded) return undefined;
        if (payload.length > this.recvCredit) {
          return new GuestError(
            "protocol_error",
            `tunnel ${this.stream}: ${payload.length} DATA bytes with ${this.recvCredit} of credit`,
            { details: { reason: "credit" } },
          );
        }
        this.recvCredit -= payload.length;
        this.bytesIn += payload.length;
        if (payload.length === 0) return undefined;
        this.lastActivityMs = performance.now();
        this.queue.push(payload);
        this.queued += payload.length;
        if (this.queued > this.peakBuffered) this.peakBuffered = this.queued;
        this.wakeReader?.();
        return undefined;
      }
      case FrameType.CREDIT: {
        const d = decodeCredit(payload);
        if (!d.ok) return d.error;
        // The guest grants only for bytes we sent and it consumed: never past one window.
        if (this.sendCredit + d.bytes > TUNNEL_WINDOW) {
          return new GuestError(
            "protocol_error",
            `tunnel ${this.stream}: CREDIT of ${d.bytes} bytes leaves ${this.sendCredit + d.bytes} outstanding, more than the ${TUNNEL_WINDOW}-byte window`,
            { details: { reason: "credit" } },
          );
        }
        this.sendCredit += d.bytes;
        this.wakeWriter?.();
        return undefined;
      }
      case FrameType.CLOSE: {
        const d = decodeClose(payload);
        if (!d.ok) return d.error;
        this.remoteEnded = true;
        this.remoteError = d.error;
        // A clean CLOSE (the guest socket's EOF) ends only what comes from the guest, after the
        // bytes already queued here. Erroring the writable too would make a Node Duplex over
        // these streams (Duplex.fromWeb: the egress proxy's) destroy its readable side at once,
        // dropping a reply its consumer had not read yet (measured: 3-13 in 40 proxied requests
        // to the guest's own loopback cut short). A later write fails in write().
        if (d.error) this.failWriter(d.error);
        else this.wakeWriter?.();
        this.wakeReader?.(); // ends the readable once the queue is consumed
        this.finish(d.error);
        return undefined;
      }
      default:
        return undefined;
    }
  }

  /** The connection to the guest is gone: everything ends now, with that error. */
  disconnected(err: GuestError): void {
    if (this.phase === "closed") return;
    this.endReadable(err, false);
    this.failWriter(err);
    this.finish(err);
  }

  // ---- internals -----------------------------------------------------------------------------

  private async pull(c: ReadableStreamDefaultController<Uint8Array>): Promise<void> {
    for (;;) {
      if (this.readableDone) return;
      const chunk = this.queue.shift();
      if (chunk) {
        this.queued -= chunk.length;
        c.enqueue(chunk);
        this.grant(chunk.length);
        return;
      }
      if (this.remoteEnded || this.phase === "closed") {
        this.endReadable(this.remoteError ?? (this.error as GuestError | undefined), false);
        return;
      }
      await new Promise<void>((resolve) => {
        this.wakeReader = resolve;
      });
      this.wakeReader = undefined;
    }
  }

  private grant(n: number): void {
    this.ungranted += n;
    if (this.phase !== "open" || this.remoteEnded) return;
    if (this.ungranted < GRANT_BATCH && this.queued > 0) return;
    const bytes = this.ungranted;
    this.ungranted = 0;
    this.recvCredit += bytes;
    try {
      this.link.send(FrameType.CREDIT, encodeCredit(bytes));
    } catch {
      // disconnected: `disconnected` ends everything
    }
  }

  private async write(chunk: Uint8Array): Promise<void> {
    const buf = Buffer.from(chunk.buffer, chunk.byteOffset, chunk.byteLength);
    let off = 0;
    while (off < buf.length) {
      if (
        this.phase === "connecting" ||
        (this.phase === "open" && this.sendCredit === 0 && !this.remoteEnded)
      ) {
        await new Promise<void>((resolve) => {
          this.wakeWriter = resolve;
        });
        this.wakeWriter = undefined;
        continue;
      }
      if (this.phase !== "open" || this.remoteEnded) {
        throw this.remoteError ?? this.error ?? new GuestError("guest_error", "tunnel closed");
      }
      // Wait for room BEFORE writing (and check again after: no await between the check and
      // the write), so tunnels writing at once add one chunk past the socket's high-water mark
      // between them, not one each.
      if (this.link.congested()) {
        await this.link.drained();
        continue;
      }
      const n = Math.min(this.sendCredit, TUNNEL_CHUNK, buf.length - off);
      this.sendCredit -= n;
      this.link.send(FrameType.DATA, buf.subarray(off, off + n));
      this.bytesOut += n;
      this.lastActivityMs = performance.now();
      off += n;
    }
  }

  /** Re-arms itself until no byte moved for idleMs, then ends the tunnel (a CLOSE to the guest). */
  private armIdle(): void {
    const ms = this.opts.idleMs;
    if (ms === undefined || this.phase === "closing" || this.phase === "closed") return;
    const left = this.lastActivityMs + ms - performance.now();
    if (left > 0) {
      this.setTimer(left, () => this.armIdle());
      return;
    }
    this.abort(new GuestError("guest_timeout", `tunnel ${this.stream}: idle for ${ms} ms`));
  }

  private setTimer(ms: number, fn: () => void): void {
    if (this.timer) clearTimeout(this.timer);
    this.timer = setTimeout(() => {
      this.timer = undefined;
      fn();
    }, ms);
    this.timer.unref?.();
  }

  private endReadable(err: Error | undefined, discard: boolean): void {
    if (this.readableDone) return;
    this.readableDone = true;
    if (discard) {
      this.queue.length = 0;
      this.queued = 0;
    }
    try {
      if (err) this.readController.error(err);
      else this.readController.close();
    } catch {
      // already closed or errored by the consumer
    }
    this.wakeReader?.();
  }

  private failWriter(err: Error): void {
    try {
      this.writeController.error(err);
    } catch {
      // already errored
    }
    this.wakeWriter?.();
  }

  private finish(err: GuestError | undefined): void {
    if (this.phase === "closed") return;
    this.phase = "closed";
    if (this.timer) clearTimeout(this.timer);
    this.timer = undefined;
    if (err && !this.error) this.error = err;
    this.link.release();
    this.wakeReader?.();
    this.wakeWriter?.();
    this.resolveClosed();
    for (const l of this.listeners.splice(0)) {
      try {
        l();
      } catch {
        // a listener's failure is its own
      }
    }
  }
}
