/**
 * Sandboxes of the sandboxes API (docs/sandboxes.md "Rules of the sandboxes API"): create, list, info, exec, fork, suspend, resume, delete, one
 * sub-app mounted at `/v1/sandboxes` behind the key middleware; every route needs a sandboxes API
 * key. Connecting from outside is in connect.ts, files, processes and terminals in their own.
 */
import { type Context, Hono } from "hono";
import type { ExecResult } from "../../contracts/agent/api.ts";
import { DEFAULT_LIST_LIMIT } from "../../contracts/api/limits.ts";
import * as B from "../../contracts/api/sandboxes-api.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { requireApiMw } from "../auth/guards.ts";
import type { Principal } from "../auth/keys.ts";
import { setSandboxEgress } from "../core/egress.ts";
import { idleInfo, wakeIfIdle } from "../core/idle.ts";
import { lifetimeInfo, setSandboxTimeout } from "../core/lifetimes.ts";
import { sandboxMetrics } from "../core/metrics.ts";
import {
  ages,
  createVm,
  destroyVm,
  execIn,
  forkVm,
  getOwned,
  type IdleLifetime,
  type ListFilter,
  listOwnedPage,
  publicEndpoints,
  resumeVm,
  suspendVm,
} from "../core/sandboxes.ts";
import { createFromSnapshot, restoreSandbox, snapshotInfo, takeSnapshot } from "../core/snapshots.ts";
import { type Deps, type HonoEnv, holdForKey } from "../deps.ts";
import { jsonBody, queryWithRepeats } from "../http.ts";
import { sandboxExecAction } from "./exec-actions.ts";
import { sseExec, wantsEventStream } from "./exec-sse.ts";

type State = "running" | "suspended";
const publicState = (s: string): State => (s === "suspended" ? "suspended" : "running");

/**
 * The idle lifetime a new sandbox gets: the one asked for (`suspend` unless `idle_action` says
 * otherwise), else the operator's default (`SANDBOXD_IDLE_TIMEOUT`, with the request's action or
 * the operator's), else none.
 */
export function idleLifetime(
  deps: Deps,
  req: Pick<B.CreateSandboxRequest, "idle_timeout_seconds" | "idle_action">,
): IdleLifetime {
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
 * `label=key:value` filters as one map (docs/lists.md): the key is what comes before the first
 * `:`. One key asked twice with two values is 400: AND would match nothing, and the caller most
 * likely meant OR, which the API does not offer.
 */
export function labelFilters(selectors: string[]): Record<string, string> {
  const out: Record<string, string> = {};
  for (const s of selectors) {
    const at = s.indexOf(":");
    const k = s.slice(0, at);
    const v = s.slice(at + 1);
    if (Object.hasOwn(out, k) && out[k] !== v) {
      throw new SandboxdError(
        "bad_request",
        `invalid query: label ${JSON.stringify(k)} is asked with two values; label filters are AND-ed`,
      );
    }
    out[k] = v;
  }
  return out;
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
  const idle = idleLifetime(deps, req);
  const egress = req.egress !== undefined ? { egressAllow: req.egress.allow } : {};
  // The absolute lifetime: none unless asked for; its action `delete` unless `on_timeout` says
  // (kept alone too: a later `POST .../timeout` without one uses it).
  const lifetime =
    req.timeout_seconds !== undefined || req.on_timeout !== undefined
      ? {
          lifetime: {
            timeoutS: req.timeout_seconds ?? null,
            onTimeout: req.on_timeout ?? ("delete" as const),
          },
        }
      : {};
  // A size class (docs/templates.md "Size classes"): either field, both or neither.
  const size = {
    ...(req.vcpus !== undefined ? { vcpus: req.vcpus } : {}),
    ...(req.memory_mib !== undefined ? { memMib: req.memory_mib } : {}),
  };
  // The schema takes exactly one of `template` and `snapshot`.
  const { row, vm } =
    req.snapshot !== undefined
      ? await createFromSnapshot(deps, p, {
          snapshotId: req.snapshot,
          labels,
          idle,
          size,
          ...egress,
          ...lifetime,
        })
      : await createVm(deps, p, "sandbox", {
          templateId: req.template!,
          labels,
          idle,
          size,
          ...egress,
          ...lifetime,
        });
  return c.json(
    {
      id: row.id,
      template: row.templateId,
      ...(row.snapshotId !== null ? { snapshot: row.snapshotId } : {}),
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
    // The size it runs at (its size class); 0 until the agent has reported it.
    ...(row.vcpus > 0 ? { vcpus: row.vcpus } : {}),
    ...(row.memMib > 0 ? { memory_mib: row.memMib } : {}),
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
    const q = queryWithRepeats(c, B.SandboxListQuery, ["label"]);
    const filter: ListFilter = {};
    if (q.label !== undefined) filter.labels = labelFilters(q.label);
    if (q.state !== undefined) filter.state = q.state;
    if (q.template !== undefined) filter.templateId = q.template;
    const page = await listOwnedPage(deps, c.get("principal"), filter, {
      limit: q.limit ?? DEFAULT_LIST_LIMIT,
      cursor: q.cursor,
    });
    return c.json({
      sandboxes: page.rows.map((r) => ({ id: r.id, template: r.templateId, state: publicState(r.state) })),
      next_cursor: page.next,
    });
  });

  app.get("/:id", only, (c) => sandboxInfo(deps, c));

  // Live metrics (docs/metrics.md): looking neither resumes it nor counts as use.
  app.get("/:id/metrics", only, async (c) =>
    c.json(await sandboxMetrics(deps, c.get("principal"), c.req.param("id"))),
  );

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

  app.post("/:id/snapshots", only, async (c) => {
    const p = c.get("principal");
    const req = await jsonBody(c, B.CreateSnapshotRequest, max());
    await wakeIfIdle(deps, p, c.req.param("id"));
    const input = { labels: req.labels ?? {}, ...(req.name !== undefined ? { name: req.name } : {}) };
    const row = await takeSnapshot(deps, p, c.req.param("id"), input);
    return c.json(snapshotInfo(row), 201);
  });

  app.post("/:id/restore", only, async (c) => {
    const p = c.get("principal");
    const id = c.req.param("id");
    const req = await jsonBody(c, B.RestoreRequest, max());
    await wakeIfIdle(deps, p, id);
    const r = await restoreSandbox(deps, p, id, req.snapshot);
    return c.json({
      id,
      state: "running" as const,
      snapshot: req.snapshot,
      restore_ms: r.restoreMs,
      down_ms: r.downMs,
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

  // A new egress allow-list (docs/egress.md): looking after its network is not use, so a
  // suspended sandbox stays suspended and takes the list when it resumes.
  app.put("/:id/egress", only, async (c) => {
    const req = await jsonBody(c, B.Egress, max());
    return c.json(await setSandboxEgress(deps, c.get("principal"), c.req.param("id"), req.allow));
  });

  app.delete("/:id", only, async (c) => {
    const row = await getOwned(deps, c.get("principal"), c.req.param("id"));
    await destroyVm(deps, row, { force: true, reason: "deleted" });
    return c.json({ deleted: true as const, id: row.id });
  });
  return app;
}
