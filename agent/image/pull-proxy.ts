/**
 * The registry pull's egress proxy: skopeo (skopeo.ts) runs in a network namespace of its own with
 * no route out, and every connection it makes (the registry, each redirect, the token realm)
 * arrives here through a unix socket (pull-forwarder.ts relays it out of the namespace). Each one
 * is checked by the egress fence (agent/egress/fence.ts) before a byte leaves the host:
 *
 *   CONNECT host:port            (HTTPS, and the forwarder's tunnel to a loopback registry)
 *   GET http://host:port/path    (plain HTTP: loopback and insecure registries, http redirects)
 *
 *   -> fence.check(host, port): the name resolved ONCE, every address checked
 *   -> fence.connect(d): TCP to the checked address itself (no second resolution: no DNS rebinding)
 *
 * A refused destination is answered 403 and recorded in `refused` with the fence's words: the
 * pull turns that record (not skopeo's text) into `registry_forbidden`. A plain-HTTP request is
 * one request per connection (`Connection: close` both ways), so every request is checked on its
 * own, never sent down a connection opened for another host.
 */
import { lookup } from "node:dns/promises";
import { createConnection, createServer, type Server, type Socket } from "node:net";
import { normalizeHost } from "../../contracts/egress.ts";
import { SandboxdError } from "../../contracts/errors.ts";

/** A checked destination: the address to connect to, or why it is refused (EgressFence's shape). */
export type ProxyDestination =
  | { ok: true; host: string; port: number; address: string; family: 4 | 6 }
  | { ok: false; reason: string };

/**
 * The fence a pull's proxy applies: the operator's registry fence (an EgressFence from
 * agent/egress/fence.ts, `SANDBOXD_REGISTRY_ALLOW_INTERNAL`), passed in by the agent.
 */
export interface ProxyFence {
  check(host: string, port: number): Promise<ProxyDestination>;
  connect(d: { address: string; port: number; family: 4 | 6 }): Promise<Socket>;
}

/**
 * A request or response head: a registry's request carries at most a bearer token of a few KB
 * (Docker Hub's JWTs are ~2 KB); 64 KiB holds any real one and bounds what we buffer per connection.
 */
export const MAX_HEAD_BYTES = 64 * 1024;
/**
 * Connections open at once: skopeo copies at most 6 layers in parallel, with a token fetch and a
 * manifest beside them; 32 leaves room for retries and bounds the sockets one registry can hold.
 */
export const MAX_OPEN_CONNECTIONS = 32;
/**
 * Connections over a whole pull: plain HTTP is one request per connection, and an image of even
 * a few hundred layers (each a blob GET, maybe with a redirect and a token fetch) stays far
 * under 4096; a registry that redirects in a loop is cut off here.
 */
export const MAX_CONNECTIONS_PER_PULL = 4096;
/**
 * No byte either way for a minute: the registry is stalled (INSPECT_TIMEOUT_MS in pull.ts makes
 * the same call for a manifest) and its sockets are closed rather than held until the pull's deadline.
 */
export const IDLE_TIMEOUT_MS = 60_000;
/** skopeo writes its whole request head at once; 10 s without it is not skopeo. */
export const HEAD_TIMEOUT_MS = 10_000;
/** How many refusals are kept for the pull's error: the first ones say why, the rest repeat it. */
const MAX_REFUSALS_KEPT = 16;

export interface PullProxy {
  /** The unix socket the forwarder in skopeo's namespace connects to. */
  socket: string;
  /** `host:port: the fence's reason` for each refused destination, in order (at most 16). */
  readonly refused: readonly string[];
  /** Connections accepted so far. */
  readonly connections: number;
  close(): Promise<void>;
}

/** No fence given (tests of the pull alone): every address allowed, still resolved once and pinned. */
const OPEN_FENCE: ProxyFence = {
  async check(host, port) {
    try {
      const [a] = await lookup(host, { all: true, verbatim: true });
      if (!a) return { ok: false, reason: `${host} does not resolve` };
      return { ok: true, host, port, address: a.address, family: a.family === 6 ? 6 : 4 };
    } catch (err) {
      return { ok: false, reason: `${host} does not resolve (${(err as Error).message})` };
    }
  },
  connect: (d) =>
    new Promise((ok, no) => {
      const s = createConnection({ host: d.address, port: d.port, family: d.family }, () => {
        s.off("error", no);
        ok(s);
      });
      s.once("error", no);
    }),
};

/** Starts the proxy on `socket` (a path in the pull's private work dir). */
export async function startPullProxy(o: {
  socket: string;
  fence?: ProxyFence;
  log?: (m: string) => void;
}): Promise<PullProxy> {
  const fence = o.fence ?? OPEN_FENCE;
  const log = o.log ?? (() => {});
  const refused: string[] = [];
  const open = new Set<Socket>();
  let total = 0;
  const server: Server = createServer((client) => {
    total++;
    if (open.size >= MAX_OPEN_CONNECTIONS || total > MAX_CONNECTIONS_PER_PULL) {
      client.end(answer(503, "too many connections for one pull"));
      return;
    }
    open.add(client);
    client.once("close", () => open.delete(client));
    client.on("error", () => client.destroy()); // skopeo went away: nothing to tell it
    serve(client, fence, (what, reason) => {
      log(`image: proxy refused ${what}: ${reason}`);
      if (refused.length < MAX_REFUSALS_KEPT) refused.push(`${what}: ${reason}`);
    }).catch((err) => {
      log(`image: proxy connection failed: ${(err as Error).message}`);
      client.destroy();
    });
  });
  await new Promise<void>((ok, fail) => {
    server.once("error", fail);
    server.listen(o.socket, () => ok());
  });
  return {
    socket: o.socket,
    refused,
    get connections() {
      return total;
    },
    close: () =>
      new Promise<void>((ok) => {
        for (const s of open) s.destroy();
        server.close(() => ok());
      }),
  };
}

function answer(status: number, text: string): string {
  const phrase =
    {
      403: "Forbidden",
      400: "Bad Request",
      431: "Request Header Fields Too Large",
      501: "Not Implemented",
      502: "Bad Gateway",
      503: "Service Unavailable",
    }[status] ?? "Error";
  const body = `sandboxd pull proxy: ${text}\n`;
  return `HTTP/1.1 ${status} ${phrase}\r\nContent-Type: text/plain\r\nContent-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`;
}

/** Reads a head (up to the blank line) from `s`; resolves it and the bytes after it. */
function readHead(s: Socket, timeoutMs: number): Promise<{ head: string; rest: Buffer }> {
  return new Promise((resolve, reject) => {
    let buf = Buffer.alloc(0);
    const done = (err?: Error, v?: { head: string; rest: Buffer }) => {
      clearTimeout(timer);
      s.off("data", onData);
      s.off("end", onEnd);
      s.pause();
      if (err) reject(err);
      else resolve(v!);
    };
    const timer = setTimeout(() => done(new Error(`no complete head within ${timeoutMs} ms`)), timeoutMs);
    const onEnd = () => done(new Error("the connection ended before its head"));
    const onData = (chunk: Buffer) => {
      buf = Buffer.concat([buf, chunk]);
      const end = buf.indexOf("\r\n\r\n");
      if (end >= 0 && end + 4 <= MAX_HEAD_BYTES) {
        done(undefined, { head: buf.subarray(0, end).toString("latin1"), rest: buf.subarray(end + 4) });
      } else if (buf.length > MAX_HEAD_BYTES) {
        done(new HeadTooLarge());
      }
    };
    s.on("data", onData);
    s.once("end", onEnd);
    s.resume();
  });
}

class HeadTooLarge extends Error {
  constructor() {
    super(`a head over ${MAX_HEAD_BYTES} bytes`);
  }
}

/** `host:port` of a CONNECT target (IPv6 in brackets); undefined when it is not one. */
export function parseAuthority(text: string): { host: string; port: number } | undefined {
  const m = /^(\[[0-9a-fA-F:.]+\]|[^:[\]/\s@]+):([0-9]{1,5})$/.exec(text);
  if (!m) return undefined;
  return { host: normalizeHost(m[1]!), port: Number(m[2]) };
}

const HOP_HEADERS =
  /^(connection|keep-alive|proxy-connection|proxy-authorization|proxy-authenticate|te|trailer|upgrade)$/i;

async function serve(
  client: Socket,
  fence: ProxyFence,
  refuse: (what: string, reason: string) => void,
): Promise<void> {
  let req: { head: string; rest: Buffer };
  try {
    req = await readHead(client, HEAD_TIMEOUT_MS);
  } catch (err) {
    client.end(answer(err instanceof HeadTooLarge ? 431 : 400, (err as Error).message));
    return;
  }
  const [line = "", ...headers] = req.head.split("\r\n");
  const [method = "", target = "", version = ""] = line.split(" ");
  if (!/^HTTP\/1\.[01]$/.test(version)) {
    client.end(answer(400, "not an HTTP/1 request"));
    return;
  }
  const parsed = destinationOf(method, target);
  if ("error" in parsed) {
    client.end(answer(400, parsed.error));
    return;
  }
  const { dest, path } = parsed;
  const what = `${dest.host.includes(":") ? `[${dest.host}]` : dest.host}:${dest.port}`;
  const d = await fence.check(dest.host, dest.port);
  if (!d.ok) {
    refuse(what, d.reason);
    client.end(answer(403, `${what} is not allowed`));
    return;
  }
  let upstream: Socket;
  try {
    upstream = await fence.connect(d);
  } catch (err) {
    client.end(answer(502, `${what} could not be reached (${(err as Error).message})`));
    return;
  }
  // A reset on one side resets the other; a close ENDS the other, which first writes what it
  // still buffers (destroying it would cut off the tail of a blob the registry sent and closed).
  upstream.on("error", () => client.destroy());
  client.on("close", () => upstream.end());
  upstream.on("close", () => {
    if (!client.writableEnded) client.end();
  });
  for (const s of [client, upstream]) {
    s.setTimeout(IDLE_TIMEOUT_MS, () => {
      client.destroy();
      upstream.destroy();
    });
  }
  if (method === "CONNECT") {
    client.write("HTTP/1.1 200 Connection Established\r\n\r\n");
    if (req.rest.length > 0) upstream.write(req.rest);
    client.pipe(upstream);
    upstream.pipe(client);
    client.resume();
    return;
  }
  await forwardOne(client, upstream, { method, path, headers, rest: req.rest, what });
}

/**
 * Plain HTTP: this one request, its body by Content-Length (a pull sends none), then the answer
 * with `Connection: close`, so skopeo sends its next request on a new, checked connection.
 */
async function forwardOne(
  client: Socket,
  upstream: Socket,
  r: { method: string; path: string; headers: string[]; rest: Buffer; what: string },
): Promise<void> {
  const { method, path, headers, what } = r;
  const kept = headers.filter((h) => !HOP_HEADERS.test(h.slice(0, h.indexOf(":")).trim()));
  if (kept.some((h) => /^transfer-encoding\s*:/i.test(h))) {
    upstream.destroy();
    client.end(answer(501, "a chunked request body is not forwarded"));
    return;
  }
  const length = Number(/^content-length\s*:\s*(\d+)\s*$/im.exec(kept.join("\n"))?.[1] ?? 0);
  upstream.write(`${method} ${path} HTTP/1.1\r\n${[...kept, "Connection: close"].join("\r\n")}\r\n\r\n`);
  let left = length;
  const body = (chunk: Buffer) => {
    if (left <= 0) return;
    const part = chunk.subarray(0, left);
    left -= part.length;
    upstream.write(part);
    if (left <= 0) client.off("data", body); // anything after the body is not forwarded
  };
  body(r.rest);
  if (left > 0) client.on("data", body);
  client.resume();
  let res: { head: string; rest: Buffer };
  try {
    res = await readHead(upstream, IDLE_TIMEOUT_MS);
  } catch (err) {
    upstream.destroy();
    client.end(answer(502, `${what} sent no valid answer (${(err as Error).message})`));
    return;
  }
  const [status = "", ...resHeaders] = res.head.split("\r\n");
  const out = resHeaders.filter((h) => !HOP_HEADERS.test(h.slice(0, h.indexOf(":")).trim()));
  client.write(`${status}\r\n${[...out, "Connection: close"].join("\r\n")}\r\n\r\n`);
  if (res.rest.length > 0) client.write(res.rest);
  upstream.pipe(client);
  upstream.resume();
}

/** Where a proxy request goes: CONNECT's host:port, or an absolute http:// URL's host and path. */
function destinationOf(
  method: string,
  target: string,
): { dest: { host: string; port: number }; path: string } | { error: string } {
  if (method === "CONNECT") {
    const a = parseAuthority(target);
    return a ? { dest: a, path: "" } : { error: "CONNECT needs host:port" };
  }
  let url: URL;
  try {
    url = new URL(target);
  } catch {
    return { error: "a proxy request needs an absolute http:// URL" };
  }
  if (url.protocol !== "http:" || url.username || url.password)
    return { error: "a proxy request needs an absolute http:// URL" };
  return {
    dest: { host: normalizeHost(url.hostname), port: url.port ? Number(url.port) : 80 },
    path: `${url.pathname}${url.search}`,
  };
}

/** A pull whose proxy refused a destination: the tenant's reason, the fence's words kept as cause. */
export function proxyRefusal(what: string, refused: readonly string[], cause: unknown): SandboxdError {
  return new SandboxdError(
    "image_pull_failed",
    `${what} failed: the registry sent the pull to an address that is not allowed`,
    {
      cause: new SandboxdError("forbidden", `pull proxy refused ${refused.join("; ")}`, { cause }),
      details: { reason: "registry_forbidden" },
    },
  );
}
