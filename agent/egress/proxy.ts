/**
 * The host side of a sandbox's egress: one connection that a guest program opened to the egress
 * proxy port inside the guest, carried to the host agent as a byte stream. It speaks the two
 * forms every HTTP client uses through `http_proxy`/`https_proxy`/`ALL_PROXY`:
 *
 * - `CONNECT host:port HTTP/1.1`: a tunnel for any TCP protocol on any port (TLS included); the
 *   answer is `200 Connection established` and then raw bytes both ways.
 * - `GET http://host[:port]/path HTTP/1.1` (absolute form, plain HTTP): the request is passed on
 *   to the origin in origin form, the rest of the connection is piped to that origin.
 *
 * The destination NAME is checked against the sandbox's EgressPolicy before anything is resolved
 * or connected; an allowed destination then passes the operator's fence (fence.ts), which
 * resolves a name once on the host (the guest has no resolver of its own and no other way out),
 * refuses it when any address is internal, and connects to the address it checked. A refusal by
 * either is immediate (`403` with `X-Sandboxd-Egress: denied`, then close), so a client never
 * hangs on a blocked host, and is logged with the sandbox id and the reason.
 */
import type { Duplex } from "node:stream";
import { normalizeHost } from "../../contracts/egress.ts";
import { describeError, SandboxdError } from "../../contracts/errors.ts";
import { defaultFence, type EgressFence } from "./fence.ts";
import type { EgressPolicy } from "./policy.ts";

/** A request head larger than this is not an HTTP client talking to a proxy: refuse it. */
export const MAX_HEAD_BYTES = 16 * 1024;
/** A client that connected but says nothing for this long is dropped (it holds a stream slot). */
export const HEAD_TIMEOUT_MS = 10_000;

export interface EgressAttempt {
  atMs: number;
  host: string;
  port: number;
  allowed: boolean;
  /** Why it failed or was refused. */
  reason?: string;
}

/** What a guest means by itself (the names no_proxy lists): served inside the guest, not egress. */
export const GUEST_LOCAL: ReadonlySet<string> = new Set(["localhost", "127.0.0.1", "::1"]);

/**
 * An egress connection spliced to its destination, while it is open: the agent keeps these per
 * sandbox so that a new allow-list can close the ones it no longer allows (docs/egress.md).
 */
export interface OpenEgress {
  /** The destination as the guest named it, normalized (what `EgressPolicy.allows` reads). */
  host: string;
  port: number;
  /** Ends both sides at once; the guest program sees its connection drop. */
  close(): void;
}

export interface EgressContext {
  sandboxId: string;
  policy: EgressPolicy;
  /** Resolves, fences and connects an allowed destination (default: the operator's, from env). */
  fence?: EgressFence;
  /** A connection to the guest's own loopback `port` (a request for localhost comes back in). */
  connectLocal?: (port: number) => Promise<Duplex>;
  /** Every attempt, allowed or not (the agent keeps the refused ones per sandbox). */
  onAttempt?: (a: EgressAttempt) => void;
  /**
   * Told of each connection once it reaches its destination (not the guest's own loopback, which
   * is not egress); the function it returns is called when that connection ends.
   */
  onOpen?: (c: OpenEgress) => () => void;
  log?: (msg: string) => void;
}

interface Head {
  method: string;
  host: string;
  port: number;
  /** Bytes to send to the origin first (a plain HTTP request rewritten to origin form). */
  forward?: Buffer;
  /** Bytes after the head that already arrived (pipelined body). */
  rest: Buffer;
}

function reply(stream: Duplex, status: string, extra = ""): void {
  stream.end(`HTTP/1.1 ${status}\r\n${extra}Content-Length: 0\r\nConnection: close\r\n\r\n`);
}

/** Parses `host:port` (IPv6 in brackets); undefined when malformed. */
function hostPort(s: string, defPort: number): { host: string; port: number } | undefined {
  const m = /^(\[[0-9a-fA-F:.]+\]|[^:/\s]+)(?::(\d{1,5}))?$/.exec(s);
  if (!m) return undefined;
  const port = m[2] === undefined ? defPort : Number(m[2]);
  if (port < 1 || port > 65535) return undefined;
  return { host: normalizeHost(m[1]!), port };
}

export function parseHead(buf: Buffer): Head | { error: string } {
  const end = buf.indexOf("\r\n\r\n");
  const headText = buf.subarray(0, end).toString("latin1");
  const rest = buf.subarray(end + 4);
  const [requestLine, ...headerLines] = headText.split("\r\n");
  const m = /^([A-Z]+) (\S+) HTTP\/1\.[01]$/.exec(requestLine ?? "");
  if (!m) return { error: "not an HTTP proxy request" };
  const [, method, target] = m as unknown as [string, string, string];
  if (method === "CONNECT") {
    const hp = hostPort(target, 443);
    if (!hp || !/:\d+$/.test(target)) return { error: `CONNECT target ${target} is not host:port` };
    return { method, ...hp, rest };
  }
  let url: URL;
  try {
    url = new URL(target);
  } catch {
    return { error: "a plain HTTP proxy request needs an absolute http:// URL" };
  }
  if (url.protocol !== "http:") return { error: `${url.protocol} is only reachable through CONNECT` };
  // The host as the client wrote it, not as URL parsing rewrites it (`http://127.1/` would become
  // 127.0.0.1, the guest's own loopback): the policy and the fence read every spelling themselves.
  const authority = /^http:\/\/(?:[^/?#@]*@)?([^/?#]*)/i.exec(target)?.[1] ?? "";
  const hp = hostPort(authority, 80);
  if (!hp) return { error: `${target} names no valid host:port` };
  // Origin form for the origin; hop-by-hop proxy headers are dropped.
  const headers = headerLines.filter((l) => !/^proxy-(connection|authorization):/i.test(l));
  const forward = Buffer.from(
    `${method} ${url.pathname}${url.search} HTTP/1.1\r\n${headers.join("\r\n")}\r\n\r\n`,
    "latin1",
  );
  return { method, ...hp, forward, rest };
}

/** Reads the request head (bounded in size and time), without consuming past it. */
function readHead(stream: Duplex): Promise<Buffer | undefined> {
  return new Promise((resolve) => {
    let buf = Buffer.alloc(0);
    const done = (v: Buffer | undefined) => {
      clearTimeout(timer);
      stream.off("data", onData);
      stream.off("end", onEnd);
      stream.off("error", onEnd);
      stream.pause();
      resolve(v);
    };
    const onData = (chunk: Buffer) => {
      buf = Buffer.concat([buf, chunk]);
      if (buf.includes("\r\n\r\n")) done(buf);
      else if (buf.length > MAX_HEAD_BYTES) done(undefined);
    };
    const onEnd = () => done(undefined);
    const timer = setTimeout(() => done(undefined), HEAD_TIMEOUT_MS);
    stream.on("data", onData);
    stream.once("end", onEnd);
    stream.once("error", onEnd);
  });
}

/** Serves one proxied connection to the end; never throws. */
export async function serveEgressConnection(stream: Duplex, ctx: EgressContext): Promise<void> {
  const log = ctx.log ?? (() => {});
  stream.on("error", () => {}); // the guest side vanishing is not an agent error
  const buf = await readHead(stream);
  if (!buf) {
    reply(stream, "400 Bad Request");
    return;
  }
  const head = parseHead(buf);
  if ("error" in head) {
    reply(stream, "400 Bad Request", `X-Sandboxd-Egress: ${head.error}\r\n`);
    return;
  }
  if (GUEST_LOCAL.has(head.host)) {
    // The sandbox's own loopback: clients that ignore no_proxy (busybox wget) send it here.
    // It is served inside the guest, never on the host, and is not egress.
    let local: Duplex;
    try {
      if (!ctx.connectLocal) throw new SandboxdError("port_unreachable", "no route back into the guest");
      local = await ctx.connectLocal(head.port);
    } catch {
      reply(stream, "502 Bad Gateway", "X-Sandboxd-Egress: local port unreachable\r\n");
      return;
    }
    splice(stream, local, head);
    return;
  }
  const attempt: EgressAttempt = { atMs: Date.now(), host: head.host, port: head.port, allowed: false };
  if (!ctx.policy.allows(head.host)) {
    attempt.reason = "not in egress.allow";
    ctx.onAttempt?.(attempt);
    log(`egress denied: sandbox ${ctx.sandboxId} -> ${head.host}:${head.port}`);
    reply(stream, "403 Forbidden", "X-Sandboxd-Egress: denied\r\n");
    return;
  }
  const fence = ctx.fence ?? defaultFence();
  const dest = await fence.check(head.host, head.port);
  if (!dest.ok && dest.code !== "unresolvable") {
    attempt.reason = dest.reason;
    ctx.onAttempt?.(attempt);
    log(`egress denied: sandbox ${ctx.sandboxId} -> ${head.host}:${head.port} (${dest.reason})`);
    reply(stream, "403 Forbidden", "X-Sandboxd-Egress: denied\r\n");
    return;
  }
  let upstream: Duplex;
  try {
    if (!dest.ok) throw new SandboxdError("forbidden", dest.reason);
    upstream = await fence.connect(dest);
  } catch (err) {
    attempt.reason = describeError(err);
    ctx.onAttempt?.({ ...attempt, allowed: true });
    reply(stream, "502 Bad Gateway", "X-Sandboxd-Egress: unreachable\r\n");
    return;
  }
  ctx.onAttempt?.({ ...attempt, allowed: true });
  if (ctx.onOpen) {
    const forget = ctx.onOpen({
      host: head.host,
      port: head.port,
      close: () => {
        upstream.destroy();
        stream.destroy();
      },
    });
    let forgotten = false;
    const once = () => {
      if (forgotten) return;
      forgotten = true;
      forget();
    };
    stream.once("close", once);
    upstream.once("close", once);
    // Closed at once: the allow-list changed while this destination was being checked.
    if (stream.destroyed || upstream.destroyed) {
      upstream.destroy();
      stream.destroy();
      return;
    }
  }
  splice(stream, upstream, head);
}

/** Answers the proxy request and pipes the client and `upstream` together until either ends. */
function splice(stream: Duplex, upstream: Duplex, head: Head): void {
  upstream.on("error", () => stream.destroy());
  // The client gone: nothing can receive what the destination still sends.
  stream.on("close", () => upstream.destroy());
  // A destination that ENDED cleanly has its last bytes still queued towards the client (the
  // guest tunnel sends only as the guest grants credit): pipe() ends the client side after they
  // are flushed, and destroying it here would drop them (a truncated reply). Only a destination
  // that closed without ending (reset, aborted) takes the client side down at once.
  upstream.on("close", () => {
    if (!upstream.readableEnded) stream.destroy();
  });
  if (head.method === "CONNECT") stream.write("HTTP/1.1 200 Connection established\r\n\r\n");
  else upstream.write(head.forward!);
  if (head.rest.length > 0) upstream.write(head.rest);
  stream.pipe(upstream);
  upstream.pipe(stream);
  stream.resume();
}
