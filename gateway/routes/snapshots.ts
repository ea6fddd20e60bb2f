/**
 * Snapshots of the sandboxes API (docs/snapshots.md): list, info and delete, mounted at
 * `/v1/snapshots` behind the key middleware; every route needs a sandboxes API key. Taking one is
 * `POST /v1/sandboxes/{id}/snapshots` (sandboxes.ts), starting from one `POST /v1/sandboxes` with
 * `snapshot`.
 */
import { Hono } from "hono";
import { DEFAULT_LIST_LIMIT } from "../../contracts/api/limits.ts";
import * as B from "../../contracts/api/sandboxes-api.ts";
import { requireApiMw } from "../auth/guards.ts";
import {
  deleteSnapshot,
  getOwnedSnapshot,
  listSnapshotsPage,
  type SnapshotFilter,
  snapshotInfo,
} from "../core/snapshots.ts";
import type { Deps, HonoEnv } from "../deps.ts";
import { queryWithRepeats } from "../http.ts";
import { labelFilters } from "./sandboxes.ts";

export function snapshotRoutes(deps: Deps): Hono<HonoEnv> {
  const app = new Hono<HonoEnv>();
  const only = requireApiMw("sandboxes");

  app.get("/", only, async (c) => {
    const q = queryWithRepeats(c, B.SnapshotListQuery, ["label"]);
    const filter: SnapshotFilter = {};
    if (q.label !== undefined) filter.labels = labelFilters(q.label);
    if (q.state !== undefined) filter.state = q.state;
    if (q.source_sandbox !== undefined) filter.sourceSandboxId = q.source_sandbox;
    if (q.template !== undefined) filter.templateId = q.template;
    const page = await listSnapshotsPage(deps, c.get("principal"), filter, {
      limit: q.limit ?? DEFAULT_LIST_LIMIT,
      cursor: q.cursor,
    });
    return c.json({ snapshots: page.rows.map(snapshotInfo), next_cursor: page.next });
  });

  app.get("/:id", only, async (c) => {
    const row = await getOwnedSnapshot(deps, c.get("principal"), c.req.param("id"));
    return c.json(snapshotInfo(row));
  });

  app.delete("/:id", only, async (c) => {
    const id = c.req.param("id");
    await deleteSnapshot(deps, c.get("principal"), id);
    return c.json({ deleted: true as const, id });
  });
  return app;
}
