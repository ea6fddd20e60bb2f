/**
 * The file API of a sandbox (docs/agent-api.md "Files"): upload, download, list and remove, each
 * in the guest and as the image's user (or the request's `user`), beside whatever exec runs: the
 * guest agent serves file ops between an exec's frames, so none of these is `busy`. The VM is
 * woken from an idle pause first and kept awake until the call (a download: its stream) ends.
 * Paths are the guest's: it resolves them, symlinks and `..` included, with the user's rights.
 */

import type { z } from "zod";
import type { FileEntry, FileList, FileWritten } from "../../contracts/api/files.ts";
import { MAX_FILE_TRANSFER_BYTES, MAX_LIST_ENTRIES } from "../../contracts/api/limits.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import type { FileOptions, GuestClient } from "../guest/client.ts";
import { GuestError } from "../guest/client.ts";
import { listDir, readFileStream, removePath } from "../guest/fs-ops.ts";
import { resolveExecUser } from "./exec-run.ts";
import type { SandboxManager } from "./manager.ts";

type Held = Awaited<ReturnType<SandboxManager["holdGuest"]>>;

export interface FileCall {
  vmId: string;
  path: string;
  /** A user name or decimal uid; default the image's user. */
  user?: string | undefined;
}

const ERRNO = { ENOENT: 2, EEXIST: 17, ENOTEMPTY: 39 };

/** Runs `fn` with the sandbox's guest held awake and the call's identity resolved. */
async function withGuest<T>(
  manager: Pick<SandboxManager, "holdGuest">,
  call: FileCall,
  fn: (guest: GuestClient, who: FileOptions, held: Held) => Promise<T>,
  keep = false,
): Promise<T> {
  const held = await manager.holdGuest(call.vmId);
  try {
    const u = call.user === undefined ? held.image.user : await resolveExecUser(held.guest, call.user);
    return await fn(held.guest, { fsUid: u.uid, fsGid: u.gid }, held);
  } catch (err) {
    keep = false;
    throw fileError(err, call.path);
  } finally {
    if (!keep) held.release();
  }
}

export async function uploadFile(
  manager: Pick<SandboxManager, "holdGuest">,
  call: FileCall,
  body: AsyncIterable<Uint8Array>,
): Promise<z.infer<typeof FileWritten>> {
  return withGuest(manager, call, async (guest, who) => {
    // A file created by the API gets the usual 0644; its owner is the user it was written as.
    const size = await guest.writeFileFrom(call.path, body, { ...who, mode: 0o644 });
    return { path: call.path, size };
  });
}

/** The file's bytes as a stream; the VM stays held until the stream ends or is cancelled. */
export async function downloadFile(
  manager: Pick<SandboxManager, "holdGuest">,
  call: FileCall,
): Promise<ReadableStream<Uint8Array>> {
  const r = await withGuest(
    manager,
    call,
    (guest, who, held) =>
      readFileStream(guest, call.path, {
        ...who,
        maxBytes: MAX_FILE_TRANSFER_BYTES,
        onEnd: () => held.release(),
      }),
    true,
  );
  return r.stream;
}

export async function listFiles(
  manager: Pick<SandboxManager, "holdGuest">,
  call: FileCall,
): Promise<z.infer<typeof FileList>> {
  return withGuest(manager, call, async (guest, who) => {
    const r = await listDir(guest, call.path, { ...who, max: MAX_LIST_ENTRIES });
    const entries: z.infer<typeof FileEntry>[] = r.entries;
    return { path: call.path, entries, ...(r.truncated ? { truncated: true } : {}) };
  });
}

export async function removeFile(manager: Pick<SandboxManager, "holdGuest">, call: FileCall): Promise<void> {
  await withGuest(manager, call, (guest, who) => removePath(guest, call.path, who));
}

/**
 * The guest's refusal in the API's terms: a missing path is `not_found`, a non-empty directory
 * `conflict`, anything else the guest refused (a directory where a file was asked for, no
 * permission, its disk full) `invalid_file` (400) with the guest's reason.
 */
function fileError(err: unknown, path: string): unknown {
  if (!(err instanceof GuestError) || err.code !== "guest_error") return err;
  const details = { path, errno: err.errno };
  if (err.errno === ERRNO.ENOENT) {
    return new SandboxdError("not_found", `${path}: no such file or directory in the sandbox`, {
      cause: err,
      details,
    });
  }
  if (err.errno === ERRNO.ENOTEMPTY || err.errno === ERRNO.EEXIST) {
    return new SandboxdError("conflict", `${path}: ${err.message}`, { cause: err, details });
  }
  return new SandboxdError("invalid_file", `${path} was refused by the sandbox: ${err.message}`, {
    cause: err,
    details,
  });
}
