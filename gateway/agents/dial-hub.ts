/**
 * The gateway's end of agents' dial-out connections (docs/regions.md "BYOC agents: who dials
 * whom"). An agent that cannot be reached (behind NAT, a customer's firewall) is enrolled with the
 * URL `dial://<its id>` and opens `GET DIAL_PATH` as a WebSocket to each gateway of its region,
 * with a token of its own key (audience `sandboxd-gateway-dial`) and its greeting nonce; the
 * gateway answers with its nonce, and from then on every message is sealed (dial-cipher.ts) and
 * carries frames of the stream multiplexer (dial-mux.ts).
 *
 * For each linked agent the gateway listens on a loopback port of its own: each connection to
 * it becomes a stream that the agent bridges to its own API. The router's client for that agent
 * is the same HTTP and WebSocket client as for a direct agent, with `http://127.0.0.1:<port>` as
 * the base (every request still carries the agent's short-lived token), so calls, event streams,
 * execs, terminals and tunnels need nothing of their own. A gateway without a link to a dial-out
 * agent reaches it through a peer gateway that has one (dial-relay.ts); with neither, it does not
 * place on it and answers its calls `agent_unavailable`.
 */
import { createServer, type Server, type Socket } from "node:net";
import {
  DIAL_MESSAGE_MAX,
  DIAL_NONCE_HEADER,
  DIAL_URL_SCHEME,
  isDialUrl,
} from "../../contracts/agent/dial.ts";
import { DIAL_NONCE_BYTES, dialNonce } from "../../contracts/agent/dial-cipher.ts";
import { startDialSession } from "../../contracts/agent/dial-session.ts";
import { secretKey } from "../../contracts/agent/token.ts";
import type { Db } from "../../db/client.ts";
import type { ServerSocket, SocketHandler, Upgrade } from "../runtime/types.ts";
import { DialRelay, type RelayOptions } from "./dial-relay.ts";
import { jsonAnswer } from "./internal-http.ts";
import { authenticateAgentReport } from "./registry.ts";

interface Link {
  close(reason: string): void;
  port: number;
  streams(): number;
}

export class DialHub {
  private readonly links = new Map<string, Link>();
  /** Links of this gateway offered to its peers, and theirs borrowed (dial-relay.ts). */
  readonly relay: DialRelay | undefined;

  constructor(
    private readonly log: (line: string) => void = (l) => console.error(l),
    relay?: Omit<RelayOptions, "log">,
  ) {
    this.relay = relay ? new DialRelay({ ...relay, log }, (id) => this.localPort(id)) : undefined;
  }

  private localPort(agentId: string): number | undefined {
    const l = this.links.get(agentId);
    return l && l.port > 0 ? l.port : undefined;
  }

  /**
   * Where this gateway reaches dial-out agent `agentId`: its own link's loopback listener, else a
   * relay to the gateway that holds the agent's link; undefined when neither.
   */
  baseUrl(agentId: string): string | undefined {
    const port = this.localPort(agentId);
    return port !== undefined ? `http://127.0.0.1:${port}` : this.relay?.baseUrl(agentId);
  }

  linked(agentId: string): boolean {
    return this.baseUrl(agentId) !== undefined;
  }

  /** `GET DIAL_PATH` upgraded: the agent is checked (token, enrolled dial-out) before the upgrade. */
  async accept(
    db: Db,
    agentSecret: string,
    request: Request,
    upgrade: Upgrade | undefined,
  ): Promise<Response> {
    const auth = await authenticateAgentReport(db, agentSecret, request, "dial", "dial");
    if (!auth.ok) return auth.answer;
    const agent = auth.agent;
    if (!isDialUrl(agent.url))
      return jsonAnswer(403, {
        code: "forbidden",
        message: `agent ${agent.id} is enrolled at ${agent.url}: only an agent enrolled to dial out (${DIAL_URL_SCHEME}//) opens a link`,
      });
    const nonce = Buffer.from(request.headers.get(DIAL_NONCE_HEADER) ?? "", "hex");
    if (nonce.length !== DIAL_NONCE_BYTES)
      return jsonAnswer(400, {
        code: "bad_request",
        message: `${DIAL_NONCE_HEADER}: ${DIAL_NONCE_BYTES} bytes in hex`,
      });
    if (!upgrade) return jsonAnswer(400, { code: "bad_request", message: "a dial link is a WebSocket" });
    return upgrade(this.handler(agent.id, secretKey(auth.key), nonce));
  }

  /** Closes every link and relay (the gateway stops). */
  stop(): void {
    this.relay?.stop();
    for (const l of [...this.links.values()]) l.close("gateway stopping");
  }

  private handler(agentId: string, key: Uint8Array, agentNonce: Uint8Array): SocketHandler {
    const gatewayNonce = dialNonce();
    let ws: ServerSocket | undefined;
    let server: Server | undefined;
    let ended = false;
    const session = startDialSession({
      key,
      agentNonce,
      gatewayNonce,
      side: "gateway",
      write: (message) => ws?.sendBinary(message),
      end: (why) => link.close(why.reason),
    });
    const link: Link = {
      port: 0,
      streams: () => session.streams(),
      close: (reason) => {
        if (ended) return;
        ended = true;
        if (this.links.get(agentId) === link) {
          this.links.delete(agentId);
          this.relay?.unpublish(agentId);
        }
        session.close();
        server?.close();
        ws?.close(reason.startsWith("protocol") ? 1008 : 1001, reason.slice(0, 120));
        this.log(`agent ${agentId}: dial link closed (${reason})`);
      },
    };
    return {
      maxMessageBytes: DIAL_MESSAGE_MAX,
      open: (socket) => {
        ws = socket;
        socket.sendBinary(gatewayNonce);
        // Streams end at this listener's connections: loopback only, and useless without the
        // agent's token, which every request through it carries.
        server = createServer({ allowHalfOpen: true }, (c: Socket) => session.open(c));
        server.listen(0, "127.0.0.1", () => {
          if (ended) return void server?.close();
          const addr = server?.address();
          link.port = typeof addr === "object" && addr ? addr.port : 0;
          // A newer link of the same agent replaces the older (a redial after a silent drop).
          // Set first: the older one's close then leaves the record of the agent's link alone.
          const older = this.links.get(agentId);
          this.links.set(agentId, link);
          older?.close("replaced by a newer link");
          this.relay?.publish(agentId);
          this.log(`agent ${agentId}: dial link open`);
        });
      },
      message: (data) => session.receive(data),
      drain: () => {},
      close: () => link.close("the agent closed it"),
    };
  }
}
