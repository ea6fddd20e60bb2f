/** Health (no key), metrics and usage: two sub-apps, one on each side of the key middleware. */
import { readFile } from "node:fs/promises";
import { and, eq, sql } from "drizzle-orm";
import { Hono } from "hono";
import type { AgentHealth } from "../../contracts/agent/api.ts";
import { TCG_BOUNDARY } from "../../contracts/api/health.ts";
import * as B from "../../contracts/api/sandboxes-api.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { isDbUnavailable } from "../../db/unavailable.ts";
import { requireApiMw } from "../auth/guards.ts";
import { visibleTemplates } from "../core/templates.ts";
import { usageTotals } from "../core/usage.ts";
import type { Deps, HonoEnv } from "../deps.ts";
import { query } from "../http.ts";
import { OPENAPI_PATH } from "../openapi-file.ts";

/**
 * How long the agents' healthy answer serves every `GET /v1/health`: a balancer polling many
 * gateways (or anyone: it needs no key) then costs the agents one health call a second per
 * gateway, not one per request, while an agent that died shows as `degraded` within this bound
 * (plus its own call's timeout when it hangs rather than refuses). An unhealthy answer is not
 * kept: while degraded every health request asks again (concurrent ones share one call), so the
 * recovery shows at once. The database part (templates) is read on every request, so a database
 * that went away shows at once too.
 */
export const HEALTH_CACHE_MS = 1000;

/** Mounted at `/v1` before the key middleware: health needs no key (docs/keys-and-auth.md "Rules of authentication"). */
export function healthRoutes(deps: Deps): Hono<HonoEnv> {
  const app = new Hono<HonoEnv>();
  // The agents' answer being asked or served, and until when (performance.now(): real time).
  let cached: { health: Promise<AgentHealth | undefined>; until: number } | undefined;
  const agentHealth = (): Promise<AgentHealth | undefined> => {
    const now = performance.now();
    if (cached === undefined || now >= cached.until) {
      // An agent that does not answer makes the health `degraded`: that answer is the report.
      const health = deps.agent.health().catch(() => undefined);
      // Until answered the call is shared; then only a healthy answer is kept.
      const entry = { health, until: Number.POSITIVE_INFINITY };
      cached = entry;
      void health.then((h) => {
        entry.until = h?.ok ? performance.now() + HEALTH_CACHE_MS : 0;
      });
    }
    return cached.health;
  };
  // Whether an agent of the region has answered healthy since this process started: until then
  // the gateway is `starting` (503), after that a lost agent is `degraded` (200), docs/api.md
  // "Health and the build stamp". A balancer or `up`'s caller thus never sees 200 before anything can run.
  let seenLive = false;
  app.get("/health", async (c) => {
    const h = await agentHealth();
    if (h?.ok) seenLive = true;
    const body = await healthBody(deps, h, seenLive);
    return c.json(body, body.status === "starting" ? 503 : 200);
  });
  // The API's description, as committed beside the code (gateway/openapi.ts generates it and a
  // test keeps the two equal): public documentation, so no key, like health. Read on first use.
  let openapi: Promise<string> | undefined;
  app.get("/openapi.yaml", async (c) => {
    openapi ??= readFile(OPENAPI_PATH, "utf8");
    const text = await openapi.catch((err: unknown) => {
      openapi = undefined; // a later request tries again
      throw err;
    });
    return c.body(text, 200, { "Content-Type": "application/yaml; charset=utf-8" });
  });
  return app;
}

/** One health answer (docs/api.md "Rules every route shares"): status + version (B) + templates map (A); public templates only. */
async function healthBody(
  deps: Deps,
  h: AgentHealth | undefined,
  seenLive: boolean,
): Promise<Record<string, unknown> & { status: "ok" | "degraded" | "starting" }> {
  let status: "ok" | "degraded" | "starting" = h?.ok ? "ok" : seenLive ? "degraded" : "starting";
  let reason: string | undefined;
  if (!h?.ok) {
    reason = seenLive
      ? `no agent of region ${deps.config.region} answers`
      : `no agent of region ${deps.config.region} has been live yet`;
  }
  const accel = h?.accel;
  // Without the database health still answers (200, `degraded`, no templates): a balancer
  // keeps probing and sees the gateway come back; every other call is 503 `db_unavailable`.
  let rows: Awaited<ReturnType<typeof visibleTemplates>> = [];
  try {
    rows = await visibleTemplates(deps, null);
  } catch (err) {
    if (!isDbUnavailable(err)) throw err;
    if (status === "ok") status = "degraded";
    reason =
      reason === undefined ? "the database does not answer" : `${reason}; the database does not answer`;
  }
  return {
    status,
    ...(reason !== undefined ? { reason } : {}),
    version: deps.config.version,
    templates: Object.fromEntries(rows.map((r) => [r.id, { ready: r.status === "ready" }])),
    ...(accel ? { accel } : {}),
    ...(accel === "tcg" ? { vm_boundary: TCG_BOUNDARY } : {}),
    ...(Object.keys(deps.config.settings).length > 0 ? { settings: deps.config.settings } : {}),
  };
}

function escapeLabel(v: string): string {
  return v.replace(/\\/g, "\\\\").replace(/"/g, '\\"').replace(/\n/g, "\\n");
}

/** Mounted at `/v1`: metrics and usage. */
export function systemRoutes(
  deps: Deps,
  counters: { rateLimited: (keyId: string) => number },
): Hono<HonoEnv> {
  const app = new Hono<HonoEnv>();
  // Prometheus text exposition. Scoped to the caller's tenant: a key never sees other tenants.
  app.get("/metrics", async (c) => {
    const p = c.get("principal");
    const rows = await deps.db
      .select({ kind: sandboxes.kind, state: sandboxes.state, n: sql<number>`count(*)::int` })
      .from(sandboxes)
      .where(and(eq(sandboxes.tenantId, p.tenantId)))
      .groupBy(sandboxes.kind, sandboxes.state);
    const lines = [
      "# HELP sandboxd_build_info Gateway build.",
      "# TYPE sandboxd_build_info gauge",
      `sandboxd_build_info{version="${escapeLabel(deps.config.version)}"} 1`,
      "# HELP sandboxd_sandboxes Sessions and sandboxes of this tenant by kind and state.",
      "# TYPE sandboxd_sandboxes gauge",
      ...rows.map((r) => `sandboxd_sandboxes{kind="${r.kind}",state="${r.state}"} ${r.n}`),
      "# HELP sandboxd_rate_limited_total Requests with this key refused with 429 by this gateway process.",
      "# TYPE sandboxd_rate_limited_total counter",
      `sandboxd_rate_limited_total ${counters.rateLimited(p.keyId)}`,
      "",
    ];
    return c.text(lines.join("\n"), 200, { "Content-Type": "text/plain; version=0.0.4; charset=utf-8" });
  });

  app.get("/usage", requireApiMw("sandboxes"), async (c) => {
    const p = c.get("principal");
    const q = query(c, B.UsageQuery);
    const nowMs = deps.clock();
    const now = new Date(nowMs);
    const to = q.to !== undefined ? new Date(q.to) : now;
    const from =
      q.from !== undefined
        ? new Date(q.from)
        : new Date(Date.UTC(now.getUTCFullYear(), now.getUTCMonth(), 1));
    if (!(from.getTime() < to.getTime()))
      throw new SandboxdError("bad_request", "`from` must be before `to`");
    if (to.getTime() - from.getTime() > deps.config.limits.maxUsageWindowS * 1000) {
      throw new SandboxdError(
        "bad_request",
        `the window is longer than ${deps.config.limits.maxUsageWindowS} seconds`,
      );
    }
    const totals = await usageTotals(deps.db, p.tenantId, from, to, now);
    return c.json({ from: from.toISOString(), to: to.toISOString(), totals });
  });
  return app;
}
