/**
 * The agent's side of `GET /v1/vms/{id}/tunnel?port=N` once upgraded (docs/agent-api.md
 * "Tunnels"): WebSocket binary messages <-> the guest tunnel's byte streams, with back-pressure
 * both ways so that the agent buffers a bounded amount whatever either end does:
 * - guest -> client: the next chunk is read from the tunnel only after Bun accepted the previous
 *   one without back-pressure (else after its `drain`); an unread tunnel returns no credit, so
 *   the guest stops reading its socket.
 * - client -> guest: while a write into the tunnel waits (for guest credit), the socket is
 *   paused (`ws.pause()`: TCP back-pressure on the client) and resumed when the write is done.
 * The WebSocket ends with 1000 when the tunnel ends cleanly, 1011 with the reason when it fails
 * (the VM was destroyed, the guest connection dropped), and the tunnel is closed when the
 * client goes away.
 */
import type { ServerWebSocket, WebSocketHandler } from "bun";
import type { Tunnel } from "../../contracts/agent/api.ts";
import { parsePtyResize } from "../../contracts/api/common.ts";
import { settled } from "../../contracts/best-effort.ts";
import { describeError } from "../../contracts/errors.ts";

export interface TunnelSocketData {
  kind: "tunnel";
  /** A GuestTunnel (agent/guest/tunnel.ts) in the agent; any byte duplex in tests. */
  tunnel: Tunnel;
  /** PTY tunnels: text messages `{"type":"resize",...}` call this; other tunnels refuse text. */
  resize?: (cols: number, rows: number) => void;
  writer?: WritableStreamDefaultWriter<Uint8Array>;
  /** Resolves the pump's wait for Bun's `drain` (or the socket's close). */
  drained?: () => void;
  closed?: boolean;
}

/**
 * Largest message a client may send: 1 MiB. Our client sends at most 64 KiB per message; the
 * cap only keeps a misbehaving client from making Bun buffer 16 MB messages (its default).
 */
export const TUNNEL_MAX_MESSAGE = 1 << 20;

/**
 * After the client closed, how long its last bytes may take to get into the guest socket before
 * the tunnel is closed anyway: 10 s, a loaded TCG guest draining one window many times over.
 */
const CLOSE_FLUSH_MS = 10_000;

/** Close reasons are limited to 123 bytes by RFC 6455. */
function reason(text: string): string {
  const b = Buffer.from(text);
  return b.length <= 123 ? text : `${b.subarray(0, 120).toString()}...`;
}

async function pumpToClient(ws: ServerWebSocket<TunnelSocketData>): Promise<void> {
  const reader = ws.data.tunnel.readable.getReader();
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      if (ws.data.closed) return;
      const status = ws.send(value);
      if (status === 0) return; // dropped: the socket is closed
      if (status === -1) {
        // Queued, but the client is slow: wait for Bun's drain before reading more.
        await new Promise<void>((resolve) => {
          ws.data.drained = resolve;
        });
        ws.data.drained = undefined;
      }
    }
    if (!ws.data.closed) ws.close(1000, "tunnel closed");
  } catch (err) {
    if (!ws.data.closed) ws.close(1011, reason(describeError(err)));
  }
}

export const tunnelWebSocket: WebSocketHandler<TunnelSocketData> = {
  maxPayloadLength: TUNNEL_MAX_MESSAGE,
  open(ws) {
    ws.data.writer = ws.data.tunnel.writable.getWriter();
    void pumpToClient(ws);
  },
  message(ws, msg) {
    if (typeof msg === "string") {
      const r = ws.data.resize ? parsePtyResize(msg) : undefined;
      if (r) ws.data.resize!(r.cols, r.rows);
      else ws.close(1003, ws.data.resize ? "a text message must be a resize" : "tunnel messages are binary");
      return;
    }
    const w = ws.data.writer;
    if (!w) return;
    // A failed write means the tunnel ended; the pump closes the socket with the reason.
    void settled(w.write(msg));
    if ((w.desiredSize ?? 1) <= 0 && !ws.isPaused) {
      ws.pause();
      w.ready.then(
        () => ws.resume(),
        () => ws.resume(),
      );
    }
  },
  drain(ws) {
    ws.data.drained?.();
  },
  close(ws) {
    ws.data.closed = true;
    ws.data.drained?.();
    const { tunnel, writer } = ws.data;
    if (!writer) {
      tunnel.close();
      return;
    }
    // What the client sent before closing still goes in: the writer's close waits for the
    // queued writes (which wait for guest credit), then closes the tunnel. A guest that never
    // reads must not keep it open: CLOSE_FLUSH_MS bounds the wait.
    const timer = setTimeout(() => tunnel.close(), CLOSE_FLUSH_MS);
    writer.close().then(
      () => clearTimeout(timer),
      () => {
        clearTimeout(timer);
        tunnel.close();
      },
    );
  },
};
