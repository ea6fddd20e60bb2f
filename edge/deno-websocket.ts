/**
 * WebSocket upgrades on Deno (docs/edge.md "Deno"): Deno's fetch cannot carry an upgrade, so the
 * edge opens its own WebSocket to the gateway (with the client's headers and subprotocols),
 * answers the client's upgrade once that one is open, with the protocol the gateway chose, and
 * passes messages and closes both ways. A gateway that refuses the upgrade is asked the same
 * request without it, so the client gets the gateway's own status and envelope (a bad key 401).
 */
import { SandboxdError } from "../contracts/errors.ts";

/**
 * Bytes one direction may hold in the edge while its receiver reads slower than its sender writes
 * (a browser WebSocket cannot be told to stop reading, so there is no back-pressure to pass on):
 * past it the bridge closes both sides with 1011 rather than grow without bound. 8 MiB holds many
 * seconds of a terminal's or a tunnel's bursts.
 */
export const MAX_BUFFERED_BYTES = 8 * 1024 * 1024;

/** The close codes a peer may send (RFC 6455 7.4): 1005, 1006 and 1015 are only ever reported. */
function sendableCode(code: number): number | undefined {
  return code === 1000 ||
    (code >= 3000 && code <= 4999) ||
    (code >= 1001 && code <= 1014 && code !== 1005 && code !== 1006)
    ? code
    : undefined;
}

/** The WebSocket constructor of Deno, which takes headers beside the subprotocols. */
type DenoWebSocket = new (
  url: string,
  opts: { protocols: string[]; headers: Record<string, string> },
) => WebSocket;

/** Headers the edge's own WebSocket handshake sets: the client's are not forwarded. */
const HANDSHAKE = [
  "upgrade",
  "sec-websocket-key",
  "sec-websocket-version",
  "sec-websocket-extensions",
  "sec-websocket-protocol",
];

export function denoWebSocketBridge(deps: {
  upgradeWebSocket: (req: Request, opts: { protocol?: string }) => { socket: WebSocket; response: Response };
  fetch: (req: Request) => Promise<Response>;
}): (req: Request, target: URL, headers: Headers) => Promise<Response> {
  return async (req, target, headers) => {
    const protocols = (req.headers.get("sec-websocket-protocol") ?? "")
      .split(",")
      .map((p) => p.trim())
      .filter((p) => p !== "");
    const plain = new Headers(headers);
    for (const name of HANDSHAKE) plain.delete(name);
    const wsUrl = new URL(target);
    wsUrl.protocol = target.protocol === "https:" ? "wss:" : "ws:";
    const upstream = new (WebSocket as unknown as DenoWebSocket)(wsUrl.href, {
      protocols,
      headers: Object.fromEntries(plain),
    });
    upstream.binaryType = "arraybuffer";
    const opened = await new Promise<boolean>((resolve) => {
      upstream.onopen = () => resolve(true);
      upstream.onerror = () => resolve(false);
      upstream.onclose = () => resolve(false);
    });
    if (!opened) {
      // The gateway's refusal, as it answers the request without the upgrade (a GET: safe to ask again).
      const res = await deps.fetch(
        new Request(target.href, { method: "GET", headers: plain, redirect: "manual" }),
      );
      if (res.status >= 400) return res;
      await res.body?.cancel();
      throw new SandboxdError(
        "gateway_unavailable",
        `the gateway at ${target.origin} did not open the WebSocket`,
      );
    }
    // The gateway chose its protocol from the client's list; Deno's own check of that list splits
    // it on ", " only (a client that sends "a,b" would be refused), so the answer names it itself.
    const { socket, response } = deps.upgradeWebSocket(req, {});
    if (upstream.protocol !== "") response.headers.set("sec-websocket-protocol", upstream.protocol);
    socket.binaryType = "arraybuffer";
    pipe(upstream, socket);
    return response;
  };
}

/** Messages and closes both ways; messages from the gateway wait (bounded) until the client's side is open. */
function pipe(upstream: WebSocket, client: WebSocket): void {
  const waiting: Array<string | ArrayBuffer> = [];
  let waitingBytes = 0;
  const sizeOf = (d: string | ArrayBuffer) => (typeof d === "string" ? d.length * 3 : d.byteLength);
  const fail = () => {
    closeWith(upstream, 1011, "the edge's buffer is full");
    closeWith(client, 1011, "the edge's buffer is full");
  };
  const forward = (to: WebSocket, data: string | ArrayBuffer) => {
    if (to.bufferedAmount > MAX_BUFFERED_BYTES) return fail();
    to.send(data);
  };
  upstream.onmessage = (e: MessageEvent) => {
    if (client.readyState === WebSocket.OPEN) return forward(client, e.data);
    waiting.push(e.data);
    waitingBytes += sizeOf(e.data);
    if (waitingBytes > MAX_BUFFERED_BYTES) fail();
  };
  client.onopen = () => {
    for (const d of waiting.splice(0)) client.send(d);
    waitingBytes = 0;
  };
  client.onmessage = (e: MessageEvent) => forward(upstream, e.data);
  upstream.onclose = (e: CloseEvent) => closeWith(client, e.code, e.reason);
  client.onclose = (e: CloseEvent) => closeWith(upstream, e.code, e.reason);
  upstream.onerror = () => closeWith(client, 1011, "the gateway's WebSocket failed");
  client.onerror = () => closeWith(upstream, 1001, "the client's WebSocket failed");
}

function closeWith(ws: WebSocket, code: number, reason: string): void {
  if (ws.readyState === WebSocket.CLOSING || ws.readyState === WebSocket.CLOSED) return;
  const sendable = sendableCode(code);
  if (sendable === undefined) ws.close();
  else ws.close(sendable, reason);
}
