/**
 * Terminals: `GET /v1/sandboxes/{id}/pty` (sandboxes API) and `GET /v1/sessions/{id}/pty` (sessions API)
 * upgrade to a WebSocket carrying an interactive shell in the sandbox (relay/pty.ts). The checks
 * are the connect route's (connect.ts): the Bearer key and rate limit (key middleware), tenant
 * scoping (a foreign id is 404), a wake-up of a sandbox suspended for idleness, a running state,
 * one of the tenant's relay slots; all before the upgrade, so each failure is an HTTP status.
 * The agent starts the shell before the upgrade too. Terminals are not a Pro feature: like exec,
 * every tier that reaches the sandbox may open one.
 */
import { type Context, Hono } from "hono";
import { PtyQuery } from "../../contracts/api/common.ts";
import type { KeyApi } from "../../contracts/api/tiers.ts";
import { requireApiMw } from "../auth/guards.ts";
import { wakeIfIdle } from "../core/idle.ts";
import { agentOf, getOwned, inTermsOf, requireAllowed } from "../core/sandboxes.ts";
import type { Deps, HonoEnv } from "../deps.ts";
import { query } from "../http.ts";
import { PtyRelay } from "../relay/pty.ts";
import { serveRelay, wsUpgrade } from "./connect.ts";

/** The size a terminal starts with when the query gives none: the classic VT100 screen. */
const DEFAULT_COLS = 80;
const DEFAULT_ROWS = 24;

/** Mounted at `/v1/sandboxes` and at `/v1/sessions`, each with its own API. */
export function ptyRoutes(deps: Deps, api: KeyApi): Hono<HonoEnv> {
  const app = new Hono<HonoEnv>();
  app.get("/:id/pty", requireApiMw(api), (c) => openPty(deps, c));
  return app;
}

async function openPty(deps: Deps, c: Context<HonoEnv>): Promise<Response> {
  const p = c.get("principal");
  const id = c.req.param("id") ?? "";
  const q = query(c, PtyQuery);
  await wakeIfIdle(deps, p, id);
  const row = await getOwned(deps, p, id);
  requireAllowed(id, row.state, "connect");
  const upgrade = wsUpgrade(c);
  const size = { cols: q.cols ?? DEFAULT_COLS, rows: q.rows ?? DEFAULT_ROWS };
  const agent = agentOf(deps, row);
  return serveRelay(deps, upgrade, p, row, async () => {
    return new PtyRelay(await inTermsOf(row, agent.openPty(row.vmId!, size)), q.lines === "true");
  });
}
