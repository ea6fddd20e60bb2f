/**
 * E2B's data plane, "envd" (docs/e2b.md "Data plane"): the `process.Process` and
 * `filesystem.Filesystem` Connect services (served with @connectrpc/connect's own handlers: Connect
 * JSON and binary, unary and server streaming over HTTP/1.1) and envd's plain HTTP routes
 * (`/health`, and those `ENVD_PLAIN_ROUTES` adds), on one sandbox named by the request
 * (`E2b-Sandbox-Id`/`E2b-Sandbox-Port` headers under `/e2b/envd`, or the host
 * `<port>-<id>.<domain>`). A port other than envd's reaches the guest's TCP port (ports.ts) under
 * the connect URLs' rules.
 *
 * Authentication (docs/e2b.md "Data plane authentication"): the sandbox's `X-Access-Token`
 * (envd-token.ts), or a sandboxd key (`X-API-KEY`, native or E2B form, or `Authorization: Bearer`);
 * then the key must still be live, the sandbox the key's tenant's, and the key under its rate
 * limit. `Authorization: Basic base64(<user>:)` is not a credential: it names the guest user.
 */
import { createConnectRouter, createContextValues } from "@connectrpc/connect";
import {
  universalServerRequestFromFetch,
  universalServerResponseToFetch,
} from "@connectrpc/connect/protocol";
import {
  codeToHttpStatus,
  contentTypeStreamJson,
  endStreamFlag,
  errorToJson,
} from "@connectrpc/connect/protocol-connect";
import { type Context, Hono, type MiddlewareHandler } from "hono";
import { Filesystem } from "../../../contracts/e2b/envd/filesystem_pb.ts";
import { Process } from "../../../contracts/e2b/envd/process_pb.ts";
import { E2B_ENVD_PORT, nativeKeyOf, sandboxIdOfE2b } from "../../../contracts/e2b/ids.ts";
import { SandboxdError } from "../../../contracts/errors.ts";
import { keyIsLive, type Principal } from "../../auth/keys.ts";
import { wakeIfIdle } from "../../core/idle.ts";
import { beginUse, getOwned } from "../../core/sandboxes.ts";
import type { Deps, HonoEnv } from "../../deps.ts";
import { verifyEnvdToken } from "../envd-token.ts";
import type { E2bMountDeps } from "../mount.ts";
import { envdFileRoutes } from "./files.ts";
import { filesystemService } from "./filesystem.ts";
import { proxyGuestPort } from "./ports.ts";
import { processService } from "./process.ts";
import {
  type EnvdEnv,
  type EnvdTarget,
  envdHttpError,
  SandboxUnreachable,
  targetKey,
  toConnectError,
} from "./target.ts";

export { type EnvdEnv, type EnvdTarget, targetOf } from "./target.ts";

/**
 * A Connect request body's bound, bytes: the largest message the SDK sends is a SendInput of a
 * few MiB (its stdin, base64 in JSON); 8 MiB covers a 4 MiB chunk (the agent's pending-stdin
 * bound) with JSON's overhead and refuses anything larger before it is held.
 */
export const ENVD_READ_MAX_BYTES = 8 * 1024 * 1024;
/**
 * The longest deadline a client may ask for (`Connect-Timeout-Ms`), ms: a day, E2B's longest
 * sandbox lifetime; a stream past it ends with `deadline_exceeded` (the process runs on).
 */
const ENVD_MAX_TIMEOUT_MS = 24 * 60 * 60 * 1000;
/**
 * How long a token's key is taken as live after a read, ms: the key cache's own short TTL
 * (auth/key-cache.ts KEY_CACHE_TTL_MS), so a revoked key's tokens stop within a second as the
 * key itself does; at most LIVE_CACHE_MAX keys are remembered (then the map starts over).
 */
const LIVE_CACHE_MS = 1000;
const LIVE_CACHE_MAX = 10_000;
/** A header naming a user is `Basic` and at most this long (a user name is at most 64 characters). */
const MAX_BASIC_CHARS = 256;

/** `E2b-Sandbox-Id` and `E2b-Sandbox-Port` of `c`: the sandbox's id (ours) and the port. */
function namedTarget(c: Context): { id: string; e2bId: string; port: number } {
  const e2bId = c.req.header("e2b-sandbox-id") ?? "";
  const rawPort = c.req.header("e2b-sandbox-port");
  const port = rawPort === undefined ? E2B_ENVD_PORT : /^[0-9]{1,5}$/.test(rawPort) ? Number(rawPort) : 0;
  if (port < 1 || port > 65535) throw new SandboxdError("bad_request", "E2b-Sandbox-Port is not a port");
  const id = sandboxIdOfE2b(e2bId);
  if (id === undefined) throw new SandboxUnreachable(e2bId.slice(0, 64));
  return { id, e2bId, port };
}

/** The user `Authorization: Basic base64(<user>:)` names, else undefined. */
function basicUser(header: string | undefined): string | undefined {
  if (header === undefined || header.length > MAX_BASIC_CHARS) return undefined;
  const m = /^Basic\s+([A-Za-z0-9+/=]+)$/i.exec(header.trim());
  if (!m) return undefined;
  const user = Buffer.from(m[1]!, "base64").toString("utf8").split(":", 1)[0] ?? "";
  return user === "" ? undefined : user;
}

/** Resolves and authenticates data-plane requests; one per mounted router (no globals). */
class Resolver {
  private readonly live = new Map<string, number>();

  constructor(
    private readonly deps: Deps,
    private readonly m: E2bMountDeps,
  ) {}

  private async keyLive(keyId: string): Promise<boolean> {
    const now = this.deps.clock();
    const at = this.live.get(keyId);
    if (at !== undefined && now - at < LIVE_CACHE_MS) return true;
    const live = await keyIsLive(this.deps.db, keyId);
    if (this.live.size >= LIVE_CACHE_MAX) this.live.clear();
    if (live) this.live.set(keyId, now);
    else this.live.delete(keyId);
    return live;
  }

  /** The caller: the access token, else an API key; 401 for none or a bad one. */
  private async principalOf(c: Context, sandboxId: string): Promise<Principal> {
    const unauthorized = new SandboxdError("unauthorized", "invalid or missing access token");
    const token = c.req.header("x-access-token");
    if (token !== undefined) {
      const p = await verifyEnvdToken(this.deps.config.connectSecret, token, sandboxId);
      if (p === undefined || !(await this.keyLive(p.keyId))) throw unauthorized;
      return p;
    }
    const auth = c.req.header("authorization");
    const bearer =
      auth !== undefined && /^Bearer\s+/i.test(auth) ? auth.replace(/^Bearer\s+/i, "").trim() : undefined;
    const presented = c.req.header("x-api-key") ?? bearer;
    if (presented === undefined) throw unauthorized;
    const key = nativeKeyOf(presented);
    const p = key === undefined ? null : await this.m.keys.verify(key);
    if (!p) throw new SandboxdError("unauthorized", "invalid API key");
    return p;
  }

  async resolve(c: Context): Promise<EnvdTarget> {
    const { id, e2bId, port } = namedTarget(c);
    const principal = await this.principalOf(c, id);
    await this.m.rateLimit.take(principal.keyId);
    const row = await getOwned(this.deps, principal, id).catch((err: unknown) => {
      throw err instanceof SandboxdError && (err.code === "not_found" || err.code === "gone")
        ? new SandboxUnreachable(e2bId)
        : err;
    });
    const user = basicUser(c.req.header("authorization"));
    return { principal, sandboxId: id, port, row, ...(user !== undefined ? { user } : {}) };
  }
}

/** E2B's proxy answer for a sandbox it cannot reach. */
function unreachable(e2bId: string): Response {
  return Response.json(
    { sandboxId: e2bId, message: "The sandbox was not found", code: 502 },
    { status: 502 },
  );
}

/**
 * An error before a handler ran, in the form the caller's client reads: for a Connect procedure
 * Connect's own (unary: the code's HTTP status and `{code, message}`; server streaming: 200 with
 * an end-of-stream frame carrying the error, which is how the SDK learns a stream's code), for
 * envd's HTTP routes and guest ports envd's JSON `{code, message}` with the status.
 */
export function envdErrorResponse(err: unknown, streaming: boolean | undefined): Response {
  if (err instanceof SandboxUnreachable) return unreachable(err.e2bId);
  if (streaming === undefined) return envdHttpError(err);
  const ce = toConnectError(err);
  if (!streaming) {
    return Response.json(errorToJson(ce, undefined), { status: codeToHttpStatus(ce.code) });
  }
  const json = new TextEncoder().encode(JSON.stringify({ error: errorToJson(ce, undefined) }));
  const frame = new Uint8Array(5 + json.length);
  frame[0] = endStreamFlag;
  new DataView(frame.buffer).setUint32(1, json.length);
  frame.set(json, 5);
  return new Response(frame, { status: 200, headers: { "content-type": contentTypeStreamJson } });
}

/**
 * `body` that calls `end` once, when it has been read to its end, failed or was cancelled (the
 * client gone): a call counted in flight lasts as long as its answer streams.
 */
export function endingWith(res: Response, end: () => void): Response {
  if (!res.body) {
    end();
    return res;
  }
  let ended = false;
  const once = () => {
    if (!ended) {
      ended = true;
      end();
    }
  };
  const reader = res.body.getReader();
  const body = new ReadableStream<Uint8Array>({
    async pull(ctl) {
      try {
        const { done, value } = await reader.read();
        if (done) {
          once();
          ctl.close();
        } else ctl.enqueue(value);
      } catch (err) {
        once();
        ctl.error(err);
      }
    },
    async cancel(reason) {
      once();
      // The client is gone; the upstream's own failure to cancel changes nothing for it.
      await reader.cancel(reason).catch(() => {});
    },
  });
  return new Response(body, { status: res.status, statusText: res.statusText, headers: res.headers });
}

/**
 * envd's plain HTTP routes, mounted before the Connect procedures: each gets the resolved target
 * as `c.get("envd")` and answers with envd's JSON errors. Another part of the data plane adds its
 * routes by adding its function here.
 */
const ENVD_PLAIN_ROUTES: Array<(deps: Deps, app: Hono<EnvdEnv>) => void> = [
  healthRoute,
  (deps, app) => app.route("/", envdFileRoutes(deps)),
];

/**
 * `GET /health`: 204 while the sandbox runs (or sleeps for idleness, which the next call wakes),
 * 502 otherwise: what the SDK's `isRunning` and its connection-lost probe read.
 */
function healthRoute(_deps: Deps, app: Hono<EnvdEnv>): void {
  app.get("/health", (c) => {
    const { row } = c.get("envd");
    const up =
      row.state === "running" ||
      (row.state === "suspended" && (row.suspendedBy === "idle" || row.suspendedBy === "timeout"));
    return up ? c.body(null, 204) : unreachable(row.id.replace(/^sbx_/, ""));
  });
}

export function envdRoutes(deps: Deps, m: E2bMountDeps): Hono<EnvdEnv> {
  const router = createConnectRouter({
    readMaxBytes: ENVD_READ_MAX_BYTES,
    maxTimeoutMs: ENVD_MAX_TIMEOUT_MS,
  });
  router.service(Process, processService(deps, m.envs));
  router.service(Filesystem, filesystemService(deps));
  const handlers = new Map(router.handlers.map((h) => [h.requestPath, h]));
  // The procedure a path names: its last two segments (the router is mounted under a prefix).
  const streamingOf = (path: string): boolean | undefined => {
    const h = handlers.get(/\/[^/]+\/[^/]+$/.exec(path)?.[0] ?? "");
    return h === undefined ? undefined : h.method.methodKind !== "unary";
  };
  const resolver = new Resolver(deps, m);

  const app = new Hono<EnvdEnv>();
  app.onError((err, c) => envdErrorResponse(err, streamingOf(c.req.path)));
  app.use("*", async (c, next) => {
    const streaming = c.req.method === "POST" ? streamingOf(c.req.path) : undefined;
    let target: EnvdTarget;
    try {
      target = await resolver.resolve(c);
    } catch (err) {
      return envdErrorResponse(err, streaming);
    }
    c.set("envd", target);
    if (target.port !== E2B_ENVD_PORT) {
      return proxyGuestPort(deps, target, c.req.raw).catch((err: unknown) =>
        envdErrorResponse(err, undefined),
      );
    }
    if (c.req.method === "GET" && c.req.path.endsWith("/health")) return next();
    // Every other call wakes a sandbox that sleeps for idleness and counts as a call in flight
    // until its answer has streamed to its end.
    let end: () => Promise<void>;
    try {
      await wakeIfIdle(deps, target.principal, target.sandboxId);
      const use = await beginUse(deps, target.principal, target.sandboxId);
      target.row = use.row;
      end = use.end;
    } catch (err) {
      return envdErrorResponse(err, streaming);
    }
    try {
      await next();
    } catch (err) {
      void end();
      throw err;
    }
    c.res = endingWith(c.res, () => void end());
  });
  for (const add of ENVD_PLAIN_ROUTES) add(deps, app);
  app.post("/:service/:method", async (c) => {
    const h = handlers.get(`/${c.req.param("service")}/${c.req.param("method")}`);
    if (!h)
      return envdErrorResponse(new SandboxdError("not_implemented", `no procedure ${c.req.path}`), false);
    const req = universalServerRequestFromFetch(c.req.raw, {});
    req.contextValues = createContextValues().set(targetKey, c.get("envd"));
    return universalServerResponseToFetch(await h(req));
  });
  app.all("*", () => Response.json({ code: 404, message: "not found" }, { status: 404 }));
  return app;
}

/** `<port>-<id>` of a host `<port>-<id>.<domain>[:port]`, else undefined. */
export function hostTarget(
  host: string | undefined,
  domain: string,
): { port: string; id: string } | undefined {
  if (host === undefined || host.length > 300) return undefined;
  const name = host.toLowerCase().replace(/:[0-9]+$/, "");
  const suffix = `.${domain}`;
  if (!name.endsWith(suffix)) return undefined;
  const m = /^([0-9]{1,5})-([a-z0-9-]{1,100})$/.exec(name.slice(0, -suffix.length));
  return m ? { port: m[1]!, id: m[2]! } : undefined;
}

/**
 * Requests to a host `<port>-<id>.<domain>` (`deps.config.e2bDomain`; X-Forwarded-Host first)
 * go to the data plane
 * whatever their path, the sandbox and port taken from the host (headers naming others are
 * replaced); any other host passes on. Without a domain configured nothing is routed by host.
 */
export function envdHostRouting(deps: Deps, envd: Hono<EnvdEnv>): MiddlewareHandler<HonoEnv> {
  return async (c, next) => {
    const domain = deps.config.e2bDomain;
    if (domain === undefined) return next();
    // Behind an edge or a reverse proxy the host the client asked for is X-Forwarded-Host (the
    // first, the client's). A client that sets it itself names a sandbox as the `E2b-Sandbox-Id`
    // header would: the call is authenticated the same way either way.
    const host = c.req.header("x-forwarded-host")?.split(",")[0]?.trim() || c.req.header("host");
    const t = hostTarget(host, domain);
    if (t === undefined) return next();
    const headers = new Headers(c.req.raw.headers);
    headers.set("e2b-sandbox-id", t.id);
    headers.set("e2b-sandbox-port", t.port);
    const req = new Request(c.req.raw, { headers });
    return envd.fetch(req, c.env);
  };
}
