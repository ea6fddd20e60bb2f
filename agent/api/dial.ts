/**
 * The agent's end of its dial-out links (docs/regions.md "BYOC agents: who dials whom"): an agent
 * that no gateway can reach (behind NAT, in a customer's network) keeps one link to each gateway
 * it is given, opened from here, and serves every stream a gateway opens on it from its own API
 * (`target`, its loopback listener): the gateway's calls, event streams, execs, terminals and
 * tunnels arrive as plain HTTP and WebSocket, as they would to a reachable agent, and are checked
 * the same way (each request carries the gateway's short-lived token for this agent).
 *
 * A link that fails or goes silent is dialled again after 1 s, doubling to 30 s while the gateway
 * stays unreachable, so a gateway's restart is met within a second or two and a long outage
 * costs one attempt per 30 s.
 */
import { connect } from "node:net";
import WebSocket from "ws";
import { DIAL_IDLE_MS, DIAL_MESSAGE_MAX, DIAL_NONCE_HEADER, DIAL_PATH } from "../../contracts/agent/dial.ts";
import { dialNonce } from "../../contracts/agent/dial-cipher.ts";
import { type DialEnd, type DialSession, startDialSession } from "../../contracts/agent/dial-session.ts";
import { type AgentCredentials, secretKey, signHeartbeatToken } from "../../contracts/agent/token.ts";
import { describeError } from "../../contracts/errors.ts";

const REDIAL_FIRST_MS = 1_000;
const REDIAL_MAX_MS = 30_000;
/** A link that lasted this long was healthy: the next failure redials after REDIAL_FIRST_MS again. */
const HEALTHY_LINK_MS = 60_000;
/** The handshake (upgrade and the gateway's nonce) of one dial, ms. */
const HANDSHAKE_MS = 10_000;

export interface Dialer {
  /** Gateways this agent has an open link to now. */
  linked(): string[];
  stop(): void;
}

export function startDialer(opts: {
  gatewayUrls: readonly string[];
  credentials: AgentCredentials;
  /** The agent's own API, which every stream is bridged to. */
  target: { host: string; port: number };
  log?: (line: string) => void;
}): Dialer {
  const log = opts.log ?? ((l: string) => console.error(l));
  const links = new Map<string, () => void>();
  let stopped = false;
  const timers = new Set<ReturnType<typeof setTimeout>>();

  const dialLoop = (gateway: string, delayMs: number) => {
    const t = setTimeout(() => {
      timers.delete(t);
      if (stopped) return;
      const started = Date.now();
      dialOnce(gateway, opts, log, (close) => links.set(gateway, close))
        .catch((err) => log(`dial ${gateway}: ${describeError(err)}`))
        .finally(() => {
          links.delete(gateway);
          const healthy = Date.now() - started > HEALTHY_LINK_MS;
          const next = healthy || delayMs === 0 ? REDIAL_FIRST_MS : Math.min(delayMs * 2, REDIAL_MAX_MS);
          if (!stopped) dialLoop(gateway, next);
        });
    }, delayMs);
    timers.add(t);
  };
  for (const g of opts.gatewayUrls) dialLoop(g, 0);
  return {
    linked: () => [...links.keys()],
    stop() {
      stopped = true;
      for (const t of timers) clearTimeout(t);
      for (const close of links.values()) close();
    },
  };
}

/** One link to `gateway`: resolves when it ends (closed by either end, or silent too long). */
async function dialOnce(
  gateway: string,
  opts: { credentials: AgentCredentials; target: { host: string; port: number } },
  log: (line: string) => void,
  onOpen: (close: () => void) => void,
): Promise<void> {
  const key = secretKey(opts.credentials.key);
  const agentNonce = dialNonce();
  const token = await signHeartbeatToken(key, opts.credentials.id, "dial");
  const url = `${gateway.replace(/\/+$/, "").replace(/^http/, "ws")}${DIAL_PATH}`;
  const ws = new WebSocket(url, {
    headers: {
      authorization: `Bearer ${token}`,
      [DIAL_NONCE_HEADER]: Buffer.from(agentNonce).toString("hex"),
    },
    handshakeTimeout: HANDSHAKE_MS,
    perMessageDeflate: false,
    maxPayload: DIAL_MESSAGE_MAX,
  });
  ws.binaryType = "nodebuffer";
  let session: DialSession | undefined;
  const end = (why: DialEnd) => {
    if (why.kind === "silent") ws.terminate();
    else ws.close(1008, why.reason.slice(0, 120));
  };
  // Until the gateway's greeting: silent as long as a link may be, and the link is dead.
  const greeting = setTimeout(() => ws.terminate(), DIAL_IDLE_MS);
  try {
    await new Promise<void>((resolve, reject) => {
      ws.on("unexpected-response", (_req, res) => {
        reject(new Error(`the gateway answered ${res.statusCode} to the dial`));
        ws.terminate();
      });
      ws.on("error", (err) => reject(err));
      ws.on("message", (data: Buffer) => {
        if (session) return session.receive(data);
        // The gateway's greeting: its nonce, in the clear; everything after is sealed.
        clearTimeout(greeting);
        session = startDialSession({
          key,
          agentNonce,
          gatewayNonce: data,
          side: "agent",
          write: (message) => {
            if (ws.readyState === WebSocket.OPEN) ws.send(message);
          },
          end,
          accept: () => connect({ host: opts.target.host, port: opts.target.port, allowHalfOpen: true }),
        });
        log(`dial ${gateway}: linked`);
        onOpen(() => ws.close(1001, "agent stopping"));
      });
      ws.on("close", (code, reason) => {
        if (session) log(`dial ${gateway}: link closed (${code} ${reason.toString()})`);
        resolve();
      });
    });
  } finally {
    clearTimeout(greeting);
    session?.close();
  }
}
