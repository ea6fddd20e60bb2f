/**
 * The agent's template routes (docs/agent-api.md "Routes"): build from an uploaded image or an
 * OCI reference, copy a ready one from another agent (its bundle out, a bundle in), status,
 * delete, and the Pro warm width (expect, release). Calls that name no VM,
 * like create and exec-once; the work is the manager's (`perform`, actions.ts).
 */
import { randomBytes } from "node:crypto";
import { mkdir, rm } from "node:fs/promises";
import { join } from "node:path";
import type { Hono, MiddlewareHandler } from "hono";
import type { z } from "zod";
import { OciBuildBody, TemplateRefParam, UploadQuery, WidthBody } from "../../contracts/agent/schemas.ts";
import { MAX_MEM_MIB } from "../../contracts/api/limits.ts";
import { settled } from "../../contracts/best-effort.ts";
import { asNoSpace, isNoSpace, needFreeSpace } from "../../contracts/disk-space.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { COPY_DISK_MAX_BYTES } from "../snapshot/template-copy.ts";
import type { AgentAction } from "./actions.ts";

export interface TemplateRouteHelpers {
  json: MiddlewareHandler;
  /** app.ts's zod parse: a failure is 400 `bad_request` naming the field. */
  parse: <T extends z.ZodType>(schema: T, value: unknown) => z.infer<T>;
  body: (req: Request) => Promise<unknown>;
  /** Runs one typed action and answers with its result. */
  run: (action: AgentAction) => Promise<Response>;
  /** The bundle of a ready template (SandboxManager.exportTemplate). */
  exportTemplate: (template: string) => Promise<AsyncIterable<Uint8Array>>;
  /** Throws `conflict` when a build or copy of the template may not start (TemplateRegistry). */
  assertBuildable: (template: string) => void;
}

/**
 * Largest template bundle staged for a copy: the largest RAM file (MAX_MEM_MIB), two disk files
 * of COPY_DISK_MAX_BYTES and the state's cap, which the bundle's own header may declare at most;
 * a sender that goes on past it is cut off. The disk reserve stops a full disk long before.
 */
const MAX_BUNDLE_BYTES = MAX_MEM_MIB * 1024 ** 2 * 2 + 2 * COPY_DISK_MAX_BYTES + 64 * 1024 ** 2;

/** Writes `body` to `path`, stopping (and removing it) past `maxBytes`. */
async function stageBounded(body: ReadableStream<Uint8Array>, path: string, maxBytes: number): Promise<void> {
  const reader = body.getReader();
  const sink = Bun.file(path).writer({ highWaterMark: 1024 * 1024 });
  let total = 0;
  try {
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      total += value.length;
      if (total > maxBytes)
        throw new SandboxdError("payload_too_large", `the template bundle is over ${maxBytes} bytes`);
      sink.write(value);
      await sink.flush();
    }
    await sink.end();
  } catch (err) {
    // The staging's own failure is what the caller sees; the file is removed by the caller.
    void settled(reader.cancel()); // the staging's own error is the one reported
    await settled(Promise.resolve(sink.end()));
    throw err;
  }
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
  // A copy of a ready template from another agent (docs/templates.md "Agents that join later"):
  // staged like an upload, then read into the template in the background (202).
  r.put("/templates/:ref/copy", async (c) => {
    const template = parse(TemplateRefParam, c.req.param("ref"));
    if (!c.req.raw.body) throw new SandboxdError("bad_request", "the template copy has no body");
    h.assertBuildable(template);
    await needFreeSpace(uploadDir, "the template copy", 0, diskReserveBytes);
    await mkdir(uploadDir, { recursive: true, mode: 0o700 });
    const path = join(uploadDir, `${randomBytes(8).toString("hex")}.bundle`);
    try {
      await stageBounded(c.req.raw.body, path, MAX_BUNDLE_BYTES);
    } catch (err) {
      await rm(path, { force: true });
      if (isNoSpace(err)) throw asNoSpace(err, "the template copy");
      if (err instanceof SandboxdError) throw err;
      throw new SandboxdError("bad_request", "the template copy was interrupted", { cause: err });
    }
    return run({ kind: "copyTemplate", template, path });
  });
  r.get("/templates/:ref/bundle", async (c) => {
    const template = parse(TemplateRefParam, c.req.param("ref"));
    const chunks = await h.exportTemplate(template);
    const it = chunks[Symbol.asyncIterator]();
    // Pulled as the caller reads: a slow receiver leaves the files unread, nothing piles up here.
    const stream = new ReadableStream<Uint8Array>({
      async pull(ctl) {
        const next = await it.next();
        if (next.done) ctl.close();
        else ctl.enqueue(next.value);
      },
      async cancel() {
        await it.return?.();
      },
    });
    return new Response(stream, {
      headers: { "content-type": "application/octet-stream" },
    });
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
