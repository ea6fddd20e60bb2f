/**
 * E2B's data plane, "envd" (docs/e2b.md "Data plane"): the `process.Process` and
 * `filesystem.Filesystem` Connect services (served with @connectrpc/connect's own handlers: Connect
 * JSON and binary, unary and server streaming over HTTP/1.1) and `GET`/`POST /files`, on one
 * sandbox named by the request (`E2b-Sandbox-Id`/`E2b-Sandbox-Port` headers under `/e2b/envd`, or
 * the host `<port>-<id>.<domain>`). A port other than envd's reaches the guest's TCP port
 * (ports.ts) under the connect URLs' rules.
 */
import {
  Code,
  ConnectError,
  type ContextKey,
  createConnectRouter,
  createContextKey,
  createContextValues,
  type HandlerContext,
} from "@connectrpc/connect";
import {
  universalServerRequestFromFetch,
  universalServerResponseToFetch,
} from "@connectrpc/connect/protocol";
import { type Context, Hono, type MiddlewareHandler } from "hono";
import { Filesystem } from "../../../contracts/e2b/envd/filesystem_pb.ts";
import { Process } from "../../../contracts/e2b/envd/process_pb.ts";
import type { Principal } from "../../auth/keys.ts";
import type { Deps, HonoEnv } from "../../deps.ts";
import type { E2bMountDeps } from "../mount.ts";
import { envdFileRoutes } from "./files.ts";
import { filesystemService } from "./filesystem.ts";
import { processService } from "./process.ts";

/** The sandbox and caller a data-plane request acts for, resolved before any handler runs. */
export interface EnvdTarget {
  principal: Principal;
  /** sandboxd's id (`sbx_...`). */
  sandboxId: string;
  /** The port the request named: envd's (49983) or a guest TCP port. */
  port: number;
}

export type EnvdEnv = HonoEnv & { Variables: HonoEnv["Variables"] & { envd: EnvdTarget } };

const targetKey: ContextKey<EnvdTarget | undefined> = createContextKey<EnvdTarget | undefined>(undefined, {
  description: "the E2B data-plane target",
});

/** The request's target inside a Connect handler (set by `envdRoutes` for every call). */
export function targetOf(ctx: HandlerContext): EnvdTarget {
  const t = ctx.values.get(targetKey);
  if (!t) throw new ConnectError("no sandbox resolved for this call", Code.Internal);
  return t;
}

/** The sandbox and caller of `c`: headers or host, then the access token (TODO: the routing work). */
async function resolveTarget(_deps: Deps, _m: E2bMountDeps, _c: Context<HonoEnv>): Promise<EnvdTarget> {
  throw new ConnectError("the E2B data plane is not served yet", Code.Unimplemented);
}

export function envdRoutes(deps: Deps, m: E2bMountDeps): Hono<EnvdEnv> {
  const router = createConnectRouter();
  router.service(Process, processService(deps));
  router.service(Filesystem, filesystemService(deps, targetOf));
  const handlers = new Map(router.handlers.map((h) => [h.requestPath, h]));

  const app = new Hono<EnvdEnv>();
  app.use("*", async (c, next) => {
    c.set("envd", await resolveTarget(deps, m, c as unknown as Context<HonoEnv>));
    await next();
  });
  app.route("/", envdFileRoutes(deps));
  app.post("/:service/:method", async (c) => {
    const h = handlers.get(`/${c.req.param("service")}/${c.req.param("method")}`);
    if (!h) return c.json({ code: "unimplemented", message: `no procedure ${c.req.path}` }, 404);
    const req = universalServerRequestFromFetch(c.req.raw, {});
    req.contextValues = createContextValues().set(targetKey, c.get("envd"));
    return universalServerResponseToFetch(await h(req));
  });
  return app;
}

/**
 * Requests to a host `<port>-<id>.<domain>` go to the data plane whatever their path; any other
 * host passes on (TODO: the routing work).
 */
export function envdHostRouting(_deps: Deps, _envd: Hono<EnvdEnv>): MiddlewareHandler<HonoEnv> {
  return async (_c, next) => {
    await next();
  };
}
