/** Family B sandboxes (spec 4.2): create, list, info, exec, fork, connect, suspend, resume, delete. */
import type { Context, Hono } from "hono";
import type { ExecAction } from "../../contracts/agent/api.ts";
import * as B from "../../contracts/api/family-b.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { signConnectToken, verifyConnectToken } from "../connect-token.ts";
import {
  agentOf,
  ages,
  createVm,
  destroyVm,
  execIn,
  forkVm,
  getOwned,
  inTermsOf,
  listOwned,
  publicEndpoints,
  resumeVm,
  type SandboxRow,
  suspendVm,
} from "../core/sandboxes.ts";
import type { Deps, HonoEnv } from "../deps.ts";
import { jsonBody, query } from "../http.ts";
import type { Principal } from "../keys.ts";
import { CdpRelay, connectDevTools } from "../relay/cdp.ts";
import { TcpRelay } from "../relay/tcp.ts";
import { timeoutMs } from "./family-a.ts";
import { requireFamily, requirePro } from "./guards.ts";

type State = "running" | "suspended";
const publicState = (s: string): State => (s === "suspended" ? "suspended" : "running");

/** `POST /v1/sandboxes`, and `POST /v1/sessions` for a Family B key (alias, spec 4.2). */
export async function createSandboxB(deps: Deps, c: Context<HonoEnv>) {
  const p = c.get("principal");
  requireFamily(p, "b");
  const req = await jsonBody(c, B.CreateSandboxRequest, deps.config.limits.maxJsonBodyBytes);
  const labels = { ...req.labels };
  if (req.label !== undefined) labels.label = req.label;
  const input: { templateId: string; labels: Record<string, string>; egressAllow?: string[] } = {
    templateId: req.template,
    labels,
  };
  if (req.egress !== undefined) input.egressAllow = req.egress.allow;
  const { row, vm } = await createVm(deps, p, "sandbox", input);
  return c.json(
    {
      id: row.id,
      template: row.templateId,
      state: "running" as const,
      fork_time_ms: vm.forkTimeMs,
      create_time_ms: vm.createTimeMs,
      endpoints: row.endpoints,
    },
    201,
  );
}

function execAction(deps: Deps, req: B.ExecRequestB): ExecAction {
  const action: ExecAction = {
    files: req.files ?? [],
    run:
      req.command !== undefined
        ? { kind: "shell", command: req.command }
        : req.commands !== undefined
          ? { kind: "argv", commands: req.commands }
          : { kind: "none" },
    timeoutMs: timeoutMs(deps, req.timeout_seconds),
  };
  if (req.seed !== undefined) action.seed = req.seed;
  return action;
}

export function registerSandboxes(app: Hono<HonoEnv>, deps: Deps): void {
  const max = () => deps.config.limits.maxJsonBodyBytes;

  app.post("/v1/sandboxes", (c) => createSandboxB(deps, c));

  app.get("/v1/sandboxes", async (c) => {
    const p = c.get("principal");
    requireFamily(p, "b");
    const rows = await listOwned(deps, p);
    return c.json({
      sandboxes: rows.map((r) => ({ id: r.id, template: r.templateId, state: publicState(r.state) })),
    });
  });

  app.get("/v1/sandboxes/:id", async (c) => {
    const p = c.get("principal");
    requireFamily(p, "b");
    const row = await getOwned(deps, p, c.req.param("id"));
    const a = ages(row, deps.clock());
    return c.json({
      id: row.id,
      template: row.templateId,
      state: publicState(row.state),
      age_secs: a.ageSecs,
      idle_secs: a.idleSecs,
      exec_count: row.execCount,
      labels: row.labels,
      endpoints: row.endpoints,
    });
  });

  app.post("/v1/sandboxes/:id/exec", async (c) => {
    const p = c.get("principal");
    requireFamily(p, "b");
    const id = c.req.param("id");
    const req = await jsonBody(c, B.ExecRequestB, max());
    const r = await execIn(deps, p, id, execAction(deps, req));
    const body: Record<string, unknown> = {
      id,
      stdout: r.stdout,
      stderr: r.stderr,
      exit_code: r.exitCode,
      fork_time_ms: 0,
      exec_time_ms: r.execTimeMs,
      total_time_ms: r.totalTimeMs,
    };
    if (req.seed !== undefined) body.seed = req.seed;
    if (r.seedAck !== undefined) body.seed_ack = r.seedAck;
    return c.json(body);
  });

  app.post("/v1/sandboxes/:id/fork", async (c) => {
    const p = c.get("principal");
    requireFamily(p, "b");
    const req = await jsonBody(c, B.ForkRequest, max());
    const { parent, children } = await forkVm(deps, p, c.req.param("id"), req.count ?? 1, req.labels ?? []);
    return c.json({
      parent: parent.id,
      children: children.map((ch) => ({ id: ch.id, endpoints: publicEndpoints(ch.id, ch.vm.endpoints) })),
    });
  });

  app.post("/v1/sandboxes/:id/connect-url", async (c) => {
    const p = c.get("principal");
    requirePro(p, "connect URLs");
    const req = await jsonBody(c, B.ConnectUrlRequest, max());
    const row = await getOwned(deps, p, c.req.param("id"));
    if (!Object.hasOwn(row.endpoints, String(req.port))) {
      throw new SandboxdError(
        "port_not_exposed",
        `port ${req.port} is not exposed by template ${row.templateId}`,
      );
    }
    const ttl = Math.min(req.ttl_seconds, deps.config.limits.connectTtlMaxS); // clamp, spec 4.2
    const protocol = req.protocol ?? "tcp";
    const nowSecs = Math.floor(deps.clock() / 1000);
    const expSecs = nowSecs + ttl;
    const t = await signConnectToken(deps.config.connectSecret, {
      tenantId: p.tenantId,
      sandboxId: row.id,
      port: req.port,
      protocol,
      nowSecs,
      expSecs,
    });
    const base = new URL(deps.config.publicBaseUrl);
    base.protocol = base.protocol === "http:" ? "ws:" : "wss:";
    const url = `${base.origin}/v1/sandboxes/${row.id}/connect?port=${req.port}&protocol=${protocol}&t=${encodeURIComponent(t)}`;
    return c.json({ url, expires_at: new Date(expSecs * 1000).toISOString() });
  });

  app.post("/v1/sandboxes/:id/suspend", async (c) => {
    const p = c.get("principal");
    requireFamily(p, "b");
    const id = c.req.param("id");
    const r = await suspendVm(deps, p, id);
    return c.json({ id, state: "suspended" as const, mem_bytes: r.memBytes });
  });

  app.post("/v1/sandboxes/:id/resume", async (c) => {
    const p = c.get("principal");
    requireFamily(p, "b");
    const id = c.req.param("id");
    const r = await resumeVm(deps, p, id);
    return c.json({ id, state: "running" as const, mem_bytes: r.memBytes });
  });

  app.delete("/v1/sandboxes/:id", async (c) => {
    const p = c.get("principal");
    requireFamily(p, "b");
    const row = await getOwned(deps, p, c.req.param("id"));
    await destroyVm(deps, row, { force: true, reason: "deleted" });
    return c.json({ deleted: true as const, id: row.id });
  });
}

/**
 * `GET /v1/sandboxes/{id}/connect` (spec 4.2): authorised by a Bearer key (checked by the auth
 * middleware, which lets a request with `t` and no key through) or by the scoped token `t`. Every
 * check (token, tier, ownership, port, state, that it is a WebSocket upgrade) runs before the
 * upgrade, as does opening the tunnel, so that those failures are HTTP statuses; after the
 * upgrade, failures close the WebSocket (gateway/relay/common.ts has the codes).
 */
export async function connect(deps: Deps, c: Context<HonoEnv>, principal: Principal | undefined) {
  const id = c.req.param("id") ?? "";
  const q = query(c, B.ConnectQuery);
  const protocol = q.protocol ?? "tcp";
  let row: SandboxRow;
  if (principal) {
    requirePro(principal, "connect");
    row = await getOwned(deps, principal, id);
  } else {
    const unauthorized = new SandboxdError("unauthorized", "invalid or expired connect token");
    if (q.t === undefined) throw new SandboxdError("unauthorized", "missing API key or connect token");
    const tenantId = await verifyConnectToken(deps.config.connectSecret, q.t, {
      sandboxId: id,
      port: q.port,
      protocol,
      nowMs: deps.clock(),
    });
    if (tenantId === undefined) throw unauthorized;
    // Deleting a sandbox revokes its tokens (spec 4.2): getOwned accepts only a live record of
    // the token's tenant, and a revoked token is an invalid credential (401), not a 404.
    row = await getOwned(deps, { tenantId, keyId: "", tier: "pro", family: "b" }, id).catch(
      (err: unknown) => {
        throw err instanceof SandboxdError && err.code === "not_found" ? unauthorized : err;
      },
    );
  }
  if (!Object.hasOwn(row.endpoints, String(q.port))) {
    throw new SandboxdError(
      "port_not_exposed",
      `port ${q.port} is not exposed by template ${row.templateId}`,
    );
  }
  if (row.state !== "running") throw new SandboxdError("conflict", `sandbox ${id} is ${row.state}`);
  if (c.req.header("upgrade")?.toLowerCase() !== "websocket") {
    throw new SandboxdError("bad_request", "this endpoint needs a WebSocket upgrade");
  }
  const upgrade = c.env?.upgrade;
  if (!upgrade) throw new SandboxdError("internal", "this server cannot upgrade to a WebSocket");

  const agent = agentOf(deps, row);
  const dial = () => agent.openTunnel(row.vmId!, q.port, "tcp");
  const tunnel = await inTermsOf(row, dial());
  let relay: TcpRelay | CdpRelay;
  if (protocol === "tcp") {
    relay = new TcpRelay(tunnel);
  } else {
    // The guest's DevTools port through tcp tunnels; failures from here on close the WebSocket.
    const upstream = await connectDevTools(tunnel, dial, q.port).catch((err: unknown) =>
      err instanceof Error ? err : new Error(String(err)),
    );
    relay = new CdpRelay(upstream);
  }
  if (deps.relays) relay.registered(deps.relays.add(row.id, relay));
  try {
    return upgrade(relay);
  } catch (err) {
    relay.close(1011, "upgrade failed");
    throw err;
  }
}
