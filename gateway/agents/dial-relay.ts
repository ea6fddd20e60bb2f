/**
 * Gateways behind one address (docs/regions.md "Gateways behind one address"). A dial-out agent
 * given one address for all the gateways of its region holds a link to whichever gateway that
 * address sent it to; the others reach it through that one:
 *
 *   gateway B ─ loopback listener for agent X ─ WebSocket RELAY_PATH ─▶ gateway A ─ X's link ─▶ X
 *
 * - **Who holds a link** is in the database (`dial_links`): the gateway that accepts an agent's
 *   link writes its own peer URL (`--peer-url`) with `seenAt`, refreshed every
 *   LINK_REFRESH_MS while the link lives, deleted when it closes. A row older than LINK_FRESH_MS
 *   (its gateway died) is ignored.
 * - **A gateway without a link** to agent X looks at the rows every RELAY_SCAN_MS; for a fresh
 *   row of another gateway it listens on a loopback port of its own for X, and each connection to
 *   that port becomes one WebSocket to that gateway's RELAY_PATH, whose bytes the linked gateway
 *   passes to a stream of X's link. The router's client for X is the same HTTP client as for a
 *   linked agent, with that port as its base: every request still carries X's own short-lived
 *   token, which X checks.
 * - **Who may relay**: the relay request carries a token signed with X's key for the relay
 *   audience (contracts/agent/token.ts `signRelayToken`): only a gateway, which holds the agent
 *   secret, can make one; X's own checks never accept it. Gateways reach each other over the
 *   operator's network; a peer URL may be https.
 * - **Back-pressure** both ways: the linked gateway stops reading the relay's WebSocket while the
 *   link's stream is full, and stops reading the stream while the WebSocket's send queue is over
 *   SEND_HIGH; the relaying gateway's side is `ws`'s stream, piped.
 */
import { createServer, type Server, type Socket, connect as tcpConnect } from "node:net";
import { and, eq, gt, ne } from "drizzle-orm";
import WebSocket, { createWebSocketStream } from "ws";
import { secretKey, signRelayToken, verifyRelayToken } from "../../contracts/agent/token.ts";
import { bestEffort } from "../../contracts/best-effort.ts";
import { describeError } from "../../contracts/errors.ts";
import type { Db } from "../../db/client.ts";
import { agents } from "../../db/schema/agents.ts";
import { dialLinks } from "../../db/schema/dial-links.ts";
import type { ServerSocket, SocketHandler, Upgrade } from "../runtime/types.ts";
import { deriveAgentKey } from "./enrollment.ts";
import { jsonAnswer } from "./internal-http.ts";

/** The linked gateway's relay endpoint: `GET RELAY_PATH?agent=<id>`, a WebSocket. */
export const RELAY_PATH = "/internal/agents/relay";
/** A held link's row is refreshed this often: three refreshes fit in LINK_FRESH_MS. */
export const LINK_REFRESH_MS = 10_000;
/** A row not refreshed for this long is a dead gateway's: ignored. */
export const LINK_FRESH_MS = 35_000;
/**
 * How often a gateway looks for links held elsewhere: a link that moved is reachable again from
 * here within this (a heartbeat's interval, 5 s).
 */
export const RELAY_SCAN_MS = 5_000;
/** Bytes queued to a relay's WebSocket before the link's stream is paused. */
const SEND_HIGH = 1 << 20;
/** The relay's WebSocket handshake: peers are on the operator's network; 10 s means one is stuck. */
const HANDSHAKE_MS = 10_000;
/** Largest relay message taken: what the relaying side's `ws` stream writes at once is far less. */
const RELAY_MESSAGE_MAX = 1 << 20;

export interface RelayOptions {
  db: Db;
  agentSecret: string;
  /** This gateway's URL as its peers reach it; none: its links are not offered to peers. */
  peerUrl?: string;
  clock?: () => number;
  log: (line: string) => void;
}

interface Relay {
  peerUrl: string;
  server: Server;
  port: number;
}

/** The relay ends of one gateway: what it offers of its links, and what it borrows of others'. */
export class DialRelay {
  private readonly published = new Map<string, ReturnType<typeof setInterval>>();
  private readonly relays = new Map<string, Relay>();
  private scanTimer: ReturnType<typeof setInterval> | undefined;
  private readonly clock: () => number;

  constructor(
    private readonly o: RelayOptions,
    /** This gateway's own link to an agent, as its loopback port (dial-hub.ts). */
    private readonly localPort: (agentId: string) => number | undefined,
  ) {
    this.clock = o.clock ?? Date.now;
  }

  /** Where this gateway reaches `agentId` through another gateway's link, if it can now. */
  baseUrl(agentId: string): string | undefined {
    const r = this.relays.get(agentId);
    return r && r.port > 0 ? `http://127.0.0.1:${r.port}` : undefined;
  }

  /** Starts looking for links held by other gateways. */
  start(): void {
    if (this.scanTimer) return;
    const scan = () =>
      void this.scan().catch((err) => this.o.log(`dial relays: scan failed: ${describeError(err)}`));
    scan();
    this.scanTimer = setInterval(scan, RELAY_SCAN_MS);
  }

  stop(): void {
    if (this.scanTimer) clearInterval(this.scanTimer);
    this.scanTimer = undefined;
    for (const id of [...this.relays.keys()]) this.drop(id);
    for (const id of [...this.published.keys()]) this.unpublish(id);
  }

  /** This gateway now holds `agentId`'s link: its peers may relay to it. */
  publish(agentId: string): void {
    const peerUrl = this.o.peerUrl;
    if (peerUrl === undefined) return;
    const write = () =>
      bestEffort(
        this.o.log,
        `recording agent ${agentId}'s link`,
        this.o.db
          .insert(dialLinks)
          .values({ agentId, peerUrl, seenAt: new Date(this.clock()) })
          .onConflictDoUpdate({
            target: [dialLinks.agentId, dialLinks.peerUrl],
            set: { seenAt: new Date(this.clock()) },
          }),
      );
    const old = this.published.get(agentId);
    if (old) clearInterval(old);
    void write();
    this.published.set(agentId, setInterval(write, LINK_REFRESH_MS));
    // A relay of ours to it through another gateway is no longer needed.
    this.drop(agentId);
  }

  /** This gateway's link to `agentId` closed. */
  unpublish(agentId: string): void {
    const t = this.published.get(agentId);
    if (!t) return;
    clearInterval(t);
    this.published.delete(agentId);
    const peerUrl = this.o.peerUrl;
    if (peerUrl === undefined) return;
    void bestEffort(
      this.o.log,
      `removing agent ${agentId}'s link record`,
      this.o.db.delete(dialLinks).where(and(eq(dialLinks.agentId, agentId), eq(dialLinks.peerUrl, peerUrl))),
    );
  }

  /** One look at the links held elsewhere: a relay for each agent not linked here, none for others. */
  async scan(): Promise<void> {
    const fresh = new Date(this.clock() - LINK_FRESH_MS);
    const own = this.o.peerUrl ?? "";
    const rows = await this.o.db
      .select({ agentId: dialLinks.agentId, peerUrl: dialLinks.peerUrl, seenAt: dialLinks.seenAt })
      .from(dialLinks)
      .where(and(gt(dialLinks.seenAt, fresh), ne(dialLinks.peerUrl, own)));
    const want = new Map<string, string>();
    for (const r of rows.sort((a, b) => b.seenAt.getTime() - a.seenAt.getTime())) {
      if (this.localPort(r.agentId) !== undefined || want.has(r.agentId)) continue;
      want.set(r.agentId, r.peerUrl);
    }
    for (const [id, relay] of this.relays)
      if (want.get(id) !== relay.peerUrl || this.localPort(id) !== undefined) this.drop(id);
    for (const [id, peerUrl] of want) if (!this.relays.has(id)) await this.open(id, peerUrl);
  }

  private drop(agentId: string): void {
    const r = this.relays.get(agentId);
    if (!r) return;
    this.relays.delete(agentId);
    r.server.close();
    this.o.log(`agent ${agentId}: relay through ${r.peerUrl} closed`);
  }

  /** A loopback listener for `agentId` whose connections go to `peerUrl`'s link. */
  private async open(agentId: string, peerUrl: string): Promise<void> {
    const [row] = await this.o.db.select().from(agents).where(eq(agents.id, agentId));
    if (!row?.keyId) return;
    const key = deriveAgentKey(this.o.agentSecret, agentId, row.keyId);
    const url = `${peerUrl.replace(/^http/, "ws").replace(/\/+$/, "")}${RELAY_PATH}?agent=${encodeURIComponent(agentId)}`;
    const server = createServer({ allowHalfOpen: false }, (c: Socket) => {
      c.pause();
      void signRelayToken(secretKey(key), agentId).then((token) => {
        const ws = new WebSocket(url, {
          headers: { authorization: `Bearer ${token}` },
          handshakeTimeout: HANDSHAKE_MS,
          perMessageDeflate: false,
          maxPayload: RELAY_MESSAGE_MAX,
        });
        const stream = createWebSocketStream(ws);
        const end = () => {
          c.destroy();
          stream.destroy();
        };
        stream.on("error", end);
        c.on("error", end);
        c.on("close", end);
        stream.on("close", end);
        c.pipe(stream).pipe(c);
      });
    });
    const relay: Relay = { peerUrl, server, port: 0 };
    this.relays.set(agentId, relay);
    await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
    const addr = server.address();
    relay.port = typeof addr === "object" && addr ? addr.port : 0;
    this.o.log(`agent ${agentId}: reached through the link held by ${peerUrl}`);
  }

  /**
   * `GET RELAY_PATH?agent=<id>` from a peer: a relay token for that agent, and this gateway holds
   * its link; then each message is passed to a new stream of the link, and back.
   */
  async accept(request: Request, upgrade: Upgrade | undefined): Promise<Response> {
    const agentId = new URL(request.url).searchParams.get("agent") ?? "";
    const [row] = agentId ? await this.o.db.select().from(agents).where(eq(agents.id, agentId)) : [];
    if (!row?.keyId) return jsonAnswer(401, { code: "unauthorized", message: "relay token rejected" });
    const key = secretKey(deriveAgentKey(this.o.agentSecret, agentId, row.keyId));
    const check = await verifyRelayToken(key, agentId, request.headers.get("authorization"));
    if (!check.ok) return jsonAnswer(401, { code: "unauthorized", message: check.error.message });
    const port = this.localPort(agentId);
    if (port === undefined)
      return jsonAnswer(503, {
        code: "agent_unavailable",
        message: `agent ${agentId} has no link to this gateway`,
      });
    if (!upgrade) return jsonAnswer(400, { code: "bad_request", message: "a relay is a WebSocket" });
    return upgrade(bridge(port));
  }
}

/** One relay WebSocket passed to a new connection to the link's loopback listener (`port`). */
function bridge(port: number): SocketHandler {
  let ws: ServerSocket | undefined;
  let tcp: Socket | undefined;
  let closed = false;
  const close = () => {
    if (closed) return;
    closed = true;
    tcp?.destroy();
    ws?.close(1000, "");
  };
  return {
    maxMessageBytes: RELAY_MESSAGE_MAX,
    open: (socket) => {
      ws = socket;
      // Nothing is read from the peer until the stream is there: no queue of its bytes here.
      socket.pause();
      tcp = tcpConnect({ host: "127.0.0.1", port });
      tcp.on("connect", () => socket.resume());
      tcp.on("data", (d: Buffer) => {
        socket.sendBinary(d);
        if (socket.bufferedAmount() > SEND_HIGH) tcp?.pause();
      });
      tcp.on("drain", () => socket.resume());
      tcp.on("close", close);
      tcp.on("error", close);
    },
    message: (data) => {
      if (typeof data === "string" || !tcp) return close();
      if (!tcp.write(data)) ws?.pause();
    },
    drain: () => tcp?.resume(),
    close,
  };
}
