/**
 * Sandboxes of the sandboxes API (docs/sandboxes.md "Rules of the sandboxes API"): create, list, info, exec, fork, suspend, resume, delete, one
 * sub-app mounted at `/v1/sandboxes` behind the key middleware; every route needs a sandboxes API
 * key. Connecting from outside is in connect.ts, files, processes and terminals in their own.
 */
import { type Context, Hono } from "hono";
import type { ExecResult } from "../../contracts/agent/api.ts";
import * as B from "../../contracts/api/sandboxes-api.ts";
import { requireApiMw } from "../auth/guards.ts";
import type { Principal } from "../auth/keys.ts";
import { idleInfo, wakeIfIdle } from "../core/idle.ts";
import { lifetimeInfo, setSandboxTimeout } from "../core/lifetimes.ts";
import {
  ages,
  type CreateInput,
  createVm,
  destroyVm,
  execIn,
  forkVm,
  getOwned,
  type IdleLifetime,
  listOwned,
  publicEndpoints,
  resumeVm,
  suspendVm,
} from "../core/sandboxes.ts";
import { type Deps, type HonoEnv, holdForKey } from "../deps.ts";
import { jsonBody } from "../http.ts";
import { sandboxExecAction } from "./exec-actions.ts";
import { sseExec, wantsEventStream } from "./exec-sse.ts";

type State = "running" | "suspended";
const publicState = (s: string): State => (s === "suspended" ? "suspended" : "running");

/**
 * The idle lifetime a new sandbox gets: the one asked for (`suspend` unless `idle_action` says
 * otherwise), else the operator's default (`SANDBOXD_IDLE_TIMEOUT`, with the request's action or
 * the operator's), else none.
 */
function idleLifetime(deps: Deps, req: B.CreateSandboxRequest): IdleLifetime {
  const limits = deps.config.limits;
  if (req.idle_timeout_seconds !== undefined) {
    return { timeoutS: req.idle_timeout_seconds, action: req.idle_action ?? "suspend" };
  }
  if (limits.idleTimeoutS > 0) {
    return { timeoutS: limits.idleTimeoutS, action: req.idle_action ?? limits.idleAction };
  }
  return { timeoutS: null, action: null };
}

/**
 * `POST /v1/sandboxes`, and `POST /v1/sessions` for a sandboxes API key (alias, docs/sandboxes.md "Rules of the sandboxes API"): the
 * caller has checked the key's API.
 */
export async function createSandbox(deps: Deps, c: Context<HonoEnv>) {
  const p = c.get("principal");
  const req = await jsonBody(c, B.CreateSandboxRequest, deps.config.limits.maxJsonBodyBytes);
  const labels = { ...req.labels };
  if (req.label !== undefined) labels.label = req.label;
  const input: CreateInput = { templateId: req.template, labels, idle: idleLifetime(deps, req) };
  // The absolute lifetime: none unless asked for; its action `delete` unless `on_timeout` says
  // (kept alone too: a later `POST .../timeout` without one uses it).
  if (req.timeout_seconds !== undefined || req.on_timeout !== undefined) {
    input.lifetime = { timeoutS: req.timeout_seconds ?? null, onTimeout: req.on_timeout ?? "delete" };
  }
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

async function sandboxInfo(deps: Deps, c: Context<HonoEnv>) {
  const row = await getOwned(deps, c.get("principal"), c.req.param("id") ?? "", { cached: true });
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
    ...idleInfo(row),
    ...lifetimeInfo(row),
  });
}

/** `POST /v1/sandboxes/{id}/exec`: as JSON, or as server-sent events when the client asks. */
async function execInSandbox(deps: Deps, c: Context<HonoEnv>, p: Principal) {
  const id = c.req.param("id") ?? "";
  const req = await jsonBody(c, B.ExecRequestB, deps.config.limits.maxJsonBodyBytes);
  await wakeIfIdle(deps, p, id);
  const action = sandboxExecAction(deps, req);
  const toBody = (r: ExecResult) => {
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
    if (r.truncated) body.truncated = true;
    return body;
  };
  if (wantsEventStream(c.req.header("accept"))) {
    return sseExec(
      c.req.raw.signal,
      (o) => execIn(deps, p, id, action, o),
      toBody,
      (conn) => holdForKey(deps, p.keyId, conn),
    );
  }
  return c.json(toBody(await execIn(deps, p, id, action)));
}

/** Mounted at `/v1/sandboxes`. */
export function sandboxRoutes(deps: Deps): Hono<HonoEnv> {
  const app = new Hono<HonoEnv>();
  const only = requireApiMw("sandboxes");
  const max = () => deps.config.limits.maxJsonBodyBytes;

  app.post("/", only, (c) => createSandbox(deps, c));

  app.get("/", only, async (c) => {
    const rows = await listOwned(deps, c.get("principal"));
    return c.json({
      sandboxes: rows.map((r) => ({ id: r.id, template: r.templateId, state: publicState(r.state) })),
    });
  });

  app.get("/:id", only, (c) => sandboxInfo(deps, c));

  app.post("/:id/exec", only, (c) => execInSandbox(deps, c, c.get("principal")));

  app.post("/:id/fork", only, async (c) => {
    const p = c.get("principal");
    const req = await jsonBody(c, B.ForkRequest, max());
    await wakeIfIdle(deps, p, c.req.param("id"));
    const { parent, children } = await forkVm(deps, p, c.req.param("id"), req.count ?? 1, req.labels ?? []);
    return c.json({
      parent: parent.id,
      children: children.map((ch) => ({ id: ch.id, endpoints: publicEndpoints(ch.id, ch.vm.endpoints) })),
    });
  });

  app.post("/:id/suspend", only, async (c) => {
    const id = c.req.param("id");
    const r = await suspendVm(deps, c.get("principal"), id);
    return c.json({ id, state: "suspended" as const, mem_bytes: r.memBytes });
  });

  app.post("/:id/resume", only, async (c) => {
    const id = c.req.param("id");
    const r = await resumeVm(deps, c.get("principal"), id);
    return c.json({ id, state: "running" as const, mem_bytes: r.memBytes });
  });

  app.post("/:id/timeout", only, async (c) => {
    const req = await jsonBody(c, B.SetTimeoutRequest, max());
    const row = await setSandboxTimeout(
      deps,
      c.get("principal"),
      c.req.param("id"),
      req.timeout_seconds,
      req.on_timeout,
    );
    const info = lifetimeInfo(row);
    return c.json({
      id: row.id,
      timeout_seconds: req.timeout_seconds,
      on_timeout: info.on_timeout ?? "delete",
      ...(info.expires_at !== undefined ? { expires_at: info.expires_at } : {}),
    });
  });

  app.delete("/:id", only, async (c) => {
    const row = await getOwned(deps, c.get("principal"), c.req.param("id"));
    await destroyVm(deps, row, { force: true, reason: "deleted" });
    return c.json({ deleted: true as const, id: row.id });
  });
  return app;
}
