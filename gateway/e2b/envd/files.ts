/**
 * envd's `GET /files` and `POST /files` (docs/e2b.md "Filesystem"): a download streamed from the
 * sandbox, and uploads as `multipart/form-data` (one or more parts, each part's file name its path
 * unless `path` names the one file) or `application/octet-stream` (the body is the file at
 * `path`, gzip when `Content-Encoding: gzip`). A relative `path` is taken from the user's home.
 * Headers `X-Metadata-<key>: <value>` are the written files' metadata (xattrs `user.e2b.<key>`,
 * key lowercased), checked before anything is written; an upload replaces a file, so one without
 * them leaves it none. Errors are envd's JSON `{message, code}` with envd's statuses (404 for a missing file).
 */
import { posix } from "node:path";
import { Hono } from "hono";
import { Metadata } from "../../../contracts/agent/fs-ops.ts";
import { MAX_FILE_TRANSFER_BYTES, MAX_PATH_CHARS } from "../../../contracts/api/limits.ts";
import { SandboxdError } from "../../../contracts/errors.ts";
import { agentOf, inTermsOf } from "../../core/sandboxes.ts";
import type { Deps, HonoEnv } from "../../deps.ts";
import { holdForKey, logOf } from "../../deps.ts";
import { limited, onFinish, tooLarge } from "../../routes/files.ts";
import { fsOpOn } from "./filesystem.ts";
import { type EnvdTarget, envdHttpError } from "./target.ts";

/**
 * A multipart upload is read whole before its files are written (each part must be found in the
 * body first). 256 MiB: what the SDK itself buffers for such an upload; larger files go as
 * octet-stream (the SDK's choice for streams and envd >= 0.5.7), streamed up to
 * MAX_FILE_TRANSFER_BYTES.
 */
export const MAX_MULTIPART_BYTES = 256 * 1024 * 1024;

/**
 * envd's error answer; a permission the sandbox refused is 403 as envd answers it (our file
 * routes say 400 `invalid_file` for every refusal of the sandbox).
 */
function errorAnswer(err: unknown): Response {
  if (err instanceof SandboxdError && err.code === "invalid_file" && /Permission denied/.test(err.message))
    return Response.json({ message: err.message, code: 403 }, { status: 403 });
  return envdHttpError(err);
}

/** `path` made absolute against the user's home (asked of the sandbox only when relative). */
async function absolute(deps: Deps, t: EnvdTarget, path: string, user: string | undefined): Promise<string> {
  if (path.length === 0 || path.length > MAX_PATH_CHARS || path.includes("\0")) {
    throw new SandboxdError("bad_request", "path must be 1 to 4096 characters without NUL");
  }
  if (path.startsWith("/")) return posix.normalize(path);
  const { home } = await fsOpOn(deps, t, { op: "home", user });
  return posix.resolve(home ?? "/", path);
}

/** The user of the query (`username`); empty or absent is the image's user. */
function userOf(q: string | undefined): string | undefined {
  return q ? q : undefined;
}

/** Downloads `path` as `user`: the body streams from the guest, counted in flight until it ends. */
export async function downloadFor(
  deps: Deps,
  t: EnvdTarget,
  rawPath: string,
  user: string | undefined,
  signal: AbortSignal,
): Promise<Response> {
  const path = await absolute(deps, t, rawPath, user);
  const a = await inTermsOf(
    t.row,
    agentOf(deps, t.row).files(t.row.vmId!, { op: "download", path, user, signal }),
  );
  if (a.op !== "download")
    throw new SandboxdError("internal", "the agent answered a download with something else");
  const hold = (conn: Parameters<typeof holdForKey>[2]) => holdForKey(deps, t.principal.keyId, conn);
  // The call's end in flight is the data plane's middleware's, at the end of this body.
  return new Response(
    onFinish(a.body, async () => {}, logOf(deps), hold),
    {
      headers: { "content-type": "application/octet-stream" },
    },
  );
}

/** The metadata of an upload's `X-Metadata-<key>` headers (key lowercased), checked; none: undefined. */
export function metadataOf(headers: Headers): Record<string, string> | undefined {
  const prefix = "x-metadata-";
  const m: Record<string, string> = {};
  let any = false;
  for (const [name, value] of headers) {
    if (!name.startsWith(prefix)) continue;
    m[name.slice(prefix.length)] = value;
    any = true;
  }
  if (!any) return undefined;
  const r = Metadata.safeParse(m);
  if (!r.success) {
    throw new SandboxdError("bad_request", `invalid metadata: ${r.error.issues[0]?.message ?? "refused"}`);
  }
  return r.data;
}

/**
 * Writes one file from `body` (bounded by MAX_FILE_TRANSFER_BYTES), then its `metadata` as the
 * same user; its envd entry.
 */
export async function uploadFor(
  deps: Deps,
  t: EnvdTarget,
  rawPath: string,
  user: string | undefined,
  body: ReadableStream<Uint8Array> | null,
  signal: AbortSignal,
  metadata?: Record<string, string>,
): Promise<{ name: string; type: "file"; path: string; metadata?: Record<string, string> }> {
  const path = await absolute(deps, t, rawPath, user);
  const b = limited(body);
  try {
    const a = await inTermsOf(
      t.row,
      agentOf(deps, t.row).files(t.row.vmId!, { op: "upload", path, user, body: b.stream, signal }),
    );
    if (a.op !== "upload")
      throw new SandboxdError("internal", "the agent answered an upload with something else");
    if (metadata) {
      await fsOpOn(deps, t, { op: "setMetadata", path, user, metadata });
      return { name: posix.basename(path), type: "file", path, metadata };
    }
    return { name: posix.basename(path), type: "file", path };
  } catch (err) {
    if (b.over()) throw tooLarge();
    throw err;
  }
}

/** The request body with a bound and, for `Content-Encoding: gzip`, decompressed. */
function bodyOf(req: Request, max: number): ReadableStream<Uint8Array> | null {
  const declared = req.headers.get("content-length");
  if (declared !== null && Number(declared) > max) throw tooLarge();
  let body = req.body;
  if (!body) return null;
  const enc = (req.headers.get("content-encoding") ?? "").trim().toLowerCase();
  if (enc === "gzip")
    body = body.pipeThrough(new DecompressionStream("gzip") as TransformStream<Uint8Array, Uint8Array>);
  else if (enc !== "" && enc !== "identity")
    throw new SandboxdError("bad_request", `unsupported Content-Encoding ${enc}`);
  return body;
}

/** The Hono env of the data plane (index.ts `EnvdEnv`), as far as these routes read it. */
type FilesEnv = HonoEnv & { Variables: HonoEnv["Variables"] & { envd: EnvdTarget } };

/** Mounted in envdRoutes before the Connect catch-all; the target is `c.get("envd")`. */
export function envdFileRoutes(deps: Deps): Hono<FilesEnv> {
  const app = new Hono<FilesEnv>();
  app.get("/files", async (c) => {
    try {
      const path = c.req.query("path") ?? "";
      return await downloadFor(deps, c.get("envd"), path, userOf(c.req.query("username")), c.req.raw.signal);
    } catch (err) {
      return errorAnswer(err);
    }
  });
  app.post("/files", async (c) => {
    try {
      const t = c.get("envd");
      const user = userOf(c.req.query("username"));
      const path = c.req.query("path");
      const type = (c.req.header("content-type") ?? "").toLowerCase();
      const metadata = metadataOf(c.req.raw.headers);
      // Refused before anything is written when the image cannot store metadata (no python3).
      if (metadata) await fsOpOn(deps, t, { op: "setMetadata", path: "/", user, metadata, check: true });
      if (type.startsWith("application/octet-stream")) {
        if (!path) throw new SandboxdError("bad_request", "an octet-stream upload needs the path parameter");
        const body = bodyOf(c.req.raw, MAX_FILE_TRANSFER_BYTES);
        return c.json([await uploadFor(deps, t, path, user, body, c.req.raw.signal, metadata)]);
      }
      if (!type.startsWith("multipart/form-data")) {
        throw new SandboxdError(
          "bad_request",
          "the body must be multipart/form-data or application/octet-stream",
        );
      }
      // Counted while read: an undeclared body past the bound fails the parse.
      const counted = limitedTo(bodyOf(c.req.raw, MAX_MULTIPART_BYTES), MAX_MULTIPART_BYTES);
      const form = await new Response(counted, { headers: { "content-type": c.req.header("content-type")! } })
        .formData()
        .catch((err) => {
          if (err instanceof SandboxdError) throw err;
          throw new SandboxdError("bad_request", `the multipart body could not be read: ${String(err)}`);
        });
      const parts = form
        .getAll("file")
        .filter((f) => typeof f !== "string")
        .map((f) => f as unknown as { name: string; stream(): ReadableStream<Uint8Array> });
      if (parts.length === 0) throw new SandboxdError("bad_request", "the multipart body has no file part");
      const out = [];
      for (const f of parts) {
        // One file with `path`: that path; otherwise each part's file name is its path (envd's rule).
        const p = parts.length === 1 && path ? path : f.name;
        if (!p) throw new SandboxdError("bad_request", "a file part has no file name and no path was given");
        out.push(await uploadFor(deps, t, p, user, f.stream(), c.req.raw.signal, metadata));
      }
      return c.json(out);
    } catch (err) {
      return errorAnswer(err);
    }
  });
  return app;
}

function limitedTo(body: ReadableStream<Uint8Array> | null, max: number): ReadableStream<Uint8Array> | null {
  if (!body) return null;
  let total = 0;
  return body.pipeThrough(
    new TransformStream<Uint8Array, Uint8Array>({
      transform(chunk, ctl) {
        total += chunk.byteLength;
        if (total > max)
          ctl.error(new SandboxdError("payload_too_large", `a multipart upload is limited to ${max} bytes`));
        else ctl.enqueue(chunk);
      },
    }),
  );
}
