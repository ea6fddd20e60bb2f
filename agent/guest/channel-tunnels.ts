/**
 * The tunnels on one guest channel (channel.ts): the table of open tunnels by stream id, the
 * tunnels the guest opens (OPEN frames: connections to its egress proxy port) with their bound,
 * and who takes them. The channel routes DATA, CREDIT and CLOSE here and ends every tunnel when
 * it ends.
 */
import { GUEST_STREAM_BIT, Tag } from "../../contracts/guest-protocol.ts";
import { decodeTlv, GuestError } from "./codec.ts";
import type { Outbox } from "./outbox.ts";
import { GuestTunnel } from "./tunnel.ts";

/**
 * Tunnels the guest opened (OPEN) that the host still holds. The guest agent never has more than
 * 128 tunnels at once (MAX_TUNNELS in guest/agent.h, docs/guest-protocol.md "What the host holds for a guest")
 * and the host drops its entry as soon as the guest's CLOSE arrives, in order, so an honest guest
 * never has more than 128 here; one more OPEN is a guest breaking its own rule. 128 also bounds
 * what its windows can hold on the host: 128 x TUNNEL_WINDOW = 32 MiB.
 */
export const MAX_GUEST_TUNNELS = 128;
/**
 * A tunnel the guest opened that carries no byte either way for this long is closed by the host.
 * Egress connections idle legitimately (pooled keep-alive connections, a quiet database
 * session), so the bound is a proxy's usual idle read timeout (squid's `read_timeout`, 15 min),
 * not a short one; the tunnel count above is what bounds memory meanwhile.
 */
export const GUEST_TUNNEL_IDLE_MS = 15 * 60_000;

/** What the tunnel table needs of its channel: its writes, its outbox, its end, its bounds. */
export interface TunnelTableHost {
  send(type: number, stream: number, payload?: Uint8Array): boolean;
  outbox: Pick<Outbox, "congested" | "drained">;
  /** Ends the channel (a guest breaking the protocol or a bound). */
  fail(err: GuestError): void;
  closeAnswerMs: number;
  guestTunnelIdleMs: number;
}

export class TunnelTable {
  /** Open tunnels by stream id (docs "Tunnels"); an id stays taken until the guest's CLOSE. */
  readonly byStream = new Map<number, GuestTunnel>();
  /** Tunnels in `byStream` that the guest opened (the MAX_GUEST_TUNNELS bound). */
  guestTunnels = 0;
  private incoming: ((t: GuestTunnel) => void) | undefined;

  constructor(private readonly h: TunnelTableHost) {}

  /**
   * Who takes the tunnels the guest opens (OPEN frames: connections to the guest's egress proxy
   * port, docs "Egress"). Without a handler each one is closed at once, so the guest program
   * sees its connection end instead of waiting.
   */
  onIncoming(handler: ((t: GuestTunnel) => void) | undefined): void {
    this.incoming = handler;
  }

  /**
   * A tunnel on `stream`, known to this client until the guest's CLOSE frees the id (or the
   * guest does not answer our CLOSE in time, tunnel.ts CLOSE_ANSWER_MS).
   */
  register(stream: number, port: number): GuestTunnel {
    const byGuest = (stream & GUEST_STREAM_BIT) !== 0;
    const tunnel: GuestTunnel = new GuestTunnel(
      stream,
      port,
      {
        send: (type, payload) => this.h.send(type, stream, payload),
        congested: () => this.h.outbox.congested(),
        drained: () => this.h.outbox.drained(),
        release: () => {
          if (this.byStream.get(stream) !== tunnel) return;
          this.byStream.delete(stream);
          if (byGuest) this.guestTunnels--;
        },
      },
      {
        closeAnswerMs: this.h.closeAnswerMs,
        ...(byGuest ? { idleMs: this.h.guestTunnelIdleMs } : {}),
      },
    );
    this.byStream.set(stream, tunnel);
    if (byGuest) this.guestTunnels++;
    return tunnel;
  }

  /** An OPEN from the guest: a tunnel for whoever takes them, or one more than its bound allows. */
  accept(stream: number, payload: Buffer): void {
    if ((stream & GUEST_STREAM_BIT) === 0 || this.byStream.has(stream)) {
      this.h.fail(
        new GuestError("protocol_error", `OPEN on stream ${stream}: not a free guest stream id`, {
          details: { reason: "open" },
        }),
      );
      return;
    }
    if (this.guestTunnels >= MAX_GUEST_TUNNELS) {
      this.h.fail(
        misbehaved(
          "too_many_tunnels",
          `too many open tunnels (the guest opened more than ${MAX_GUEST_TUNNELS})`,
        ),
      );
      return;
    }
    const d = decodeTlv(payload);
    const port = d.ok ? (d.records.u32(Tag.PORT) ?? 0) : 0;
    const tunnel = this.register(stream, port);
    tunnel.opened();
    if (this.incoming) this.incoming(tunnel);
    else tunnel.close();
  }

  /** Ends every tunnel with the error `err` gives it and forgets them all. */
  endAll(err: (t: GuestTunnel) => GuestError): void {
    for (const t of [...this.byStream.values()]) t.disconnected(err(t));
    this.byStream.clear();
    this.guestTunnels = 0;
  }
}

/** The channel error for a guest that broke a bound: `reason` names it (details.reason). */
export function misbehaved(reason: string, message: string): GuestError {
  return new GuestError("protocol_error", message, { details: { reason } });
}
