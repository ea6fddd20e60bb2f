/**
 * The agent's template routes (docs/agent-api.md "Routes"): build from an uploaded image or an
 * OCI reference, status, delete, and the Pro warm width (expect, release). Calls that name no VM,
 * like create and exec-once; the work is the manager's (`perform`, actions.ts).
 */
import { randomBytes } from "node:crypto";
import { mkdir, rm } from "node:fs/promises";
import { join } from "node:path";
import type { Hono, MiddlewareHandler } from "hono";
import type { z } from "zod";
import { OciBuildBody, TemplateRefParam, UploadQuery, WidthBody } from "../../contracts/agent/schemas.ts";
import { asNoSpace, isNoSpace, needFreeSpace } from "../../contracts/disk-space.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import type { AgentAction } from "./actions.ts";

export interface TemplateRouteHelpers {
  json: MiddlewareHandler;
  /** app.ts's zod parse: a failure is 400 `bad_request` naming the field. */
  parse: <T extends z.ZodType>(schema: T, value: unknown) => z.infer<T>;
  body: (req: Request) => Promise<unknown>;
  /** Runs one typed action and answers with its result. */
  run: (action: AgentAction) => Promise<Response>;
}

/**
 * `uploadDir`: uploaded images are staged here until their build ends, keeping `diskReserveBytes`
 * free on its disk.
 */
export function templateRoutes(
  r: Hono,
  uploadDir: string,
  diskReserveBytes: number,
  h: TemplateRouteHelpers,
): void {
  const { json, parse, body, run } = h;
  r.put("/templates/:ref/upload", async (c) => {
    const template = parse(TemplateRefParam, c.req.param("ref"));
    const q = parse(UploadQuery, c.req.query());
    if (!c.req.raw.body) throw new SandboxdError("bad_request", "the image upload has no body");
    // The gateway sends the length of the file it staged: refused before a byte is written when
    // it does not fit with the reserve; a write that still fills the disk is 507 too.
    const declared = Number(c.req.header("content-length") ?? 0);
    await needFreeSpace(
      uploadDir,
      "the image upload",
      Number.isSafeInteger(declared) ? declared : 0,
      diskReserveBytes,
    );
    await mkdir(uploadDir, { recursive: true, mode: 0o700 });
    const path = join(uploadDir, `${randomBytes(8).toString("hex")}.upload`);
    try {
      // Streamed to disk as it arrives: images may be several GB (docs/sessions.md "Rules of the sessions API").
      await Bun.write(path, new Response(c.req.raw.body));
    } catch (err) {
      await rm(path, { force: true });
      if (isNoSpace(err)) throw asNoSpace(err, "the image upload");
      throw new SandboxdError("bad_request", "the image upload was interrupted", { cause: err });
    }
    return run({ kind: "buildTemplate", template, source: { kind: "upload", path, ...q } });
  });
  r.put("/templates/:ref", json, async (c) => {
    const template = parse(TemplateRefParam, c.req.param("ref"));
    const b = parse(OciBuildBody, await body(c.req.raw));
    return run({ kind: "buildTemplate", template, source: { kind: "oci", ...b } });
  });
  r.get("/templates/:ref", (c) =>
    run({ kind: "templateStatus", template: parse(TemplateRefParam, c.req.param("ref")) }),
  );
  r.delete("/templates/:ref", (c) =>
    run({ kind: "deleteTemplate", template: parse(TemplateRefParam, c.req.param("ref")) }),
  );
  r.post("/templates/:ref/expect", json, async (c) =>
    run({
      kind: "expectWidth",
      template: parse(TemplateRefParam, c.req.param("ref")),
      width: parse(WidthBody, await body(c.req.raw)).width,
    }),
  );
  r.post("/templates/:ref/release", (c) =>
    run({ kind: "releaseTemplate", template: parse(TemplateRefParam, c.req.param("ref")) }),
  );
}
