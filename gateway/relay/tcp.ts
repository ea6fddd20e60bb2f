/**
 * `protocol=tcp` (docs/sandboxes.md "Rules of the sandboxes API"): a raw byte tunnel. Binary WebSocket messages from the client are
 * written to the tunnel as they are (a text message as its UTF-8 bytes); bytes from the tunnel go
 * to the client as binary messages, one per chunk read. Back-pressure both ways (common.ts): the
 * tunnel is not read while the client's send queue is above the high-water mark, and the client
 * is paused while more than that waits to be written to the tunnel. A client message over
 * `TCP_MESSAGE_BYTES` closes the relay with 1009. Either side ending ends the other; a tunnel
 * error closes the WebSocket with 1011 and the error as the reason.
 */
import type { Tunnel } from "../../contracts/agent/api.ts";
import { settled } from "../../contracts/best-effort.ts";
import { TCP_MESSAGE_BYTES } from "../runtime/ws-limits.ts";
import {
  CLOSE,
  errorText,
  FLUSH_TIMEOUT_MS,
  HIGH_WATER_BYTES,
  LowWater,
  maxHeldBytes,
  RelayBase,
} from "./common.ts";

const MAX_HELD_BYTES = maxHeldBytes(TCP_MESSAGE_BYTES);

export class TcpRelay extends RelayBase {
  readonly maxMessageBytes = TCP_MESSAGE_BYTES;
  private readonly writer: WritableStreamDefaultWriter<Uint8Array>;
  private reader: { cancel(): Promise<void> } | undefined;
  /** Bytes handed to the tunnel's writer and not yet taken by it. */
  private held = 0;
  private paused = false;
  private readonly written: LowWater;
  /** Bytes relayed each way, for logs and tests. */
  readonly bytes = { toGuest: 0, toClient: 0 };

  constructor(private readonly tunnel: Tunnel) {
    super();
    this.writer = tunnel.writable.getWriter();
    this.written = new LowWater(() => this.held);
  }

  protected start(): void {
    void this.pumpToClient();
  }

  private async pumpToClient(): Promise<void> {
    const reader = this.tunnel.readable.getReader();
    this.reader = reader;
    try {
      for (;;) {
        const { done, value } = await reader.read();
        if (this.ended) return;
        if (done) return this.end(CLOSE.normal, "the guest closed the connection");
        if (value.byteLength === 0) continue;
        this.bytes.toClient += value.byteLength;
        this.socket!.sendBinary(value);
        if (this.socket!.bufferedAmount() > HIGH_WATER_BYTES) await this.drained.wait();
      }
    } catch (err) {
      this.end(CLOSE.error, `tunnel: ${errorText(err)}`);
    }
  }

  message(data: Uint8Array | string): void {
    if (this.ended || this.tooBig(data)) return;
    const bytes = typeof data === "string" ? new TextEncoder().encode(data) : data;
    if (bytes.byteLength === 0) return;
    this.held += bytes.byteLength;
    this.bytes.toGuest += bytes.byteLength;
    this.writer.write(bytes).then(
      () => {
        this.held -= bytes.byteLength;
        this.written.kick();
      },
      (err) => this.end(CLOSE.error, `tunnel: ${errorText(err)}`),
    );
    if (this.held > MAX_HELD_BYTES) {
      this.end(CLOSE.policy, "the client sends faster than the guest reads");
      return;
    }
    if (!this.paused && this.held > HIGH_WATER_BYTES) {
      this.paused = true;
      this.socket!.pause();
      void this.written.wait().then(() => {
        this.paused = false;
        if (!this.ended) this.socket!.resume();
      });
    }
  }

  protected teardown(graceful: boolean): void {
    this.written.release();
    // Cancelling the reader and aborting the writer of a relay that is ending repeat its cause.
    void settled(this.reader?.cancel());
    if (!graceful) {
      void settled(this.writer.abort());
      this.tunnel.close();
      return;
    }
    // What the client sent before closing still goes to the guest (like a FIN after the data).
    const timer = setTimeout(() => this.tunnel.close(), FLUSH_TIMEOUT_MS);
    void settled(this.writer.close()).finally(() => {
      clearTimeout(timer);
      this.tunnel.close();
    });
  }
}
