/**
 * The guest's file ops beyond write/read-whole (docs/guest-protocol.md "Ops"): a directory's
 * entries (LIST_DIR), a removal (REMOVE), and a file of any size read as a stream of frame-sized
 * pieces (READ_FILE with OFFSET). Every answer is one bounded frame, decoded defensively: the guest
 * is not trusted, so a malformed entry fails the op rather than being guessed at.
 */
import { ENTRY_HEADER_LEN, EntryType, MAX_PAYLOAD, Op, Tag } from "../../contracts/guest-protocol.ts";
import { type FileOptions, fsIdentity, type GuestClient, GuestError } from "./client.ts";
import { TlvWriter } from "./codec.ts";

export interface DirEntry {
  name: string;
  type: "file" | "dir" | "symlink" | "other";
  size: number;
  /** Permission bits (07777). */
  mode: number;
  /** Seconds since the epoch. */
  mtime: number;
}

const TYPE_NAME: Record<number, DirEntry["type"]> = {
  [EntryType.FILE]: "file",
  [EntryType.DIR]: "dir",
  [EntryType.SYMLINK]: "symlink",
  [EntryType.OTHER]: "other",
};

/** Up to `max` entries of a directory (the guest caps it too); `truncated` when there are more. */
export async function listDir(
  guest: GuestClient,
  path: string,
  opts: FileOptions & { max?: number } = {},
): Promise<{ entries: DirEntry[]; truncated: boolean }> {
  const w = new TlvWriter().u32(Tag.OP, Op.LIST_DIR).str(Tag.PATH, path);
  if (opts.max !== undefined) w.u32(Tag.MAX_BYTES, opts.max);
  const r = await guest.call(fsIdentity(w, opts));
  const raw = r.getAll(Tag.ENTRY);
  const entries = raw.map((e) => {
    const type = TYPE_NAME[e[0] ?? 0];
    if (e.length < ENTRY_HEADER_LEN + 1 || type === undefined) {
      throw new GuestError("protocol_error", `list_dir: a malformed entry of ${e.length} bytes`, {
        details: { reason: "entry" },
      });
    }
    return {
      name: e.subarray(ENTRY_HEADER_LEN).toString("utf8"),
      type,
      mode: e.readUInt32LE(1),
      size: Number(e.readBigUInt64LE(5)),
      mtime: Number(e.readBigInt64LE(13)),
    };
  });
  const truncated = r.u32(Tag.TRUNCATED) === 1 || (opts.max !== undefined && entries.length > opts.max);
  return { entries: opts.max !== undefined ? entries.slice(0, opts.max) : entries, truncated };
}

/** Removes a file, a symlink or an empty directory (ENOTEMPTY for one with entries). */
export async function removePath(guest: GuestClient, path: string, opts: FileOptions = {}): Promise<void> {
  await guest.call(fsIdentity(new TlvWriter().u32(Tag.OP, Op.REMOVE).str(Tag.PATH, path), opts));
}

/**
 * Each READ_FILE answer's data: a frame less room for its other records. Requests of this size
 * keep each answer within one guest frame (the guest clamps to the same bound).
 */
export const READ_PIECE_BYTES = MAX_PAYLOAD - 4096;

/**
 * A file as a pull stream: each pull reads the next piece (READ_FILE at the offset reached), so
 * only one piece is held at a time and a slow reader simply reads the guest less often. The
 * first piece is read before returning, so a missing file or a directory is an error here, not
 * in the stream. Past `maxBytes` the stream errors (a file that keeps growing, a device that
 * never ends). A file changed while it is read yields a mix of old and new bytes: there is no
 * snapshot, as with `cat`.
 */
export async function readFileStream(
  guest: GuestClient,
  path: string,
  opts: FileOptions & { maxBytes: number; onEnd?: () => void },
): Promise<{ stream: ReadableStream<Uint8Array>; size: number }> {
  const first = await guest.readFile(path, { ...opts, maxBytes: READ_PIECE_BYTES, offset: 0 });
  let offset = first.data.length;
  const more = first.truncated && first.data.length > 0;
  let pending: Uint8Array | undefined = first.data;
  let ended = false;
  const end = () => {
    if (ended) return;
    ended = true;
    opts.onEnd?.();
  };
  const stream = new ReadableStream<Uint8Array>(
    {
      async pull(ctl) {
        try {
          if (pending) {
            const p = pending;
            pending = undefined;
            if (p.length > 0) ctl.enqueue(p);
            if (!more) {
              end();
              ctl.close();
            }
            return;
          }
          if (offset >= opts.maxBytes) {
            throw new GuestError("guest_error", `${path} is larger than ${opts.maxBytes} bytes`, {
              errno: 27, // EFBIG
            });
          }
          const r = await guest.readFile(path, { ...opts, maxBytes: READ_PIECE_BYTES, offset });
          offset += r.data.length;
          if (r.data.length > 0) ctl.enqueue(r.data);
          if (!r.truncated || r.data.length === 0) {
            end();
            ctl.close();
          }
        } catch (err) {
          end();
          ctl.error(err);
        }
      },
      cancel() {
        end();
      },
    },
    // One piece queued at most: the pull above reads the next only when it is taken.
    { highWaterMark: 0 },
  );
  return { stream, size: first.size };
}
