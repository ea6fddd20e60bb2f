/**
 * The file API of sandboxes and sessions (`/v1/sandboxes/{id}/files`, `/v1/sessions/{id}/files`,
 * docs/files.md "The file API"): the query every route takes and the JSON answers. Upload and download
 * bodies are raw bytes. The agent's contract reuses these (contracts/agent/files.ts).
 */
import { z } from "zod";
import { MAX_EXEC_USER_CHARS, MAX_PATH_CHARS } from "./limits.ts";

export const FilesQuery = z
  .object({
    path: z
      .string()
      .startsWith("/", { message: "path must be absolute" })
      .max(MAX_PATH_CHARS)
      .refine((p) => !p.includes("\0"), { message: "path must not contain NUL" })
      .describe("Absolute path inside the sandbox; resolved by the guest (symlinks and `..` included)."),
    list: z
      .enum(["true", "false"])
      .optional()
      .describe("GET only: `true` lists the directory at `path` instead of downloading a file."),
    user: z
      .string()
      .min(1)
      .max(MAX_EXEC_USER_CHARS)
      .optional()
      .describe(
        "Who reads or writes: a user name of the sandbox's /etc/passwd or a decimal uid (default: the image's user).",
      ),
  })
  .meta({ id: "FilesQuery" });

export const FileWritten = z.object({ path: z.string(), size: z.int().min(0) }).meta({ id: "FileWritten" });

export const FileEntry = z
  .object({
    name: z.string(),
    type: z.enum(["file", "dir", "symlink", "other"]).describe("`other`: a device, FIFO or socket."),
    size: z.int().min(0),
    mode: z.int().min(0).describe("Permission bits, e.g. 420 (0644)."),
    mtime: z.int().describe("Last modification, seconds since the epoch."),
  })
  .meta({ id: "FileEntry" });

export const FileList = z
  .object({
    path: z.string(),
    entries: z.array(FileEntry),
    truncated: z.boolean().optional().describe("More entries than the answer holds (10,000)."),
  })
  .meta({ id: "FileList" });

export const FileDeleted = z
  .object({ deleted: z.literal(true), path: z.string() })
  .meta({ id: "FileDeleted" });
