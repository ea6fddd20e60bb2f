/** Family A: one-shot exec, batch, sessions (spec 4.1). Handlers parse into actions, nothing else. */
import { randomUUID } from "node:crypto";
import type { Context, Hono } from "hono";
import type { z } from "zod";
import type { ExecAction, ExecResult } from "../../contracts/agent/api.ts";
import * as A from "../../contracts/api/family-a.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { ages, createVm, destroyVm, execIn, forkVm, getOwned, listOwned } from "../core/sandboxes.ts";
import { requireReady, resolveTemplate } from "../core/templates.ts";
import type { Deps, HonoEnv } from "../deps.ts";
import { jsonBody, query } from "../http.ts";
import { requireFamily } from "./guards.ts";

export function timeoutMs(deps: Deps, seconds: number | undefined): number {
  const s = seconds ?? deps.config.limits.defaultExecTimeoutS;
  const max = deps.config.limits.maxExecTimeoutS;
  if (s > max) throw new SandboxdError("bad_request", `timeout_seconds ${s} is over the maximum of ${max}`);
  return s * 1000;
}

function resultA(id: string, r: ExecResult, forkTimeMs: number): z.infer<typeof A.ExecResultA> {
  return {
    id,
    stdout: r.stdout,
    stderr: r.stderr,
    exit_code: r.exitCode,
    fork_time_ms: forkTimeMs,
    exec_time_ms: r.execTimeMs,
    total_time_ms: r.totalTimeMs,
  };
}

async function oneShot(
  deps: Deps,
  tenantId: string,
  req: A.ExecRequestA,
): Promise<z.infer<typeof A.ExecResultA>> {
  const template = await resolveTemplate(deps, tenantId, req.template_id);
  requireReady(template);
  const action: ExecAction = {
    files: [],
    run: { kind: "code", code: req.code },
    timeoutMs: timeoutMs(deps, req.timeout_seconds),
  };
  const r = await deps.agent.execOnce(template.agentRef, action);
  return resultA(randomUUID(), r, r.forkTimeMs);
}

export function sessionExecAction(deps: Deps, req: A.SessionExecRequest): ExecAction {
  return {
    files: req.files ?? [],
    run:
      req.code !== undefined
        ? { kind: "code", code: req.code }
        : req.commands !== undefined
          ? { kind: "argv", commands: req.commands }
          : { kind: "none" },
    timeoutMs: timeoutMs(deps, req.timeout_seconds),
  };
}

/** `POST /v1/sessions` for a Family A key (the path is shared; app.ts dispatches). */
export async function createSessionA(deps: Deps, c: Context<HonoEnv>) {
  const p = c.get("principal");
  const req = await jsonBody(c, A.CreateSessionRequest, deps.config.limits.maxJsonBodyBytes);
  const { row, vm } = await createVm(deps, p, "session", { templateId: req.template_id, labels: {} });
  return c.json(
    {
      session_id: row.id,
      template_id: row.templateId,
      fork_time_ms: vm.forkTimeMs,
      create_time_ms: vm.createTimeMs,
    },
    201,
  );
}

export function registerFamilyA(app: Hono<HonoEnv>, deps: Deps): void {
  const max = () => deps.config.limits.maxJsonBodyBytes;

  app.post("/v1/exec", async (c) => {
    const p = c.get("principal");
    requireFamily(p, "a");
    const req = await jsonBody(c, A.ExecRequestA, max());
    return c.json(await oneShot(deps, p.tenantId, req));
  });

  app.post("/v1/exec/batch", async (c) => {
    const p = c.get("principal");
    requireFamily(p, "a");
    const req = await jsonBody(c, A.BatchExecRequest, max());
    const cap = deps.config.limits.maxBatchExecutions;
    if (req.executions.length > cap) {
      throw new SandboxdError(
        "bad_request",
        `batch has ${req.executions.length} executions; the maximum is ${cap}`,
      );
    }
    // Validate every item's timeout before starting any VM.
    for (const e of req.executions) timeoutMs(deps, e.timeout_seconds);
    const results = await Promise.all(req.executions.map((e) => oneShot(deps, p.tenantId, e)));
    return c.json({ results });
  });

  app.get("/v1/sessions", async (c) => {
    const p = c.get("principal");
    requireFamily(p, "a");
    const now = deps.clock();
    const rows = await listOwned(deps, p);
    return c.json({
      sessions: rows.map((r) => ({
        session_id: r.id,
        idle_secs: ages(r, now).idleSecs,
        exec_count: r.execCount,
      })),
    });
  });

  app.get("/v1/sessions/:id", async (c) => {
    const p = c.get("principal");
    requireFamily(p, "a");
    const row = await getOwned(deps, p, c.req.param("id"));
    const a = ages(row, deps.clock());
    return c.json({
      session_id: row.id,
      template_id: row.templateId,
      age_secs: a.ageSecs,
      idle_secs: a.idleSecs,
      exec_count: row.execCount,
    });
  });

  app.post("/v1/sessions/:id/exec", async (c) => {
    const p = c.get("principal");
    requireFamily(p, "a");
    const id = c.req.param("id");
    const req = await jsonBody(c, A.SessionExecRequest, max());
    const r = await execIn(deps, p, id, sessionExecAction(deps, req));
    return c.json(resultA(id, r, 0));
  });

  app.post("/v1/sessions/:id/fork", async (c) => {
    const p = c.get("principal");
    requireFamily(p, "a");
    // The request body is not specified (spec 4.1); any body is ignored, one child per call.
    const { children } = await forkVm(deps, p, c.req.param("id"), 1, []);
    const child = children[0]!;
    return c.json({ session_id: child.id, fork_time_ms: child.vm.forkTimeMs }, 201);
  });

  app.delete("/v1/sessions/:id", async (c) => {
    const p = c.get("principal");
    requireFamily(p, "a");
    const q = query(c, A.DeleteSessionQuery);
    const row = await getOwned(deps, p, c.req.param("id"));
    await destroyVm(deps, row, { force: q.force ?? false, reason: "deleted" });
    return c.body(null, 204);
  });
}
