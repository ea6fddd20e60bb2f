/**
 * The streams of a dial-out connection (docs/regions.md "BYOC agents: who dials whom"): one
 * connection, opened by the agent, carries any number of byte streams, each a TCP connection the
 * gateway made to its end of the link (its local listener for that agent) bridged to one the
 * agent makes to its own API. Everything the gateway says to an agent (calls, event streams,
 * streamed execs, terminals, tunnels) is plain HTTP and WebSocket over those streams, so nothing
 * above the transport knows which kind of agent it speaks to.
 *
 * A frame is `[type u8][stream u32 BE][payload]`, one per (sealed) message. Flow control is per
 * stream, by credit: each end may have at most `DIAL_STREAM_WINDOW` bytes of a stream unconfirmed
 * by the other; a receiver confirms what its socket has written, so a slow reader (a client that
 * does not read a download) stops its own stream's sender and no other stream, and neither end
 * holds more than a window per stream. Sockets on both ends are half-open (`allowHalfOpen`): END
 * ends one direction, and a stream is done when both have ended. A peer that sends past the window, names a stream twice or
 * sends a frame that does not parse breaks the protocol: the connection ends.
 */
import type { Socket } from "node:net";

export const DialFrame = { Open: 1, Data: 2, End: 3, Reset: 4, Credit: 5, Ping: 6 } as const;
export type DialFrameType = (typeof DialFrame)[keyof typeof DialFrame];

const HEADER_BYTES = 5;
/** Largest DATA payload: 64 KiB, as the agent's own guest frames. */
export const DIAL_CHUNK_BYTES = 64 * 1024;
/** Bytes of one stream either end may have in flight unconfirmed: 256 KiB. */
export const DIAL_STREAM_WINDOW = 256 * 1024;
/**
 * Streams one connection carries at once: a gateway holds one per call, event stream, exec,
 * terminal or tunnel in flight to that agent; 256 of them is 64 MiB of windows at most.
 */
export const DIAL_MAX_STREAMS = 256;

export function encodeDialFrame(type: DialFrameType, stream: number, payload?: Uint8Array): Buffer {
  const b = Buffer.allocUnsafe(HEADER_BYTES + (payload?.length ?? 0));
  b.writeUInt8(type, 0);
  b.writeUInt32BE(stream, 1);
  if (payload) b.set(payload, HEADER_BYTES);
  return b;
}

interface Stream {
  socket: Socket;
  /** Bytes we may still send before the peer confirms more. */
  credit: number;
  /** Read from our socket, waiting for credit. */
  pending: Buffer[];
  /** Received and not yet written out by our socket (and so not yet confirmed). */
  unconfirmed: number;
  /** Our socket ended: END goes once `pending` is sent. */
  localEnded: boolean;
  endSent: boolean;
  remoteEnded: boolean;
  socketClosed: boolean;
}

export interface DialMuxOptions {
  /** Sends one frame to the peer (the caller seals it and writes it to the connection). */
  send(frame: Buffer): void;
  /** The peer broke the protocol: the caller ends the connection (and calls closeAll). */
  fail(reason: string): void;
  /** Agent side: the socket a stream the gateway opened is bridged to (its own API). */
  accept?: (stream: number) => Socket;
}

export class DialMux {
  private readonly streams = new Map<number, Stream>();
  private nextId = 1;
  private closed = false;

  constructor(private readonly o: DialMuxOptions) {}

  get size(): number {
    return this.streams.size;
  }

  /** Gateway side: `socket` (a connection to the local listener) becomes a new stream. */
  open(socket: Socket): void {
    if (this.closed || this.streams.size >= DIAL_MAX_STREAMS) {
      socket.destroy();
      return;
    }
    const id = this.nextId++;
    this.o.send(encodeDialFrame(DialFrame.Open, id));
    this.bridge(id, socket);
  }

  /** One frame from the peer, already opened (decrypted); a broken one ends the connection. */
  receive(frame: Uint8Array): void {
    if (this.closed) return;
    const broken = this.handle(frame);
    if (broken !== undefined) this.o.fail(broken);
  }

  /** What the frame breaks (the reason), or undefined. */
  private handle(frame: Uint8Array): string | undefined {
    if (frame.length < HEADER_BYTES) return "a dial frame shorter than its header";
    const b = Buffer.from(frame.buffer, frame.byteOffset, frame.byteLength);
    const type = b.readUInt8(0);
    const id = b.readUInt32BE(1);
    const payload = b.subarray(HEADER_BYTES);
    const s = this.streams.get(id);
    switch (type) {
      case DialFrame.Open:
        return this.accepted(id);
      case DialFrame.Data:
        // A stream this end already reset may still have frames in flight: dropped.
        if (!s) return undefined;
        if (payload.length > DIAL_CHUNK_BYTES || s.unconfirmed + payload.length > DIAL_STREAM_WINDOW)
          return `stream ${id}: data past its window`;
        s.unconfirmed += payload.length;
        s.socket.write(payload, () => this.confirm(id, payload.length));
        return undefined;
      case DialFrame.Credit: {
        if (!s) return undefined;
        if (payload.length !== 4) return "a credit frame of the wrong size";
        s.credit += payload.readUInt32BE(0);
        if (s.credit > DIAL_STREAM_WINDOW) return `stream ${id}: credit past its window`;
        this.flush(id, s);
        return undefined;
      }
      case DialFrame.End:
        if (!s) return undefined;
        s.remoteEnded = true;
        s.socket.end();
        return undefined;
      case DialFrame.Reset:
        if (!s) return undefined;
        this.streams.delete(id);
        s.socket.destroy();
        return undefined;
      case DialFrame.Ping:
        return undefined;
      default:
        return `unknown dial frame type ${type}`;
    }
  }

  /** The connection ended: every stream's socket goes. */
  closeAll(): void {
    this.closed = true;
    for (const s of this.streams.values()) s.socket.destroy();
    this.streams.clear();
  }

  private accepted(id: number): string | undefined {
    if (!this.o.accept) return "only the gateway opens dial streams";
    if (this.streams.has(id) || id === 0) return `stream ${id} opened twice`;
    if (this.streams.size >= DIAL_MAX_STREAMS) this.o.send(encodeDialFrame(DialFrame.Reset, id));
    else this.bridge(id, this.o.accept(id));
    return undefined;
  }

  private bridge(id: number, socket: Socket): void {
    const s: Stream = {
      socket,
      credit: DIAL_STREAM_WINDOW,
      pending: [],
      unconfirmed: 0,
      localEnded: false,
      endSent: false,
      remoteEnded: false,
      socketClosed: false,
    };
    this.streams.set(id, s);
    socket.on("data", (chunk: Buffer) => {
      s.pending.push(chunk);
      this.flush(id, s);
    });
    socket.on("end", () => {
      s.localEnded = true;
      this.flush(id, s);
    });
    socket.on("error", () => {}); // its close follows, which resets the stream
    socket.on("close", () => {
      if (this.streams.get(id) !== s) return;
      s.socketClosed = true;
      // Closed after both directions ended: what it read may still wait for credit, and goes
      // (then END) as credit comes. Else (an error, a reset) the peer's socket must go too.
      if (s.localEnded && s.remoteEnded) return this.finish(id, s);
      this.streams.delete(id);
      if (!this.closed) this.o.send(encodeDialFrame(DialFrame.Reset, id));
    });
  }

  /** Forgets a stream whose socket closed cleanly once all it read and its END are sent. */
  private finish(id: number, s: Stream): void {
    if (s.socketClosed && s.endSent && this.streams.get(id) === s) this.streams.delete(id);
  }

  /** Sends what the credit allows; pauses the socket while data waits for credit. */
  private flush(id: number, s: Stream): void {
    while (s.pending.length > 0 && s.credit > 0) {
      const head = s.pending[0] as Buffer;
      const n = Math.min(head.length, s.credit, DIAL_CHUNK_BYTES);
      this.o.send(encodeDialFrame(DialFrame.Data, id, head.subarray(0, n)));
      s.credit -= n;
      if (n === head.length) s.pending.shift();
      else s.pending[0] = head.subarray(n);
    }
    if (s.pending.length > 0) s.socket.pause();
    else {
      s.socket.resume();
      if (s.localEnded && !s.endSent) {
        s.endSent = true;
        this.o.send(encodeDialFrame(DialFrame.End, id));
      }
      this.finish(id, s);
    }
  }

  private confirm(id: number, bytes: number): void {
    const s = this.streams.get(id);
    if (!s || this.closed) return;
    s.unconfirmed -= bytes;
    const p = Buffer.allocUnsafe(4);
    p.writeUInt32BE(bytes, 0);
    this.o.send(encodeDialFrame(DialFrame.Credit, id, p));
  }
}
