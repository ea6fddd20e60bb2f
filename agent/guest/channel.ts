/**
 * Host side of the guest protocol (docs/guest-protocol.md): one `GuestChannel` per connection to
 * a guest agent's port. In production the port is QEMU's chardev unix socket (QEMU listens, we
 * connect: `GuestClient.connect`). In host-mode tests the agent connects to us instead
 * (`GuestListener.listen` + `accept`).
 *
 * Requests are multiplexed by stream id; every public method maps to one op. Every failure is a
 * `GuestError` with a stable `code` (see codec.ts). When the connection drops, every pending
 * request rejects at once with `guest_disconnected`: nothing ever waits on a dead socket.
 */
import type { Socket } from "node:net";
import { FrameType, GUEST_STREAM_BIT, Tag } from "../../contracts/guest-protocol.ts";
import { GUEST_TUNNEL_IDLE_MS, misbehaved, TunnelTable } from "./channel-tunnels.ts";
import type { GuestClientOptions, HelloInfo } from "./client-types.ts";
import { decodeTlv, FrameDecoder, GuestError, type TlvRecords, TlvWriter } from "./codec.ts";
import { Outbox, SEND_STALL_MS } from "./outbox.ts";
import { CLOSE_ANSWER_MS, type GuestTunnel } from "./tunnel.ts";

export { GUEST_TUNNEL_IDLE_MS, MAX_GUEST_TUNNELS } from "./channel-tunnels.ts";

// ---- bounds on what a guest can make the host hold -----------------------------------------
// The guest controls every byte it sends. Each queue it can fill has a bound below (and in
// channel-tunnels.ts for the tunnels it opens, in outbox.ts for the bytes waiting for it to
// read); overflowing one ends the channel with a `protocol_error` (`details.reason` names the
// bound) and the sandbox above fails with it: the host never grows without limit for one guest.

/**
 * Requests awaiting the guest's answer. The manager runs one exec at a time per sandbox (plus
 * its file writes), and a CONNECT waits at most 10 s in the guest, answered at once past the
 * guest's 128 tunnels; 1,024 unanswered requests is a guest sitting on them, not load.
 */
export const MAX_REQUESTS_IN_FLIGHT = 1024;

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

/**
 * The connection under a GuestClient: HELLO, requests multiplexed by stream id with their
 * timers, the tunnels on the channel, and the end of it all when the connection drops. The ops
 * themselves (exec, files, tunnels, PTYs) are GuestClient's (client.ts).
 */
export class GuestChannel {
  private readonly decoder = new FrameDecoder();
  protected readonly pending = new Map<number, Pending>();
  /** Open tunnels by stream id, and those the guest opened (channel-tunnels.ts). */
  private readonly tunnels: TunnelTable;
  private nextStream = 1;
  private helloWaiter: { promise: Promise<HelloInfo>; resolve: (h: HelloInfo) => void } | undefined;
  protected closedWith: GuestError | undefined;
  private lastSocketError: Error | undefined;
  private readonly closeListeners: Array<(err: GuestError) => void> = [];
  protected readonly opts: Required<Omit<GuestClientOptions, "onLog">> & Pick<GuestClientOptions, "onLog">;
  /** What waits for the guest to read it (bounded in bytes and time). */
  protected readonly outbox: Outbox;
  /** Outstanding `pauseReading` calls. */
  private pauses = 0;

  protected constructor(
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
    this.tunnels = new TunnelTable({
      send: (type, stream, payload) => this.send(type, stream, payload),
      outbox: this.outbox,
      fail: (err) => this.fail(err),
      closeAnswerMs: this.opts.closeAnswerMs,
      guestTunnelIdleMs: this.opts.guestTunnelIdleMs,
    });
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
      tunnels: this.tunnels.byStream.size,
      guestTunnels: this.tunnels.guestTunnels,
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
    this.tunnels.endAll(
      (t) => new GuestError("guest_disconnected", `tunnel ${t.stream} ended by a new HELLO`),
    );
    let resolveFn!: (h: HelloInfo) => void;
    let rejectFn!: (e: GuestError) => void;
    const promise = new Promise<HelloInfo>((resolve, reject) => {
      resolveFn = resolve;
      rejectFn = reject;
    });
    const timer = setTimeout(() => {
      this.helloWaiter = undefined;
      this.closeListenersRemove(onClose);
      rejectFn(new GuestError("guest_timeout", `no HELLO answer within ${Math.round(timeoutMs)} ms`));
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

  /**
   * Who takes the tunnels the guest opens (OPEN frames: connections to the guest's egress proxy
   * port, docs "Egress"). Without a handler each one is closed at once, so the guest program
   * sees its connection end instead of waiting.
   */
  onIncomingTunnel(handler: ((t: GuestTunnel) => void) | undefined): void {
    this.tunnels.onIncoming(handler);
  }

  /**
   * A tunnel on `stream`, known to this client until the guest's CLOSE frees the id (or the
   * guest does not answer our CLOSE in time, tunnel.ts CLOSE_ANSWER_MS).
   */
  protected registerTunnel(stream: number, port: number): GuestTunnel {
    return this.tunnels.register(stream, port);
  }

  // -------------------------------------------------------------------------------------------

  protected async request(w: TlvWriter): Promise<TlvRecords> {
    return (await this.start(w, { timeoutMs: this.opts.requestTimeoutMs })).promise;
  }

  /**
   * Sends a REQUEST once the socket has room (back-pressure: a guest that reads slowly slows its
   * callers; one that stops reading fails the channel after SEND_STALL_MS) and registers it.
   */
  protected async start(
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

  protected armTimer(stream: number, ms: number, what: string): void {
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
      if (!this.pending.has(s) && !this.tunnels.byStream.has(s)) return s;
    }
  }

  /** `uncopied`: a payload its caller never changes afterwards (Outbox.send). */
  protected send(type: number, stream: number, payload?: Uint8Array, uncopied = false): boolean {
    if (!this.closedWith) {
      const ok = this.outbox.send(type, stream, payload, uncopied);
      if (!this.closedWith) return ok;
    }
    // Closed before, or by this write crossing the outbox's bound.
    throw new GuestError("guest_disconnected", "guest connection is closed", { cause: this.closedWith });
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
        this.tunnels.accept(stream, payload);
        return;
      case FrameType.DATA:
      case FrameType.CREDIT:
      case FrameType.CLOSE: {
        // Unknown stream: a tunnel we already finished (frames crossing our CLOSE): dropped.
        const err = this.tunnels.byStream.get(stream)?.onFrame(type, payload);
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
    this.tunnels.endAll(
      (t) => new GuestError("guest_disconnected", `guest disconnected (tunnel ${t.stream})`, { cause: err }),
    );
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
