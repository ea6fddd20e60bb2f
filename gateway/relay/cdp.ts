/**
 * `protocol=cdp` (docs/sandboxes.md "Rules of the sandboxes API"): a DevTools relay a CDP client uses directly (Playwright's
 * `chromium.connectOverCDP(url)`, Puppeteer's `connect({browserWSEndpoint})`): one CDP JSON
 * message per WebSocket text message, both ways.
 *
 * The guest runs Chromium with `--remote-debugging-port=<port>`; the gateway reaches it through
 * tcp tunnels from the agent: `GET /json/version` on one gives `webSocketDebuggerUrl` (the browser
 * target), and the WebSocket client handshake to that path runs over a second one. Chromium
 * refuses DevTools requests whose Host is not an IP address or `localhost`, and WebSocket requests
 * carrying an Origin, so both go out as `Host: localhost:<port>` without an Origin.
 */
import { Duplex } from "node:stream";
import WebSocket from "ws";
import type { Tunnel } from "../../contracts/agent/api.ts";
import { settled } from "../../contracts/best-effort.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { CDP_MESSAGE_BYTES } from "../runtime/ws-limits.ts";
import { CLOSE, errorText, HIGH_WATER_BYTES, LowWater, maxHeldBytes, RelayBase } from "./common.ts";

/** The guest's DevTools must answer discovery and the handshake within this, ms each. */
export const DEVTOOLS_TIMEOUT_MS = 10_000;
/** `/json/version` is a few hundred bytes; a larger answer is not DevTools. */
const MAX_DISCOVERY_BYTES = 64 * 1024;
/**
 * What the relay holds for the browser at most (its send queue) before closing with 1008: every
 * runtime pauses the client first (runtime/), so only messages already read when it paused count.
 */
const MAX_HELD_BYTES = maxHeldBytes(CDP_MESSAGE_BYTES);

function withTimeout<T>(p: Promise<T>, what: string, onTimeout: () => void): Promise<T> {
  let timer: ReturnType<typeof setTimeout> | undefined;
  const t = new Promise<never>((_, reject) => {
    timer = setTimeout(() => {
      onTimeout();
      reject(new Error(`${what}: no answer in ${DEVTOOLS_TIMEOUT_MS} ms`));
    }, DEVTOOLS_TIMEOUT_MS);
  });
  return Promise.race([p, t]).finally(() => clearTimeout(timer));
}

/** `GET /json/version` over a tunnel (HTTP/1.1, Content-Length body); closes the tunnel. */
export async function discoverBrowserPath(tunnel: Tunnel, port: number): Promise<string> {
  const run = async (): Promise<string> => {
    const w = tunnel.writable.getWriter();
    await w.write(
      new TextEncoder().encode(
        `GET /json/version HTTP/1.1\r\nHost: localhost:${port}\r\nAccept: application/json\r\nConnection: close\r\n\r\n`,
      ),
    );
    w.releaseLock();
    const reader = tunnel.readable.getReader();
    let buf = new Uint8Array(0);
    let bodyStart = -1;
    let length = -1;
    for (;;) {
      const { done, value } = await reader.read();
      if (value) {
        const next = new Uint8Array(buf.length + value.length);
        next.set(buf);
        next.set(value, buf.length);
        buf = next;
      }
      if (buf.length > MAX_DISCOVERY_BYTES)
        throw new SandboxdError("port_unreachable", "GET /json/version: answer too large");
      if (bodyStart < 0) {
        const text = new TextDecoder("latin1").decode(buf);
        const end = text.indexOf("\r\n\r\n");
        if (end >= 0) {
          const head = text.slice(0, end);
          const status = /^HTTP\/1\.[01] (\d{3})/.exec(head)?.[1];
          if (status !== "200")
            throw new SandboxdError(
              "port_unreachable",
              `GET /json/version: HTTP ${status ?? "?"} (not DevTools?)`,
            );
          const cl = /\r\ncontent-length:\s*(\d+)/i.exec(head)?.[1];
          length = cl === undefined ? -1 : Number(cl);
          bodyStart = end + 4;
        }
      }
      if (bodyStart >= 0 && length >= 0 && buf.length - bodyStart >= length) break;
      if (done) {
        if (bodyStart >= 0 && length < 0) break; // body delimited by the end of the connection
        throw new SandboxdError(
          "port_unreachable",
          "GET /json/version: the connection ended before the answer",
        );
      }
    }
    void settled(reader.cancel()); // discovery read all it needs; the tunnel closes below
    const body = new TextDecoder().decode(
      buf.subarray(bodyStart, length >= 0 ? bodyStart + length : undefined),
    );
    const url = (JSON.parse(body) as { webSocketDebuggerUrl?: unknown }).webSocketDebuggerUrl;
    if (typeof url !== "string")
      throw new SandboxdError("port_unreachable", "GET /json/version: no webSocketDebuggerUrl");
    return new URL(url).pathname;
  };
  try {
    return await withTimeout(run(), "GET /json/version", () => tunnel.close());
  } finally {
    tunnel.close();
  }
}

/** The WebSocket client handshake to the browser target, over `tunnel`. */
export function openDevTools(tunnel: Tunnel, port: number, path: string): Promise<WebSocket> {
  const ws = new WebSocket(`ws://localhost:${port}${path}`, {
    // Any Duplex will do as the connection: here the agent's tunnel.
    createConnection: () => Duplex.fromWeb({ readable: tunnel.readable, writable: tunnel.writable }),
    // A larger message from the browser fails the upstream socket with 1009; the relay ends.
    maxPayload: CDP_MESSAGE_BYTES,
    perMessageDeflate: false,
    handshakeTimeout: DEVTOOLS_TIMEOUT_MS,
  });
  return new Promise((resolve, reject) => {
    ws.once("open", () => {
      ws.removeAllListeners("error");
      ws.on("error", () => {}); // CdpRelay.start takes over; a close event follows an error
      // Nothing may reach the client before its own WebSocket is open (CdpRelay.start).
      ws.pause();
      resolve(ws);
    });
    ws.once("error", (err) => {
      tunnel.close();
      reject(new Error(`DevTools WebSocket handshake: ${errorText(err)}`));
    });
  });
}

/**
 * Connects to the guest's DevTools: `first` is an open tunnel to the port (discovery), `dial`
 * opens another (the WebSocket).
 */
export async function connectDevTools(first: Tunnel, dial: () => Promise<Tunnel>, port: number) {
  const path = await discoverBrowserPath(first, port);
  const tunnel = await dial();
  return { ws: await openDevTools(tunnel, port, path), tunnel };
}

export class CdpRelay extends RelayBase {
  readonly maxMessageBytes = CDP_MESSAGE_BYTES;
  private readonly upstreamSent: LowWater | undefined;
  private paused = false;

  /** `upstream` is the connected browser target, or why connecting failed (1011 on open). */
  constructor(private readonly upstream: { ws: WebSocket; tunnel: Tunnel } | Error) {
    super();
    if (!(upstream instanceof Error)) this.upstreamSent = new LowWater(() => upstream.ws.bufferedAmount);
  }

  protected start(): void {
    const up = this.upstream;
    if (up instanceof Error) {
      this.end(CLOSE.error, `devtools: ${up.message}`);
      return;
    }
    if (up.ws.readyState !== WebSocket.OPEN) {
      this.end(CLOSE.error, "DevTools closed the connection before the client's opened");
      return;
    }
    up.ws.on("message", (data, isBinary) => {
      if (this.ended) return;
      // `ws` gives a Buffer (one frame) or its fragments: the message is copied at most once
      // here, and once more into a string for a text frame (the runtimes send text as a string).
      const buf = Array.isArray(data) ? Buffer.concat(data) : (data as Buffer);
      if (isBinary) this.socket!.sendBinary(buf);
      else this.socket!.sendText(buf.toString("utf8"));
      if (this.socket!.bufferedAmount() > HIGH_WATER_BYTES && !up.ws.isPaused) {
        up.ws.pause();
        void this.drained.wait().then(() => {
          if (!this.ended) up.ws.resume();
        });
      }
    });
    up.ws.on("close", (code, reason) =>
      this.end(
        code === 1000 || code === 1005 ? CLOSE.normal : code === CLOSE.tooBig ? CLOSE.tooBig : CLOSE.error,
        `DevTools closed the connection${reason.length > 0 ? `: ${reason.toString("utf8")}` : ""}`,
      ),
    );
    up.ws.on("error", (err) =>
      (err as { code?: unknown }).code === "WS_ERR_UNSUPPORTED_MESSAGE_LENGTH"
        ? this.end(CLOSE.tooBig, `DevTools sent a message over the relay's ${CDP_MESSAGE_BYTES} bytes`)
        : this.end(CLOSE.error, `devtools: ${errorText(err)}`),
    );
    up.ws.resume();
  }

  message(data: Uint8Array | string): void {
    const up = this.upstream;
    if (this.ended || up instanceof Error || this.tooBig(data)) return;
    up.ws.send(typeof data === "string" ? data : new TextDecoder().decode(data), { binary: false });
    if (up.ws.bufferedAmount > MAX_HELD_BYTES) {
      this.end(CLOSE.policy, "the client sends faster than the browser reads");
      return;
    }
    if (!this.paused && up.ws.bufferedAmount > HIGH_WATER_BYTES) {
      this.paused = true;
      this.socket!.pause();
      void this.upstreamSent!.wait().then(() => {
        this.paused = false;
        if (!this.ended) this.socket!.resume();
      });
    }
  }

  protected teardown(): void {
    const up = this.upstream;
    if (up instanceof Error) return;
    this.upstreamSent!.release();
    up.ws.removeAllListeners();
    up.ws.on("error", () => {});
    up.ws.terminate();
    up.tunnel.close();
  }
}
