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
 *   The stream id is released when the guest's CLOSE arrives or the connection drops.
 */
import { FrameType, TUNNEL_WINDOW } from "../../contracts/guest-protocol.ts";
import { decodeClose, decodeCredit, encodeCredit, GuestError } from "./codec.ts";

/** DATA frames carry at most this much: one 64 KiB frame does not hog the shared port for long. */
export const TUNNEL_CHUNK = 64 * 1024;
/** Credit goes back in batches of a quarter window (or when everything here was consumed). */
const GRANT_BATCH = TUNNEL_WINDOW / 4;

/** What a tunnel needs from its GuestClient. */
export interface TunnelLink {
  /** Sends one frame on the tunnel's stream; false when the socket's buffer is full. Throws
   * `guest_disconnected` once the connection is gone. */
  send(type: number, payload?: Uint8Array): boolean;
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

  constructor(
    readonly stream: number,
    readonly port: number,
    private readonly link: TunnelLink,
  ) {
    this.closed = new Promise((resolve) => {
      this.resolveClosed = resolve;
    });
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
    }
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
        this.queue.push(payload);
        this.queued += payload.length;
        if (this.queued > this.peakBuffered) this.peakBuffered = this.queued;
        this.wakeReader?.();
        return undefined;
      }
      case FrameType.CREDIT: {
        const d = decodeCredit(payload);
        if (!d.ok) return d.error;
        this.sendCredit += d.bytes;
        this.wakeWriter?.();
        return undefined;
      }
      case FrameType.CLOSE: {
        const d = decodeClose(payload);
        if (!d.ok) return d.error;
        this.remoteEnded = true;
        this.remoteError = d.error;
        this.failWriter(d.error ?? new GuestError("guest_error", "tunnel closed by the guest side"));
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
      const n = Math.min(this.sendCredit, TUNNEL_CHUNK, buf.length - off);
      this.sendCredit -= n;
      const ok = this.link.send(FrameType.DATA, buf.subarray(off, off + n));
      this.bytesOut += n;
      off += n;
      if (!ok) await this.link.drained();
    }
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
