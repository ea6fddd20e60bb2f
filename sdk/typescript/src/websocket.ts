/**
 * A minimal WebSocket client (RFC 6455) over node:net / node:tls, which Bun, Node >= 20 and Deno
 * all provide. Why not the runtime's WebSocket: the standard constructor cannot send an
 * `Authorization` header (the service's terminal takes the API key as a Bearer header), Node 20
 * has no global WebSocket at all, and the non-standard header options differ per runtime. This
 * one does what the terminal needs and no more: the client handshake with extra headers, binary
 * and text messages, fragmented messages, ping/pong and the closing handshake. No extensions
 * (no permessage-deflate), no subprotocols.
 */
import { utf8 } from "./bytes.ts";
import { errorFromAnswer, SandboxdError } from "./errors.ts";

/** The largest message accepted from the server: a terminal sends small chunks; bounds memory. */
const MAX_MESSAGE_BYTES = 16 * 1024 * 1024;
/** The handshake's answer (status line and headers) must fit in this; a server sends < 1 KiB. */
const MAX_HANDSHAKE_BYTES = 64 * 1024;

export interface WsHandlers {
  onMessage(data: Uint8Array, binary: boolean): void;
  onClose(code: number, reason: string): void;
}

interface Socket {
  write(b: Uint8Array): boolean;
  end(): void;
  destroy(): void;
  on(ev: "data", f: (b: Uint8Array) => void): void;
  on(ev: "close", f: () => void): void;
  on(ev: "error", f: (e: Error) => void): void;
  once(ev: string, f: (...a: unknown[]) => void): void;
  removeAllListeners(ev: string): void;
}

export class WsConnection {
  private closed = false;
  private closeSent = false;
  private closeTimer: ReturnType<typeof setTimeout> | undefined;

  private constructor(
    private readonly sock: Socket,
    private readonly h: WsHandlers,
  ) {}

  /**
   * Opens `url` (ws: or wss:; http: and https: are taken as their WebSocket twins) with `headers`.
   * A refusal before the upgrade throws the service's error (its status and `{code, message}`).
   */
  static async open(
    url: URL,
    headers: Record<string, string>,
    h: WsHandlers,
    timeoutMs: number,
  ): Promise<WsConnection> {
    const secure = url.protocol === "wss:" || url.protocol === "https:";
    const port = Number(url.port || (secure ? 443 : 80));
    const host = url.hostname.replace(/^\[|\]$/g, "");
    const sock = await connect(secure, host, port, timeoutMs);
    const key = toB64(crypto.getRandomValues(new Uint8Array(16)));
    const lines = [
      `GET ${url.pathname}${url.search} HTTP/1.1`,
      `Host: ${url.host}`,
      "Upgrade: websocket",
      "Connection: Upgrade",
      `Sec-WebSocket-Key: ${key}`,
      "Sec-WebSocket-Version: 13",
      ...Object.entries(headers).map(([k, v]) => `${k}: ${v}`),
    ];
    sock.write(utf8(`${lines.join("\r\n")}\r\n\r\n`));
    const { head, rest } = await readHandshake(sock, timeoutMs);
    const [statusLine = "", ...headerLines] = head.split("\r\n");
    const status = Number(/^HTTP\/1\.[01] (\d{3})/.exec(statusLine)?.[1] ?? 0);
    const answer = new Headers();
    for (const l of headerLines) {
      const i = l.indexOf(":");
      if (i > 0) answer.append(l.slice(0, i).trim(), l.slice(i + 1).trim());
    }
    if (status !== 101) {
      const body = await readBody(sock, answer, rest, timeoutMs);
      sock.destroy();
      throw errorFromAnswer(status || 502, answer, body);
    }
    const accept = answer.get("sec-websocket-accept");
    const want = toB64(
      new Uint8Array(await crypto.subtle.digest("SHA-1", utf8(`${key}258EAFA5-E914-47DA-95CA-C5AB0DC85B11`))),
    );

    if (accept !== want) {
      sock.destroy();
      throw new SandboxdError({ code: "protocol", status, message: "WebSocket handshake: bad accept key" });
    }
    const ws = new WsConnection(sock, h);
    ws.listen(rest);
    return ws;
  }

  sendBinary(data: Uint8Array): void {
    this.frame(0x2, data);
  }

  sendText(data: string): void {
    this.frame(0x1, utf8(data));
  }

  /** Starts the closing handshake; the socket ends when the server answers (or after 5 s). */
  close(code = 1000, reason = ""): void {
    if (this.closed || this.closeSent) return;
    const r = utf8(reason).subarray(0, 123);
    const payload = new Uint8Array(2 + r.length);
    payload[0] = code >> 8;
    payload[1] = code & 0xff;
    payload.set(r, 2);
    this.frame(0x8, payload);
    this.closeSent = true;
    // A server that never answers the close frame does not hold the socket open: 5 s is RFC
    // 6455's "reasonable time" for the answer on a link that is alive.
    this.closeTimer = setTimeout(() => this.finish(code, reason), 5000);
  }

  private frame(opcode: number, payload: Uint8Array): void {
    if (this.closed || this.closeSent) return;
    const n = payload.length;
    const lenBytes = n < 126 ? 0 : n < 65536 ? 2 : 8;
    const head = new Uint8Array(2 + lenBytes + 4);
    head[0] = 0x80 | opcode;
    head[1] = 0x80 | (lenBytes === 0 ? n : lenBytes === 2 ? 126 : 127);
    const dv = new DataView(head.buffer);
    if (lenBytes === 2) dv.setUint16(2, n);
    if (lenBytes === 8) dv.setBigUint64(2, BigInt(n));
    const mask = crypto.getRandomValues(new Uint8Array(4));
    head.set(mask, 2 + lenBytes);
    const masked = new Uint8Array(n);
    for (let i = 0; i < n; i++) masked[i] = payload[i]! ^ mask[i & 3]!;
    const out = new Uint8Array(head.length + n);
    out.set(head);
    out.set(masked, head.length);
    this.sock.write(out);
  }

  private listen(initial: Uint8Array): void {
    let buf = initial;
    let parts: Uint8Array[] = [];
    let partsLen = 0;
    let partsBinary = true;
    const onData = (chunk: Uint8Array) => {
      buf = concat(buf, chunk);
      for (;;) {
        if (buf.length < 2) return;
        const fin = (buf[0]! & 0x80) !== 0;
        const opcode = buf[0]! & 0x0f;
        let len = buf[1]! & 0x7f;
        const masked = (buf[1]! & 0x80) !== 0;
        let off = 2;
        if (len === 126) {
          if (buf.length < 4) return;
          len = new DataView(buf.buffer, buf.byteOffset).getUint16(2);
          off = 4;
        } else if (len === 127) {
          if (buf.length < 10) return;
          len = Number(new DataView(buf.buffer, buf.byteOffset).getBigUint64(2));
          off = 10;
        }
        if (len > MAX_MESSAGE_BYTES || partsLen + len > MAX_MESSAGE_BYTES) {
          this.close(1009, "message too big");
          return;
        }
        const maskKey = masked ? buf.subarray(off, off + 4) : undefined;
        if (masked) off += 4;
        if (buf.length < off + len) return;
        const payload = buf.slice(off, off + len);
        if (maskKey) for (let i = 0; i < payload.length; i++) payload[i] = payload[i]! ^ maskKey[i & 3]!;
        buf = buf.subarray(off + len);
        if (opcode === 0x8) {
          const code = payload.length >= 2 ? (payload[0]! << 8) | payload[1]! : 1005;
          const reason = new TextDecoder().decode(payload.subarray(2));
          if (!this.closeSent) {
            this.frame(0x8, payload.subarray(0, 2));
            this.closeSent = true;
          }
          this.finish(code, reason);
          return;
        }
        if (opcode === 0x9) {
          this.frame(0xa, payload);
          continue;
        }
        if (opcode === 0xa) continue;
        if (opcode === 0x1 || opcode === 0x2) {
          partsBinary = opcode === 0x2;
          parts = [];
          partsLen = 0;
        }
        parts.push(payload);
        partsLen += payload.length;
        if (fin) {
          const msg = parts.length === 1 ? parts[0]! : concat(...parts);
          parts = [];
          partsLen = 0;
          this.h.onMessage(msg, partsBinary);
        }
      }
    };
    this.sock.on("data", onData);
    this.sock.on("close", () => this.finish(1006, "connection lost"));
    this.sock.on("error", () => this.finish(1006, "connection lost"));
    if (initial.length > 0) {
      buf = new Uint8Array(0);
      onData(initial);
    }
  }

  private finish(code: number, reason: string): void {
    if (this.closed) return;
    this.closed = true;
    clearTimeout(this.closeTimer);
    this.sock.end();
    this.sock.destroy();
    this.h.onClose(code, reason);
  }
}

async function connect(secure: boolean, host: string, port: number, timeoutMs: number): Promise<Socket> {
  const mod = secure ? await import("node:tls") : await import("node:net");
  return new Promise<Socket>((resolve, reject) => {
    const opts = secure ? { host, port, servername: host, ALPNProtocols: ["http/1.1"] } : { host, port };
    const sock = (mod as typeof import("node:tls")).connect(opts as import("node:tls").ConnectionOptions);
    const timer = setTimeout(() => {
      sock.destroy();
      reject(
        new SandboxdError({ code: "timeout", status: 0, message: `connect ${host}:${port}: timed out` }),
      );
    }, timeoutMs);
    sock.once(secure ? "secureConnect" : "connect", () => {
      clearTimeout(timer);
      sock.removeAllListeners("error");
      resolve(sock as unknown as Socket);
    });
    sock.once("error", (e: Error) => {
      clearTimeout(timer);
      reject(
        new SandboxdError({ code: "network", status: 0, message: `connect ${host}:${port}: ${e.message}` }),
      );
    });
  });
}

/** Reads up to the blank line after the answer's headers; returns them and the bytes after. */
function readHandshake(sock: Socket, timeoutMs: number): Promise<{ head: string; rest: Uint8Array }> {
  return new Promise((resolve, reject) => {
    let buf: Uint8Array = new Uint8Array(0);
    const fail = (message: string) => {
      cleanup();
      sock.destroy();
      reject(
        new SandboxdError({ code: message.includes("within") ? "timeout" : "network", status: 0, message }),
      );
    };
    const timer = setTimeout(() => fail(`WebSocket handshake: no answer within ${timeoutMs} ms`), timeoutMs);
    const cleanup = () => {
      clearTimeout(timer);
      sock.removeAllListeners("data");
      sock.removeAllListeners("close");
      sock.removeAllListeners("error");
    };
    sock.on("data", (chunk) => {
      buf = concat(buf, chunk);
      const end = indexOfCrlfCrlf(buf);
      if (end >= 0) {
        cleanup();
        resolve({ head: new TextDecoder().decode(buf.subarray(0, end)), rest: buf.slice(end + 4) });
      } else if (buf.length > MAX_HANDSHAKE_BYTES) {
        fail("WebSocket handshake: answer headers too long");
      }
    });
    sock.on("close", () => fail("WebSocket handshake: connection closed"));
    sock.on("error", (e) => fail(`WebSocket handshake: ${e.message}`));
  });
}

/** A refusal's body: `Content-Length` bytes, or what comes until the server closes. */
function readBody(sock: Socket, headers: Headers, initial: Uint8Array, timeoutMs: number): Promise<string> {
  const want = Number(headers.get("content-length") ?? Number.NaN);
  return new Promise((resolve) => {
    let buf = initial;
    const done = () => {
      clearTimeout(timer);
      sock.removeAllListeners("data");
      resolve(new TextDecoder().decode(Number.isNaN(want) ? buf : buf.subarray(0, want)));
    };
    const timer = setTimeout(done, timeoutMs);
    if (!Number.isNaN(want) && buf.length >= want) return done();
    sock.on("data", (chunk) => {
      buf = concat(buf, chunk);
      if (!Number.isNaN(want) && buf.length >= want) done();
    });
    sock.on("close", done);
    sock.on("error", done);
  });
}

function indexOfCrlfCrlf(b: Uint8Array): number {
  for (let i = 0; i + 3 < b.length; i++) {
    if (b[i] === 13 && b[i + 1] === 10 && b[i + 2] === 13 && b[i + 3] === 10) return i;
  }
  return -1;
}

function concat(...bs: Uint8Array[]): Uint8Array<ArrayBuffer> {
  const n = bs.reduce((s, b) => s + b.length, 0);
  const out = new Uint8Array(n);
  let o = 0;
  for (const b of bs) {
    out.set(b, o);
    o += b.length;
  }
  return out;
}

function toB64(b: Uint8Array): string {
  return btoa(String.fromCharCode(...b));
}
