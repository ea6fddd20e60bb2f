/**
 * What the host has written towards one guest and the guest has not read yet: the socket's own
 * buffer plus small frames packed here while it is congested. The guest decides how fast this
 * drains, so it is bounded twice: in bytes (MAX_QUEUED_TO_GUEST) and in time (SEND_STALL_MS with
 * nothing taken); crossing either calls `onStuck` and the channel ends.
 *
 * Large frames (requests, STDIN, tunnel DATA) are not queued here: their writers wait for
 * `congested()` to clear (`drained()`), so a guest that reads slowly slows them down. Small
 * control frames (CREDIT, CLOSE, CANCEL) answer the guest's own traffic and are never made to
 * wait; while the socket is congested they are copied into 64 KiB chunks and go out in one write
 * when it drains. A queue of 12-byte writes would cost the host ~150 bytes of bookkeeping per
 * frame (measured: 4 MiB of CANCEL frames held ~50 MiB of RSS as separate writes), so packing is
 * what makes the byte bound a memory bound.
 */
import type { Socket } from "node:net";
import { encodeFrame, encodeHeader, GuestError } from "./codec.ts";

/**
 * Bytes queued towards the guest. Large frames wait until the socket drained below its
 * high-water mark (64 KiB) before they are written, so a guest that reads holds at most 64 KiB +
 * one 1 MiB frame here, plus control frames that answer its own traffic. 4 MiB is only reached by
 * a guest that keeps sending and never reads.
 */
export const MAX_QUEUED_TO_GUEST = 4 * 1024 * 1024;
/**
 * How long bytes may wait towards the guest with none of them taken. The guest agent reads its
 * port continuously (a 1 MiB frame drains in milliseconds, under a second on a loaded TCG host),
 * and the longest legitimate stop is a fork's stop-and-copy (~1 s); a minute with no progress
 * is a guest that stopped reading. Writers wait (back-pressure) meanwhile; then the channel fails.
 */
export const SEND_STALL_MS = 60_000;
/** Size of the chunks small frames are packed into while the socket is congested. */
const PACK_CHUNK = 64 * 1024;

export class Outbox {
  private readonly packed: Buffer[] = [];
  private packedTailUsed = 0;
  private packedBytes = 0;
  private stallTimer: ReturnType<typeof setTimeout> | undefined;
  private stallQueued = 0;
  private drainWait: Promise<void> | undefined;
  private closed = false;

  constructor(
    private readonly socket: Socket,
    private readonly stallMs: number,
    private readonly onStuck: (err: GuestError) => void,
  ) {
    socket.on("drain", () => this.onDrain());
  }

  /** Bytes written and not yet taken by the guest (socket buffer + packed frames). */
  get queuedBytes(): number {
    return this.socket.writableLength + this.packedBytes;
  }

  /** True while bytes wait above the socket's high-water mark: large frames should wait. */
  congested(): boolean {
    return !this.closed && !this.socket.destroyed && (this.socket.writableNeedDrain || this.packedBytes > 0);
  }

  /**
   * Encodes and queues one frame (`write`). With `uncopied`, a payload its caller never changes
   * afterwards (a file's bytes from an upload body) is written after its header as it is, not
   * copied into a frame buffer (a 100 MB upload made 100 MB of such copies), unless it has to wait.
   */
  send(type: number, stream: number, payload?: Uint8Array, uncopied = false): boolean {
    if (uncopied && payload) return this.write(encodeHeader(type, stream, payload.length), payload);
    return this.write(encodeFrame(type, stream, payload));
  }

  /**
   * Queues one encoded frame, or a header and its `payload`. False when it had to wait
   * (congested) or the bound was crossed; in the latter case `onStuck` has ended the channel
   * before this returns.
   */
  write(frame: Buffer, payload?: Uint8Array): boolean {
    if (this.closed) return false;
    const queued = this.queuedBytes;
    const length = frame.length + (payload?.length ?? 0);
    if (queued + length > MAX_QUEUED_TO_GUEST) {
      this.onStuck(
        stuck(
          `the guest stopped reading its port (${queued} bytes queued towards it, bound ${MAX_QUEUED_TO_GUEST})`,
        ),
      );
      return false;
    }
    if (this.congested()) {
      this.pack(frame);
      if (payload) this.pack(payload);
      this.armStall();
      return false;
    }
    let ok = this.socket.write(frame);
    // Straight after its header, in the same turn: nothing else is written between them.
    if (payload) ok = this.socket.write(payload) && ok;
    if (!ok) this.armStall();
    return ok;
  }

  /**
   * One shared wait for the socket to drain: many tunnels, stdin pumps and requests may wait at
   * once. Waiters resume in order and each checks `congested()` again right before it writes, so
   * at most one large frame is written past the high-water mark. Bounded by the stall deadline:
   * the channel ends (the socket closes) when nothing drains.
   */
  drained(): Promise<void> {
    if (!this.congested()) return Promise.resolve();
    this.drainWait ??= new Promise<void>((resolve) => {
      const done = () => {
        this.socket.off("drain", done);
        this.socket.off("close", done);
        this.drainWait = undefined;
        resolve();
      };
      this.socket.on("drain", done);
      this.socket.once("close", done);
    });
    return this.drainWait;
  }

  /** The channel ended: timers stop, packed frames are dropped. */
  close(): void {
    this.closed = true;
    this.clearStall();
    this.packed.length = 0;
    this.packedBytes = 0;
  }

  private pack(frame: Uint8Array): void {
    let off = 0;
    while (off < frame.length) {
      let tail = this.packed[this.packed.length - 1];
      if (!tail || this.packedTailUsed === tail.length) {
        tail = Buffer.allocUnsafe(Math.max(PACK_CHUNK, frame.length - off));
        this.packed.push(tail);
        this.packedTailUsed = 0;
      }
      const n = Math.min(frame.length - off, tail.length - this.packedTailUsed);
      // A frame that fits whole is copied without a view: a flood of small control frames
      // would otherwise make one garbage view object per frame (~100 MiB for 350,000 of them).
      if (off === 0 && n === frame.length) tail.set(frame, this.packedTailUsed);
      else tail.set(frame.subarray(off, off + n), this.packedTailUsed);
      this.packedTailUsed += n;
      off += n;
    }
    this.packedBytes += frame.length;
  }

  /** The socket drained: packed frames go first, in one write per chunk, before any waiter. */
  private onDrain(): void {
    this.clearStall();
    if (this.closed || this.packed.length === 0) return;
    const chunks = this.packed.splice(0);
    const last = chunks.length - 1;
    let ok = true;
    for (const [i, c] of chunks.entries())
      ok = this.socket.write(i === last ? c.subarray(0, this.packedTailUsed) : c);
    this.packedBytes = 0;
    this.packedTailUsed = 0;
    if (!ok) this.armStall();
  }

  private armStall(): void {
    if (this.stallTimer || this.closed) return;
    this.stallQueued = this.queuedBytes;
    this.stallTimer = setTimeout(() => this.checkStall(), this.stallMs);
    this.stallTimer.unref?.();
  }

  private checkStall(): void {
    this.stallTimer = undefined;
    if (this.closed || !this.congested()) return;
    const queued = this.queuedBytes;
    if (queued < this.stallQueued) {
      this.armStall(); // slow, but moving
      return;
    }
    this.onStuck(
      stuck(
        `the guest stopped reading its port (${queued} bytes queued towards it, none taken in ${this.stallMs} ms)`,
      ),
    );
  }

  private clearStall(): void {
    if (this.stallTimer) clearTimeout(this.stallTimer);
    this.stallTimer = undefined;
  }
}

function stuck(message: string): GuestError {
  return new GuestError("protocol_error", message, { details: { reason: "unread_port" } });
}
