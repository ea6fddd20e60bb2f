/**
 * The agent's file routes (docs/agent-api.md "Files"): `PUT|GET|DELETE /v1/vms/{id}/files?path=`
 * (`list=true` on GET lists a directory), and `POST /vms/{id}/files/ops` (stat with owner and
 * group, mkdir -p, rename, recursive remove: agent/sandbox/fs-exec.ts). Bodies are raw bytes streamed both ways with
 * back-pressure: an upload is read from the request only as fast as the guest takes it, a
 * download reads the guest one piece at a time as the gateway reads the answer. A download that
 * fails after its first bytes ends the body early (the reader sees a truncated chunked body).
 */
import type { Hono } from "hono";
import type { z } from "zod";
import { FsOpBody } from "../../contracts/agent/fs-ops.ts";
import { VmIdParam } from "../../contracts/agent/schemas.ts";
import { FilesQuery } from "../../contracts/api/files.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { downloadFile, listFiles, removeFile, uploadFile } from "../sandbox/files.ts";
import { fsOp } from "../sandbox/fs-exec.ts";
import type { SandboxManager } from "../sandbox/manager.ts";

export function fileRoutes(
  r: Hono,
  manager: Pick<SandboxManager, "holdGuest">,
  /** app.ts's zod parse: a failure is 400 `bad_request` naming the field. */
  parse: <T extends z.ZodType>(schema: T, value: unknown) => z.infer<T>,
): void {
  const call = (id: string, q: Record<string, string>) => {
    const query = parse(FilesQuery, q);
    return { vmId: parse(VmIdParam, id), path: query.path, user: query.user, list: query.list === "true" };
  };
  r.put("/vms/:id/files", async (c) => {
    const f = call(c.req.param("id"), c.req.query());
    const body = c.req.raw.body;
    if (!body) throw new SandboxdError("bad_request", "the upload has no body");
    return Response.json(await uploadFile(manager, f, body));
  });
  r.get("/vms/:id/files", async (c) => {
    const f = call(c.req.param("id"), c.req.query());
    if (f.list) return Response.json(await listFiles(manager, f));
    return new Response(await downloadFile(manager, f), {
      headers: { "content-type": "application/octet-stream" },
    });
  });
  // The filesystem ops of contracts/agent/fs-ops.ts: one JSON body, one JSON answer.
  r.post("/vms/:id/files/ops", async (c) => {
    const vmId = parse(VmIdParam, c.req.param("id"));
    // A body that is not JSON is parsed as nothing: the schema's 400 names what is missing.
    const op = parse(FsOpBody, await c.req.json().catch(() => undefined));
    return Response.json(await fsOp(manager, vmId, op));
  });
  r.delete("/vms/:id/files", async (c) => {
    const f = call(c.req.param("id"), c.req.query());
    await removeFile(manager, f);
    return Response.json({ deleted: true, path: f.path });
  });
}
