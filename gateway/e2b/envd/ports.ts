/**
 * A guest's TCP port through E2B's data plane (docs/e2b.md "Guest ports"): a request whose target
 * port is not envd's is sent as HTTP/1.1 to that port in the guest, over a tunnel of the
 * sandbox's agent (`openTunnel`, the connect URLs' tunnel), one tunnel per request
 * (`Connection: close`). Both bodies stream; the guest's answer head is bounded.
 *
 * The rules are the connect URLs' (docs/connect.md): a Pro or Enterprise key (403
 * `demo_tier_limit` below), the caller's own sandbox (resolved before this), one of the tenant's
 * relay slots for as long as the answer streams (429 beyond), and the call counted in flight so
 * no reaper takes the sandbox mid-answer. Unlike a connect URL the port need not be exposed by the
 * template: every request here carries the sandbox's access token or a key, and E2B's templates
 * declare no ports. Nothing listening is 502 `port_unreachable`.
 */
import { request as httpRequest, type IncomingMessage } from "node:http";
import { Duplex, Readable } from "node:stream";
import { SandboxdError } from "../../../contracts/errors.ts";
import { requirePro } from "../../auth/guards.ts";
import { wakeIfIdle } from "../../core/idle.ts";
import { agentOf, beginUseOf, getOwned, inTermsOf } from "../../core/sandboxes.ts";
import type { Deps } from "../../deps.ts";
import type { EnvdTarget } from "./target.ts";

/**
 * The guest's answer head (status line and headers), bytes: 64 KiB, four times Node's default
 * and far above any real server's; a larger head is 502 rather than held.
 */
export const GUEST_HEAD_MAX_BYTES = 64 * 1024;
/**
 * How long the guest may take to send its answer head, ms: 5 minutes, longer than any proxy in
 * front of a gateway waits; a server that never answers does not hold a tunnel and a slot for ever.
 */
export const GUEST_HEAD_TIMEOUT_MS = 5 * 60 * 1000;

/** Headers of the hop, or of our own authentication: never sent to the guest. */
const DROPPED = new Set([
  "connection",
  "keep-alive",
  "proxy-connection",
  "transfer-encoding",
  "te",
  "trailer",
  "upgrade",
  "x-access-token",
  "x-api-key",
  "e2b-sandbox-id",
  "e2b-sandbox-port",
  "content-length",
]);

export async function proxyGuestPort(deps: Deps, t: EnvdTarget, req: Request): Promise<Response> {
  requirePro(t.principal, "guest ports");
  if (req.headers.get("upgrade") !== null) {
    throw new SandboxdError(
      "bad_request",
      "WebSocket upgrades to guest ports are not served here; use a connect URL",
    );
  }
  await wakeIfIdle(deps, t.principal, t.sandboxId);
  const row = await getOwned(deps, t.principal, t.sandboxId);
  const max = deps.config.limits.relaysPerTenant;
  const release = deps.relays ? deps.relays.reserve(row.tenantId, max) : () => {};
  if (!release) {
    throw new SandboxdError(
      "quota_exceeded",
      `this tenant already holds ${max} relays (connects, terminals, guest ports)`,
    );
  }
  let use: { end: () => Promise<void> };
  try {
    use = await beginUseOf(deps, t.principal, row, "connect");
  } catch (err) {
    release();
    throw err;
  }
  let done = false;
  const finish = () => {
    if (done) return;
    done = true;
    release();
    void use.end();
  };
  try {
    const tunnel = await inTermsOf(row, agentOf(deps, row).openTunnel(row.vmId!, t.port, "tcp"));
    const res = await exchange(tunnel, t.port, req, finish);
    return res;
  } catch (err) {
    finish();
    throw err;
  }
}

/** Sends `req` over `tunnel` and answers with the guest's response, its body streamed; `finish` once it ends. */
function exchange(
  tunnel: { readable: ReadableStream<Uint8Array>; writable: WritableStream<Uint8Array>; close(): void },
  port: number,
  req: Request,
  finish: () => void,
): Promise<Response> {
  const url = new URL(req.url);
  const headers: Record<string, string> = {};
  req.headers.forEach((v, k) => {
    if (DROPPED.has(k)) return;
    // A Bearer key authenticated this call: it is not the guest's to read.
    if (k === "authorization" && /^Bearer\s/i.test(v)) return;
    headers[k] = v;
  });
  headers.connection = "close";
  const body = req.body;
  return new Promise<Response>((resolve, reject) => {
    let settledHead = false;
    const cr = httpRequest({
      method: req.method,
      path: `${url.pathname}${url.search}`,
      headers: { ...headers, ...(body ? { "transfer-encoding": "chunked" } : { "content-length": "0" }) },
      maxHeaderSize: GUEST_HEAD_MAX_BYTES,
      setHost: false,
      createConnection: () => Duplex.fromWeb({ readable: tunnel.readable, writable: tunnel.writable }),
    });
    const timer = setTimeout(() => cr.destroy(new Error("no answer head in time")), GUEST_HEAD_TIMEOUT_MS);
    const fail = (err: Error) => {
      clearTimeout(timer);
      tunnel.close();
      finish();
      if (!settledHead) {
        settledHead = true;
        reject(new SandboxdError("port_unreachable", `port ${port} in the sandbox: ${err.message}`));
      }
    };
    cr.on("error", fail);
    req.signal.addEventListener("abort", () => cr.destroy(new Error("client gone")), { once: true });
    cr.on("response", (im: IncomingMessage) => {
      clearTimeout(timer);
      settledHead = true;
      const out = new Headers();
      for (let i = 0; i < im.rawHeaders.length; i += 2) {
        const k = im.rawHeaders[i]!;
        if (DROPPED.has(k.toLowerCase())) continue;
        out.append(k, im.rawHeaders[i + 1]!);
      }
      im.on("end", () => {
        tunnel.close();
        finish();
      });
      im.on("close", () => {
        tunnel.close();
        finish();
      });
      const noBody = req.method === "HEAD" || im.statusCode === 204 || im.statusCode === 304;
      resolve(
        new Response(noBody ? null : (Readable.toWeb(im) as ReadableStream<Uint8Array>), {
          status: im.statusCode ?? 502,
          headers: out,
        }),
      );
      if (noBody) im.resume();
    });
    if (body) Readable.fromWeb(body as never).pipe(cr);
    else cr.end();
  });
}
