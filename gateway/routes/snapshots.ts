/**
 * Snapshots of the sandboxes API (docs/snapshots.md): list, info and delete, mounted at
 * `/v1/snapshots` behind the key middleware; every route needs a sandboxes API key. Taking one is
 * `POST /v1/sandboxes/{id}/snapshots` (sandboxes.ts), starting from one `POST /v1/sandboxes` with
 * `snapshot`.
 */
import { Hono } from "hono";
import { MAX_SNAPSHOT_LIST } from "../../contracts/api/limits.ts";
import * as B from "../../contracts/api/sandboxes-api.ts";
import { requireApiMw } from "../auth/guards.ts";
import { deleteSnapshot, getOwnedSnapshot, listSnapshots, snapshotInfo } from "../core/snapshots.ts";
import type { Deps, HonoEnv } from "../deps.ts";
import { query } from "../http.ts";

export function snapshotRoutes(deps: Deps): Hono<HonoEnv> {
  const app = new Hono<HonoEnv>();
  const only = requireApiMw("sandboxes");

  app.get("/", only, async (c) => {
    const q = query(c, B.SnapshotListQuery);
    const rows = await listSnapshots(deps, c.get("principal"), q.limit ?? MAX_SNAPSHOT_LIST);
    return c.json({ snapshots: rows.map(snapshotInfo) });
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
