/**
 * One dial-out link once both nonces are known, the same at both ends (the agent's
 * agent/api/dial.ts, the gateway's gateway/agents/dial-hub.ts): every frame sealed on its way out
 * and opened on its way in (dial-cipher.ts), the streams (dial-mux.ts), and the liveness pings.
 * Each end keeps only what differs: who opens the connection, who greets, what it does with the
 * streams, and how it ends its WebSocket.
 */
import type { Socket } from "node:net";
import { describeError } from "../errors.ts";
import { DIAL_IDLE_MS, DIAL_MESSAGE_MAX, DIAL_PING_MS } from "./dial.ts";
import { DialCipher, type DialSide } from "./dial-cipher.ts";
import { DialFrame, DialMux, encodeDialFrame } from "./dial-mux.ts";

/** Why a session ends its link: the peer broke the protocol (1008), or went silent. */
export type DialEnd = { kind: "protocol" | "silent"; reason: string };

export interface DialSession {
  /** One message from the peer (a string is a text message: a protocol break). */
  receive(data: Uint8Array | string): void;
  /** The gateway's end: a connection to its listener for this link becomes a stream. */
  open(socket: Socket): void;
  streams(): number;
  /** Stops the pings and ends every stream (the link is gone). */
  close(): void;
}

export function startDialSession(o: {
  key: Uint8Array;
  agentNonce: Uint8Array;
  gatewayNonce: Uint8Array;
  side: DialSide;
  /** Writes one sealed message to the link. */
  write(message: Buffer): void;
  /** Ends the link (the caller closes its WebSocket, and then calls `close`). */
  end(why: DialEnd): void;
  /** The agent's end: the socket a stream the gateway opened is bridged to. */
  accept?: (stream: number) => Socket;
}): DialSession {
  const cipher = new DialCipher(o.key, o.agentNonce, o.gatewayNonce, o.side);
  const send = (frame: Buffer) => o.write(cipher.seal(frame));
  const protocol = (reason: string) => o.end({ kind: "protocol", reason: `protocol: ${reason}` });
  const mux = new DialMux({ send, fail: protocol, ...(o.accept ? { accept: o.accept } : {}) });
  let lastHeard = Date.now();
  const ping = setInterval(() => {
    if (Date.now() - lastHeard > DIAL_IDLE_MS)
      o.end({ kind: "silent", reason: `silent for ${DIAL_IDLE_MS / 1000} s` });
    else send(encodeDialFrame(DialFrame.Ping, 0));
  }, DIAL_PING_MS);
  return {
    receive(data) {
      lastHeard = Date.now();
      if (typeof data === "string") return protocol("a text message");
      // The runtime bounds messages only where it can per socket (the gateway's runtime/types.ts).
      if (data.length > DIAL_MESSAGE_MAX) return protocol(`a message over ${DIAL_MESSAGE_MAX} bytes`);
      try {
        mux.receive(cipher.open(data));
      } catch (err) {
        protocol(describeError(err));
      }
    },
    open: (socket) => mux.open(socket),
    streams: () => mux.size,
    close() {
      clearInterval(ping);
      mux.closeAll();
    },
  };
}
