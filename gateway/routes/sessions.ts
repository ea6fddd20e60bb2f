/**
 * The sessions API: one-shot exec and batch (`execRoutes`, mounted at `/v1/exec`) and sessions
 * (`sessionRoutes`, at `/v1/sessions`) (docs/sessions.md "Rules of the sessions API"), behind the key middleware; every route needs a
 * sessions API key but `POST /v1/sessions`, which a sandboxes API key may call too. Each handler
 * parses the request, makes the typed action, calls the core and shapes the answer.
 */
import { randomUUID } from "node:crypto";
import { type Context, Hono } from "hono";
import type { z } from "zod";
import type { ExecResult } from "../../contracts/agent/api.ts";
import { DEFAULT_LIST_LIMIT } from "../../contracts/api/limits.ts";
import * as A from "../../contracts/api/sessions-api.ts";
import { describeError, SandboxdError } from "../../contracts/errors.ts";
import { requireApiMw } from "../auth/guards.ts";
import type { Principal } from "../auth/keys.ts";
import {
  ages,
  createVm,
  destroyVm,
  execIn,
  execOneShots,
  forkVm,
  getOwned,
  listOwnedPage,
} from "../core/sandboxes.ts";
import { requireReady, resolveTemplate } from "../core/templates.ts";
import { type Deps, type HonoEnv, holdForKey } from "../deps.ts";
import { mapError } from "../errors.ts";
import { jsonBody, query } from "../http.ts";
import { oneShotAction, sessionExecAction, timeoutMs } from "./exec-actions.ts";
import { sseExec, wantsEventStream } from "./exec-sse.ts";
import { createSandbox } from "./sandboxes.ts";

function resultA(id: string, r: ExecResult, forkTimeMs: number): z.infer<typeof A.ExecResultA> {
  return {
    id,
    stdout: r.stdout,
    stderr: r.stderr,
    exit_code: r.exitCode,
    fork_time_ms: forkTimeMs,
    exec_time_ms: r.execTimeMs,
    total_time_ms: r.totalTimeMs,
    ...(r.truncated ? { truncated: true as const } : {}),
  };
}

/** One one-shot exec (`POST /v1/exec`), counted and metered by the core (execOneShots). */
async function oneShot(deps: Deps, p: Principal, req: A.ExecRequestA): Promise<A.ExecResultA> {
  const template = await resolveTemplate(deps, p.tenantId, req.template_id);
  requireReady(template);
  const [outcome] = await execOneShots(deps, p, [{ template, action: oneShotAction(deps, req) }]);
  if (!outcome!.ok) throw outcome!.error;
  return resultA(randomUUID(), outcome!.result, outcome!.result.forkTimeMs);
}

/**
 * A batch (`POST /v1/exec/batch`): one result per item, in order. An item that cannot run (an
 * unknown or unready template, no place left in the tenant's cap, a VM that failed) is its own
 * error envelope with the status `/v1/exec` would answer; the items that ran are never discarded.
 */
async function batch(
  deps: Deps,
  p: Principal,
  reqs: A.ExecRequestA[],
  log: (line: string) => void,
): Promise<(A.ExecResultA | A.BatchItemError)[]> {
  const out: (A.ExecResultA | A.BatchItemError)[] = new Array(reqs.length);
  const calls = [];
  const at: number[] = [];
  for (const [i, req] of reqs.entries()) {
    try {
      const template = await resolveTemplate(deps, p.tenantId, req.template_id);
      requireReady(template);
      calls.push({ template, action: oneShotAction(deps, req) });
      at.push(i);
    } catch (err) {
      out[i] = itemError(err, i, log);
    }
  }
  const outcomes = await execOneShots(deps, p, calls, { partial: true });
  outcomes.forEach((o, j) => {
    const i = at[j]!;
    out[i] = o.ok ? resultA(randomUUID(), o.result, o.result.forkTimeMs) : itemError(o.error, i, log);
  });
  return out;
}

/** A failed batch item as `/v1/exec` would have answered it (gateway/errors.ts mapError). */
function itemError(err: unknown, index: number, log: (line: string) => void): A.BatchItemError {
  const m = mapError(err);
  if (m.status >= 500) {
    const id = m.errorId ? ` [${m.errorId}]` : "";
    log(`POST /v1/exec/batch item ${index}${id}: ${describeError(err)}`);
  }
  const retry = m.headers["Retry-After"];
  return {
    status: m.status,
    error: m.body,
    ...(retry !== undefined ? { retry_after_seconds: Number(retry) } : {}),
  };
}

/** Mounted at `/v1/exec`. */
export function execRoutes(deps: Deps, log: (line: string) => void): Hono<HonoEnv> {
  const app = new Hono<HonoEnv>();
  const only = requireApiMw("sessions");
  const max = () => deps.config.limits.maxJsonBodyBytes;

  app.post("/", only, async (c) => {
    const req = await jsonBody(c, A.ExecRequestA, max());
    return c.json(await oneShot(deps, c.get("principal"), req));
  });

  app.post("/batch", only, async (c) => {
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
    return c.json({ results: await batch(deps, c.get("principal"), req.executions, log) });
  });
  return app;
}

/** `POST /v1/sessions` for a sessions API key. */
async function createSession(deps: Deps, c: Context<HonoEnv>) {
  const req = await jsonBody(c, A.CreateSessionRequest, deps.config.limits.maxJsonBodyBytes);
  // The session's own TTL, when given, overrides the operator's; its only action is delete.
  const idle =
    req.idle_timeout_seconds !== undefined
      ? { idle: { timeoutS: req.idle_timeout_seconds, action: "delete" as const } }
      : {};
  const { row, vm } = await createVm(deps, c.get("principal"), "session", {
    templateId: req.template_id,
    labels: {},
    ...idle,
  });
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

/** `POST /v1/sessions/{id}/exec`: as JSON, or as server-sent events when the client asks. */
async function execInSession(deps: Deps, c: Context<HonoEnv>) {
  const p = c.get("principal");
  const id = c.req.param("id") ?? "";
  const req = await jsonBody(c, A.SessionExecRequest, deps.config.limits.maxJsonBodyBytes);
  const action = sessionExecAction(deps, req);
  if (wantsEventStream(c.req.header("accept"))) {
    return sseExec(
      c.req.raw.signal,
      (o) => execIn(deps, p, id, action, o),
      (r) => resultA(id, r, 0),
      (conn) => holdForKey(deps, p.keyId, conn),
    );
  }
  return c.json(resultA(id, await execIn(deps, p, id, action), 0));
}

/** Mounted at `/v1/sessions`. */
export function sessionRoutes(deps: Deps): Hono<HonoEnv> {
  const app = new Hono<HonoEnv>();
  const only = requireApiMw("sessions");

  // The path is shared (contracts/api/routes.ts, API "both"): for a sandboxes API key it is the
  // alias of POST /v1/sandboxes.
  app.post("/", (c) =>
    c.get("principal").api === "sandboxes" ? createSandbox(deps, c) : createSession(deps, c),
  );

  app.get("/", only, async (c) => {
    const now = deps.clock();
    const q = query(c, A.SessionListQuery);
    const page = await listOwnedPage(
      deps,
      c.get("principal"),
      q.template_id !== undefined ? { templateId: q.template_id } : {},
      { limit: q.limit ?? DEFAULT_LIST_LIMIT, cursor: q.cursor },
    );
    return c.json({
      sessions: page.rows.map((r) => ({
        session_id: r.id,
        idle_secs: ages(r, now).idleSecs,
        exec_count: r.execCount,
      })),
      next_cursor: page.next,
    });
  });

  app.get("/:id", only, async (c) => {
    const row = await getOwned(deps, c.get("principal"), c.req.param("id"), { cached: true });
    const a = ages(row, deps.clock());
    return c.json({
      session_id: row.id,
      template_id: row.templateId,
      age_secs: a.ageSecs,
      idle_secs: a.idleSecs,
      exec_count: row.execCount,
    });
  });

  app.post("/:id/exec", only, (c) => execInSession(deps, c));

  app.post("/:id/fork", only, async (c) => {
    // The request body is not specified (docs/sessions.md "Rules of the sessions API"); any body is ignored, one child per call.
    const { children } = await forkVm(deps, c.get("principal"), c.req.param("id"), 1, []);
    const child = children[0]!;
    return c.json({ session_id: child.id, fork_time_ms: child.vm.forkTimeMs }, 201);
  });

  app.delete("/:id", only, async (c) => {
    const q = query(c, A.DeleteSessionQuery);
    const row = await getOwned(deps, c.get("principal"), c.req.param("id"));
    await destroyVm(deps, row, { force: q.force ?? false, reason: "deleted" });
    return c.body(null, 204);
  });
  return app;
}
