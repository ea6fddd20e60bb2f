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

export const FsOpBody = z.discriminatedUnion("op", [
  /** `depth` 0: the entry itself; n: it and everything up to n levels below (symlinks not followed). */
  z.object({ op: z.literal("stat"), path: Path, user: User, depth: z.int().min(0).max(MAX_FS_DEPTH) }),
  /** Creates the directory and its parents; `created: false` when it was a directory already. */
  z.object({ op: z.literal("mkdir"), path: Path, user: User }),
  /** Renames `path` to `to` (replacing a file there), as rename(2) does. */
  z.object({ op: z.literal("move"), path: Path, to: Path, user: User }),
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
