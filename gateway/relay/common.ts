/**
 * What the tcp and cdp relays share: WebSocket close codes, back-pressure thresholds (reasons in
 * docs/connect.md "Connect relays (`gateway/relay/`)") and the socket-side bookkeeping.
 */
import { Buffer } from "node:buffer";
import type { ServerSocket, SocketHandler } from "../runtime/types.ts";
import type { OpenRelay } from "./registry.ts";

/** WebSocket close codes a relay ends with (RFC 6455 7.4.1). */
export const CLOSE = {
  /** The guest ended the connection. */
  normal: 1000,
  /** The sandbox was deleted or reaped; the gateway is stopping. */
  goingAway: 1001,
  /**
   * The client sent faster than the guest reads, past what the gateway will hold; or the key that
   * opened the relay was revoked (auth/key-connections.ts `KEY_REVOKED_CLOSE`).
   */
  policy: 1008,
  /** A message over the relay's size limit (either way). */
  tooBig: 1009,
  /** The tunnel or the guest side failed; the reason says how. */
  error: 1011,
} as const;

/** The code a runtime reports for a close frame without a code (RFC 6455 7.1.5). */
const CLOSE_NO_STATUS = 1005;
/** How long a graceful end waits for data already sent to reach the guest, ms. */
export const FLUSH_TIMEOUT_MS = 5_000;

/**
 * Back-pressure: stop reading from one side while more than `HIGH_WATER_BYTES` wait to be
 * written to the other, and read again below `LOW_WATER_BYTES`. 1 MiB is ~10 ms of a 100 MB/s
 * stream: enough to keep the pipe full, little memory per relay.
 */
export const HIGH_WATER_BYTES = 1024 * 1024;
export const LOW_WATER_BYTES = 256 * 1024;
/**
 * What a relay holds for the guest at most before closing with 1008: the high-water mark plus
 * `maxMessage` and the few messages a paused socket may still deliver (Bun and Node stop reading
 * at once, what they had parsed still arrives). Every runtime adapter can pause its client
 * (runtime/), so only a runtime that could not would let a fast client reach it.
 */
export function maxHeldBytes(maxMessage: number): number {
  return HIGH_WATER_BYTES + 4 * maxMessage;
}
/**
 * The send queue is also polled this often, ms: a drain event is only a wake-up, and a runtime
 * that missed one (or an adapter without them) must not leave a relay waiting for ever.
 */
export const DRAIN_POLL_MS = 20;
/** A handler whose WebSocket has not opened this long after the upgrade gives up its tunnel. */
export const OPEN_TIMEOUT_MS = 10_000;

/** A close reason fits the 123 bytes a close frame allows. */
export function closeReason(reason: string): string {
  const bytes = new TextEncoder().encode(reason);
  if (bytes.length <= 123) return reason;
  return `${new TextDecoder().decode(bytes.subarray(0, 120)).replace(/\uFFFD$/, "")}...`;
}

export function errorText(err: unknown): string {
  return err instanceof Error ? err.message : String(err);
}

/** Resolves once `amount()` is at most `low`, woken by `kick()` (drain events) or by polling. */
export class LowWater {
  private waiters: Array<() => void> = [];
  private timer: ReturnType<typeof setInterval> | undefined;

  constructor(
    private readonly amount: () => number,
    private readonly low = LOW_WATER_BYTES,
  ) {}

  wait(): Promise<void> {
    if (this.amount() <= this.low) return Promise.resolve();
    return new Promise((resolve) => {
      this.waiters.push(resolve);
      this.timer ??= setInterval(() => this.kick(), DRAIN_POLL_MS);
    });
  }

  kick(): void {
    if (this.waiters.length === 0 || this.amount() > this.low) return;
    this.release();
  }

  /** Wakes every waiter regardless of the amount (the relay is ending). */
  release(): void {
    clearInterval(this.timer);
    this.timer = undefined;
    const w = this.waiters;
    this.waiters = [];
    for (const resolve of w) resolve();
  }
}

/**
 * The client side of a relay: holds the socket once open, closes it once, and runs `onEnd`
 * exactly once whoever ends first (client, guest, deletion, error). Subclasses move the data.
 */
export abstract class RelayBase implements SocketHandler, OpenRelay {
  abstract readonly maxMessageBytes: number;
  protected socket: ServerSocket | undefined;
  protected ended = false;
  private pending: { code: number; reason: string } | undefined;
  private readonly openTimer: ReturnType<typeof setTimeout>;
  protected readonly drained: LowWater;
  private unregister: () => void = () => {};

  constructor() {
    this.drained = new LowWater(() => this.socket?.bufferedAmount() ?? 0);
    // The runtime may never call open (a handshake that fails after the upgrade was accepted).
    this.openTimer = setTimeout(() => {
      if (!this.socket) this.close(CLOSE.error, "the WebSocket did not open");
    }, OPEN_TIMEOUT_MS);
  }

  /** Called by the route with the registry removal once the relay is registered. */
  registered(unregister: () => void): void {
    this.unregister = unregister;
    if (this.ended) unregister();
  }

  /** Starts moving data; the socket is open. */
  protected abstract start(): void;
  /**
   * Releases the guest side (tunnels, upstream WebSocket). Called once. `graceful`: the relay
   * ended normally (a client's 1000/1005 close, the guest's end), so what the client already sent
   * should still reach the guest.
   */
  protected abstract teardown(graceful: boolean): void;

  open(socket: ServerSocket): void {
    clearTimeout(this.openTimer);
    this.socket = socket;
    if (this.pending) {
      // Closed before the client got here (sandbox deleted, guest failed during the upgrade).
      socket.close(this.pending.code, closeReason(this.pending.reason));
      return;
    }
    this.start();
  }

  abstract message(data: Uint8Array | string): void;

  /**
   * Ends this relay (only this one) with 1009 when a message is over the limit. A string is
   * measured as its UTF-8 size, counted without encoding it.
   */
  protected tooBig(data: Uint8Array | string, limit = this.maxMessageBytes): boolean {
    const size = typeof data === "string" ? Buffer.byteLength(data, "utf8") : data.byteLength;
    if (size <= limit) return false;
    this.end(CLOSE.tooBig, `message of ${size} bytes is over the relay's ${limit}`);
    return true;
  }

  drain(): void {
    this.drained.kick();
  }

  /** The client's WebSocket is gone (runtime), or the registry ends the relay. */
  close(code: number, reason: string): void {
    this.end(code, reason);
  }

  /** Ends the relay from any side: closes the client socket (if still open) and the guest side. */
  protected end(code: number, reason: string): void {
    if (this.ended) return;
    this.ended = true;
    clearTimeout(this.openTimer);
    this.drained.release();
    this.unregister();
    try {
      this.teardown(code === CLOSE.normal || code === CLOSE_NO_STATUS);
    } catch {
      // best effort: the guest side is being dropped anyway
    }
    if (this.socket) {
      try {
        this.socket.close(code, closeReason(reason));
      } catch {
        // already closed by the client
      }
    } else {
      this.pending = { code, reason };
    }
  }
}
