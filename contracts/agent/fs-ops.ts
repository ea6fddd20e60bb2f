/**
 * Filesystem ops beyond the file API's four (docs/agent-api.md "Filesystem ops"): one entry's
 * full stat (owner and group names, symlink target) or a tree's to a depth, `mkdir -p`, a rename
 * and a recursive remove, each run in the guest as the call's user. The E2B data plane
 * (gateway/e2b/envd/filesystem.ts) is their caller. `POST /vms/{id}/files/ops` with one of these
 * bodies; a relative `path` is taken from the user's home directory.
 */
import { z } from "zod";
import { MAX_EXEC_USER_CHARS, MAX_PATH_CHARS } from "../api/limits.ts";

/**
 * Deepest listing asked for at once. 64: deeper than any real tree a client walks in one call;
 * the entries are bounded anyway (MAX_LIST_ENTRIES).
 */
export const MAX_FS_DEPTH = 64;

const Path = z
  .string()
  .min(1)
  .max(MAX_PATH_CHARS)
  .refine((p) => !p.includes("\0"), { message: "path must not contain NUL" });
const User = z.string().min(1).max(MAX_EXEC_USER_CHARS).optional();

/**
 * Bounds of a file's metadata (xattrs `user.e2b.<key>`), E2B's envd's own: a key at most 246
 * bytes (the kernel's 255-byte xattr name less the 9 of `user.e2b.`), and all of a file's keys
 * (each counted with that prefix) and values together at most 4096 bytes (what one ext4 inode's
 * xattr block holds). At most 64 keys: 64 prefixed one-byte keys already fill most of that budget,
 * and a client with more has something other than file metadata in mind.
 */
export const MAX_METADATA_KEY_BYTES = 246;
export const MAX_METADATA_TOTAL_BYTES = 4096;
export const MAX_METADATA_KEYS = 64;
/** The namespace a metadata key lives under as an xattr. */
export const METADATA_XATTR_PREFIX = "user.e2b.";

/**
 * Keys are HTTP header tokens, lowercased (they arrive as `X-Metadata-<key>` header names);
 * values printable US-ASCII. The bounds are checked whole by `metadataProblem`.
 */
const MetadataKey = z
  .string()
  .min(1)
  .max(MAX_METADATA_KEY_BYTES)
  .regex(/^[a-z0-9!#$%&'*+\-.^_`|~]+$/, "a metadata key is a lowercase HTTP header token");
const MetadataValue = z.string().regex(/^[\x20-\x7e]*$/, "a metadata value is printable US-ASCII");
export const Metadata = z.record(MetadataKey, MetadataValue).superRefine((m, ctx) => {
  const problem = metadataProblem(m);
  if (problem) ctx.addIssue({ code: "custom", message: problem });
});

/** Why `m` is past the bounds above, or undefined (ASCII only, so characters are bytes). */
export function metadataProblem(m: Record<string, string>): string | undefined {
  const keys = Object.keys(m);
  if (keys.length > MAX_METADATA_KEYS) return `at most ${MAX_METADATA_KEYS} metadata keys`;
  let total = 0;
  for (const k of keys) {
    if (k.length > MAX_METADATA_KEY_BYTES) return `a metadata key is at most ${MAX_METADATA_KEY_BYTES} bytes`;
    total += METADATA_XATTR_PREFIX.length + k.length + (m[k]?.length ?? 0);
  }
  if (total > MAX_METADATA_TOTAL_BYTES)
    return `metadata is at most ${MAX_METADATA_TOTAL_BYTES} bytes (keys with the ${METADATA_XATTR_PREFIX} prefix, and values)`;
  return undefined;
}

export const FsOpBody = z.discriminatedUnion("op", [
  /** `depth` 0: the entry itself; n: it and everything up to n levels below (symlinks not followed). */
  z.object({
    op: z.literal("stat"),
    path: Path,
    user: User,
    depth: z.int().min(0).max(MAX_FS_DEPTH),
    /** Also each entry's `metadata` (one more guest command for the whole listing). */
    metadata: z.boolean().optional(),
  }),
  /** Creates the directory and its parents; `created: false` when it was a directory already. */
  z.object({ op: z.literal("mkdir"), path: Path, user: User }),
  /** Renames `path` to `to` (replacing a file there), as rename(2) does. */
  z.object({ op: z.literal("move"), path: Path, to: Path, user: User, metadata: z.boolean().optional() }),
  /**
   * Replaces the file's metadata (xattrs `user.e2b.*`) with `metadata`: keys not in it are
   * removed. `check`: only whether the image can (python3 present), nothing changed.
   */
  z.object({
    op: z.literal("setMetadata"),
    path: Path,
    user: User,
    metadata: Metadata,
    check: z.boolean().optional(),
  }),
  /** Removes a file or a whole tree; a missing path is no error. */
  z.object({ op: z.literal("remove"), path: Path, user: User }),
  /** The user's home directory (what relative paths are taken from). */
  z.object({ op: z.literal("home"), user: User }),
]);
export type FsOp = z.input<typeof FsOpBody>;

export const FsEntrySchema = z.object({
  name: z.string(),
  /** Absolute. */
  path: z.string(),
  type: z.enum(["file", "dir", "symlink", "other"]),
  size: z.number().int().min(0),
  /** Permission bits (07777). */
  mode: z.number().int().min(0),
  /** As `ls -l` prints them, e.g. `-rw-r--r--`. */
  permissions: z.string(),
  owner: z.string(),
  group: z.string(),
  /** Last modification, milliseconds since the epoch. */
  mtimeMs: z.number(),
  /** A symlink's target, made absolute against the link's directory. */
  symlinkTarget: z.string().optional(),
  /** Levels below the path asked for (0: that path itself). */
  depth: z.number().int().min(0),
  /**
   * Asked for (`metadata: true`): its xattrs `user.e2b.<key>` as `{key: value}`, prefix removed;
   * absent when it has none, or when the image has no python3 to read them with.
   */
  metadata: z.record(z.string(), z.string()).optional(),
});
export type FsEntry = z.infer<typeof FsEntrySchema>;

export const FsOpAnswerSchema = z.object({
  /** stat, mkdir, move: the entries (mkdir and move: the one at the resulting path). */
  entries: z.array(FsEntrySchema).optional(),
  /** stat: more entries than MAX_LIST_ENTRIES, the rest not listed. */
  truncated: z.boolean().optional(),
  /** mkdir: false when the directory was there already. */
  created: z.boolean().optional(),
  /** home: the user's home directory. */
  home: z.string().optional(),
});
export type FsOpAnswer = z.infer<typeof FsOpAnswerSchema>;
