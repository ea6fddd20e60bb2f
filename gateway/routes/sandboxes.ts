/** Family B sandboxes (spec 4.2): create, list, info, exec, fork, connect, suspend, resume, delete. */
import type { Context, Hono } from "hono";
import * as B from "../../contracts/api/family-b.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import type { ExecAction } from "../agent-api.ts";
import { signConnectToken, verifyConnectToken } from "../connect-token.ts";
import {
  ages,
  createVm,
  destroyVm,
  execIn,
  forkVm,
  getOwned,
  listOwned,
  resumeVm,
  suspendVm,
} from "../core/sandboxes.ts";
import type { Deps, HonoEnv } from "../deps.ts";
import { jsonBody, query } from "../http.ts";
import type { Principal } from "../keys.ts";
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
      endpoints: vm.endpoints,
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
      children: children.map((ch) => ({ id: ch.id, endpoints: ch.vm.endpoints })),
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
    const expSecs = Math.floor(deps.clock() / 1000) + ttl;
    const t = signConnectToken(deps.config.connectSecret, {
      tenantId: p.tenantId,
      sandboxId: row.id,
      port: req.port,
      protocol,
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
 * `GET /v1/sandboxes/{id}/connect`: authorised by a Bearer key (checked by the auth middleware,
 * which lets a request with `t` through unauthenticated) or by the scoped token `t`.
 * All checks (token, tier, ownership, port, state) are done here. The WebSocket relay itself is
 * not wired yet: it needs the Bun server's upgrade hook and the agent's `openTunnel`.
 */
export async function connectCheck(deps: Deps, c: Context<HonoEnv>, principal: Principal | undefined) {
  const id = c.req.param("id") ?? "";
  const q = query(c, B.ConnectQuery);
  const protocol = q.protocol ?? "tcp";
  let row: Awaited<ReturnType<typeof getOwned>>;
  if (principal) {
    requirePro(principal, "connect");
    row = await getOwned(deps, principal, id);
  } else {
    const unauthorized = new SandboxdError("unauthorized", "invalid or expired connect token");
    if (q.t === undefined) throw new SandboxdError("unauthorized", "missing API key or connect token");
    const found = await deps.db.query.sandboxes.findFirst({ where: (s, { eq }) => eq(s.id, id) });
    if (found?.family !== "b") throw unauthorized;
    const ok = verifyConnectToken(deps.config.connectSecret, q.t, {
      tenantId: found.tenantId,
      sandboxId: id,
      port: q.port,
      protocol,
      nowSecs: Math.floor(deps.clock() / 1000),
    });
    if (!ok) throw unauthorized;
    // Deleted sandboxes revoke their tokens (spec 4.2): getOwned refuses destroyed records.
    row = await getOwned(deps, { tenantId: found.tenantId, keyId: "", tier: "pro", family: "b" }, id);
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
  throw new SandboxdError("internal", "WebSocket tunnelling is not available in this build");
}
