/**
 * Template paths shared by both APIs (docs/sessions.md "Rules of the sessions API"; docs/sandboxes.md "Rules of the sandboxes API"), mounted at `/v1/templates`: the key's API
 * picks the form, and the tier checks are the form's. The sandboxes API's catalog is also at
 * `/v1/images` (`imageRoutes`).
 * The sessions API registers from an uploaded image streamed to a file; The sandboxes API bakes from an OCI ref.
 */

import { createWriteStream } from "node:fs";
import { mkdir, rm } from "node:fs/promises";
import { join } from "node:path";
import { type Context, Hono } from "hono";
import * as B from "../../contracts/api/sandboxes-api.ts";
import * as A from "../../contracts/api/sessions-api.ts";
import { asNoSpace, freeBytes, requireFreeSpace } from "../../contracts/disk-space.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { requireApiMw, requirePro, requireScale } from "../auth/guards.ts";
import type { Principal } from "../auth/keys.ts";
import { hostOf } from "../core/regions.ts";
import { publicSize, sizesOf } from "../core/sizes.ts";
import {
  bakeTemplate,
  deleteTemplate,
  dropReservation,
  ownTemplate,
  requireTemplateRoom,
  reserveUploadTemplate,
  resolveTemplate,
  startUploadBuild,
  type TemplateRow,
  visibleTemplates,
} from "../core/templates.ts";
import type { Deps, HonoEnv } from "../deps.ts";
import { jsonBody, query } from "../http.ts";
import { base36 } from "../ids.ts";

function templateA(row: TemplateRow) {
  const out: {
    id: string;
    status: "building" | "ready" | "failed";
    created_at_secs?: number;
    error?: string;
  } = {
    id: row.id,
    status: row.status,
  };
  if (row.status === "ready")
    out.created_at_secs = Math.floor((row.readyAt ?? row.createdAt).getTime() / 1000);
  if (row.status === "failed") out.error = row.error ?? "build failed";
  return out;
}

function catalogEntry(row: TemplateRow) {
  const out: {
    id: string;
    name: string;
    description: string;
    visibility: "public" | "private";
    tier?: string;
  } = {
    id: row.id,
    name: row.name,
    description: row.description,
    visibility: row.tenantId === null ? "public" : "private",
  };
  if (row.tier !== null) out.tier = row.tier;
  return out;
}

/**
 * The agent's readiness telemetry in the public shape (B.TemplateTelemetry): members the
 * contract does not define are dropped, and a malformed report shows as none rather than a 500.
 */
function publicTelemetry(raw: Record<string, unknown>): B.TemplateTelemetry {
  const r = B.TemplateTelemetry.safeParse(raw);
  return r.success ? r.data : {};
}

function templateB(row: TemplateRow, telemetry: Record<string, unknown>) {
  const out: Record<string, unknown> = {
    ...catalogEntry(row),
    phase: row.phase,
    exposed_ports: row.exposedPorts,
    telemetry: publicTelemetry(telemetry),
  };
  if (row.image !== null) out.image = row.image;
  if (row.status === "failed") out.error = row.error ?? "bake failed";
  const sizes = sizesOf(row);
  if (sizes.length > 0) out.sizes = sizes.map(publicSize);
  return out;
}

/** How often (bytes written) a streaming upload asks the filesystem how much room is left. */
const SPACE_CHECK_EVERY_BYTES = 16 * 1024 * 1024;

/**
 * Streams the request body to a file, never holding more than one chunk in memory; refuses
 * bodies over `max` bytes (413) and bodies that would leave less than `reserveBytes` free on the
 * disk (507), and removes the partial file on any failure.
 */
async function streamToFile(c: Context, path: string, max: number, reserveBytes: number): Promise<number> {
  const body = c.req.raw.body;
  if (!body) throw new SandboxdError("bad_request", "the image body is empty");
  const out = createWriteStream(path, { flags: "wx", mode: 0o600 });
  const opened = new Promise<void>((resolve, reject) => {
    out.once("open", () => resolve());
    out.once("error", reject);
  });
  let total = 0;
  const reader = body.getReader();
  try {
    await opened;
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      const before = total;
      total += value.byteLength;
      if (total > max) {
        await reader.cancel();
        throw new SandboxdError("payload_too_large", `template image is over ${max} bytes`);
      }
      if (Math.floor(total / SPACE_CHECK_EVERY_BYTES) !== Math.floor(before / SPACE_CHECK_EVERY_BYTES)) {
        if ((await freeBytes(path)) < reserveBytes + value.byteLength) {
          await reader.cancel();
          throw new SandboxdError("insufficient_storage", "not enough disk space for the image upload");
        }
      }
      // Respect backpressure: wait for the disk when the stream's buffer is full.
      if (!out.write(value)) await new Promise<void>((r) => out.once("drain", () => r()));
    }
    await new Promise<void>((resolve, reject) =>
      out.end((err?: Error | null) => (err ? reject(err) : resolve())),
    );
  } catch (err) {
    out.destroy();
    await rm(path, { force: true });
    throw asNoSpace(err, "the image upload");
  }
  if (total === 0) {
    await rm(path, { force: true });
    throw new SandboxdError("bad_request", "the image body is empty");
  }
  return total;
}

/** `POST /v1/templates` for a sandboxes API key: bake from an OCI reference (Pro). */
async function bake(deps: Deps, c: Context<HonoEnv>, p: Principal) {
  requirePro(p, "baking templates");
  const req = await jsonBody(c, B.BakeTemplateRequest, deps.config.limits.maxJsonBodyBytes);
  const row = await bakeTemplate(deps, p.tenantId, req, deps.config.limits.templateQuotaByTier[p.tier]);
  // The template as GET /v1/templates/{id} shows it (a retry sees the build's progress); a status
  // the agent cannot give right now leaves the telemetry empty: the row is the answer.
  const st = await (await hostOf(deps, row.tenantId)).templateStatus(row.agentRef).catch(() => undefined);
  return c.json(templateB(row, st?.telemetry ?? {}), 202);
}

/** `POST /v1/templates` for a sessions API key: register an uploaded image (scale). */
async function register(deps: Deps, c: Context<HonoEnv>, p: Principal) {
  requireScale(p);
  const ct = c.req.header("content-type")?.split(";")[0]?.trim().toLowerCase();
  if (ct !== undefined && ct !== "application/octet-stream") {
    throw new SandboxdError("bad_request", "the image body must be sent as application/octet-stream");
  }
  const q = query(c, A.RegisterTemplateQuery);
  const max = deps.config.limits.maxTemplateUploadBytes;
  const declared = c.req.header("content-length");
  if (declared !== undefined && Number(declared) > max) {
    throw new SandboxdError("payload_too_large", `template image is over ${max} bytes`);
  }
  const opts: { id: string; memMib?: number; vcpuCount?: number; waitSecs?: number } = { id: q.id };
  if (q.mem_mib !== undefined) opts.memMib = q.mem_mib;
  if (q.vcpu_count !== undefined) opts.vcpuCount = q.vcpu_count;
  if (q.wait_secs !== undefined) opts.waitSecs = q.wait_secs;
  const templateCap = deps.config.limits.templateQuotaByTier[p.tier];
  // Early, before the body is read; reserveUploadTemplate checks again with its insert, atomically.
  await requireTemplateRoom(deps, p.tenantId, templateCap);
  const dir = join(deps.config.uploadDir, p.tenantId);
  // Refused before a byte is read when the declared size (or, unknown, nothing) plus the
  // reserve does not fit; the stream checks again as it writes (a chunked body declares none).
  const reserveBytes = deps.config.limits.diskReserveBytes;
  await requireFreeSpace(deps.config.uploadDir, {
    what: "the image upload",
    bytes: Number.isSafeInteger(Number(declared)) ? Number(declared) : 0,
    reserveBytes,
  });
  const row = await reserveUploadTemplate(deps, p.tenantId, opts, templateCap);
  const path = join(dir, `${q.id}-${base36(8)}.img`);
  let bytes: number;
  try {
    await mkdir(dir, { recursive: true, mode: 0o700 });
    bytes = await streamToFile(c, path, max, reserveBytes);
  } catch (err) {
    await dropReservation(deps, row);
    throw err;
  }
  await startUploadBuild(deps, row, { path, bytes });
  return c.json({ id: row.id, status: "building" as const }, 202);
}

/** Mounted at `/v1/images`: the sandboxes API's catalog. */
export function imageRoutes(deps: Deps): Hono<HonoEnv> {
  const app = new Hono<HonoEnv>();
  app.get("/", requireApiMw("sandboxes"), async (c) => {
    const rows = await visibleTemplates(deps, c.get("principal").tenantId);
    return c.json({ templates: rows.map(catalogEntry) });
  });
  return app;
}

/** Mounted at `/v1/templates`. */
export function templateRoutes(deps: Deps): Hono<HonoEnv> {
  const app = new Hono<HonoEnv>();
  app.get("/", async (c) => {
    const p = c.get("principal");
    const rows = await visibleTemplates(deps, p.tenantId);
    if (p.api === "sandboxes") return c.json({ templates: rows.map(catalogEntry) }); // alias of /v1/images
    return c.json({
      templates: Object.fromEntries(rows.map((r) => [r.id, { ready: r.status === "ready" }])),
    });
  });

  app.post("/", (c) => {
    const p = c.get("principal");
    return p.api === "sandboxes" ? bake(deps, c, p) : register(deps, c, p);
  });

  app.get("/:id", async (c) => {
    const p = c.get("principal");
    const row = await resolveTemplate(deps, p.tenantId, c.req.param("id"));
    if (p.api === "sessions") return c.json(templateA(row));
    // A build still waiting for an agent (docs/templates.md "Waiting for an agent"), or one whose
    // agent cannot answer now: the row is the answer and the telemetry is empty, as after a bake.
    const st = await (await hostOf(deps, row.tenantId)).templateStatus(row.agentRef).catch(() => undefined);
    return c.json(templateB(row, st?.telemetry ?? {}));
  });

  app.delete("/:id", async (c) => {
    const p = c.get("principal");
    const id = c.req.param("id");
    if (p.api === "sessions") {
      requireScale(p);
      await deleteTemplate(deps, await ownTemplate(deps, p.tenantId, id, "sessions"));
      return c.body(null, 204);
    }
    // The sandboxes API: any tier may remove what it created; shared catalog rows are 403 (docs/sandboxes.md "Rules of the sandboxes API").
    await deleteTemplate(deps, await ownTemplate(deps, p.tenantId, id, "sandboxes"));
    return c.json({ deleted: true as const, id });
  });

  app.post("/:id/expect", async (c) => {
    const p = c.get("principal");
    requirePro(p, "expect");
    const req = await jsonBody(c, B.ExpectRequest, deps.config.limits.maxJsonBodyBytes);
    const row = await ownTemplate(deps, p.tenantId, c.req.param("id"), "sandboxes");
    await (await hostOf(deps, row.tenantId)).expectWidth(row.agentRef, req.width);
    return c.json({ id: row.id, width: req.width });
  });

  app.post("/:id/release", async (c) => {
    const p = c.get("principal");
    requirePro(p, "release");
    const row = await ownTemplate(deps, p.tenantId, c.req.param("id"), "sandboxes");
    await (await hostOf(deps, row.tenantId)).releaseTemplate(row.agentRef);
    return c.json({ id: row.id, released: true as const });
  });
  return app;
}
