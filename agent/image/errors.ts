/**
 * The importer's one error type and its stable codes. Every stage throws an ImageError with the
 * code that says what was wrong with the input (or which tool failed); callers and tests branch
 * on the code, never on the message text.
 */
import type { z } from "zod";
import { ImageErrorCode, SandboxdError } from "../../contracts/errors.ts";

/**
 * Stable codes (defined in contracts/errors.ts): callers and tests branch on these, never on text.
 * - image_not_found: the source path does not exist
 * - image_not_tar: the source file is not a tar archive (or is a corrupt one)
 * - image_no_manifest: a tar, but no manifest.json / index.json to say what the image is
 * - image_bad_manifest: the manifest or index is malformed or names blobs that are missing
 * - image_bad_config: the image config is not valid JSON of the expected shape
 * - image_bad_layer: a layer is not a (gzip'd) tar, or holds an entry we refuse
 * - image_unsupported: a valid but unsupported feature: zstd layers, sparse files, ...
 * - image_path_escape: an entry name with `..` components or an absolute outer path
 * - image_link_escape: a symlink/hardlink target leaving the archive root
 * - image_too_large: a size or count limit was hit (gzip bombs end here)
 * - image_digest_mismatch: a blob's bytes do not hash to the digest that names it
 * - image_user_unknown: config User names a user or group missing from /etc/passwd, /etc/group
 * - image_no_command: neither Entrypoint nor Cmd, and no command given
 * - image_tool_failed: skopeo, umoci, mkfs.ext4 or qemu-img failed
 */
export { ImageErrorCode };

export class ImageError extends SandboxdError {
  declare readonly code: ImageErrorCode;
  constructor(
    code: ImageErrorCode,
    message: string,
    opts?: { cause?: unknown; details?: Record<string, unknown> },
  ) {
    super(code, message, opts);
    this.name = "ImageError";
  }
}

/** Untrusted JSON (a manifest, an index, a config) as a value of `schema`, or an ImageError with `code`. */
export function parseJson<T>(bytes: Buffer, schema: z.ZodType<T>, code: ImageErrorCode, what: string): T {
  let value: unknown;
  try {
    value = JSON.parse(bytes.toString("utf8"));
  } catch (err) {
    throw new ImageError(code, `${what} is not valid JSON`, { cause: err });
  }
  const parsed = schema.safeParse(value);
  if (!parsed.success) {
    throw new ImageError(
      code,
      `${what} does not have the expected shape: ${parsed.error.issues[0]?.message ?? ""}`,
      {
        cause: parsed.error,
      },
    );
  }
  return parsed.data;
}
