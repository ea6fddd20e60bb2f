/**
 * The wire format of a template copied from one agent to another (template-copy.ts): a header,
 * then a template's files one after another, each as data and zero runs so that sparse files (a
 * RAM file is mostly holes, a qcow2 has unallocated tails) cross as what they hold, not as what
 * they span.
 *
 *   "SBXTPL\0\1" | u32 header length | header (JSON)
 *   for each file, in the header's order:
 *     ( 'D' u32 n, n bytes  |  'Z' u64 n (n zero bytes) )*  'E'
 *   end of stream
 *
 * The reader is written for a hostile sender (another agent, which may be a customer's): the
 * header is bounded and parsed by the caller's schema, every record is checked against the size
 * the header declared for its file before a byte is written (a file cannot grow past it or end
 * short of it), a data record is at most DATA_RECORD_MAX bytes, and anything after the last
 * file's end is refused. Files are written at their offsets into files created here (O_EXCL),
 * truncated to their size first, so zero runs stay holes.
 */
import { constants } from "node:fs";
import { type FileHandle, open } from "node:fs/promises";
import { SandboxdError } from "../../contracts/errors.ts";

export const BUNDLE_MAGIC = Buffer.from("SBXTPL\x00\x01", "latin1");
/** A header is a few KB (an image's env and config); 1 MiB bounds a sender that lies. */
export const HEADER_MAX_BYTES = 1024 * 1024;
/** One data record: 1 MiB keeps the reader's buffer small whatever the sender does. */
export const DATA_RECORD_MAX = 1024 * 1024;
/** The zero test's block: a run of whole zero blocks becomes a hole. 64 KiB = a qcow2 cluster. */
const BLOCK = 64 * 1024;
const ZERO_BLOCK = Buffer.alloc(BLOCK);

const REC_DATA = 0x44; // 'D'
const REC_ZERO = 0x5a; // 'Z'
const REC_END = 0x45; // 'E'

/** A bundle that breaks the format or its own header: `bad_request`, naming what broke. */
export class BundleError extends SandboxdError {
  constructor(message: string, opts?: { cause?: unknown }) {
    super("bad_request", `template bundle: ${message}`, opts);
    this.name = "BundleError";
  }
}

/** One file of a bundle as the writer sends it: its path on this host and its size. */
export interface BundleSource {
  path: string;
  size: number;
}

function u32(n: number): Buffer {
  const b = Buffer.alloc(4);
  b.writeUInt32BE(n);
  return b;
}

/** The bundle of `header` and `files` (sizes as measured now: the files must be frozen). */
export async function* encodeBundle(header: unknown, files: readonly BundleSource[]): AsyncGenerator<Buffer> {
  const json = Buffer.from(JSON.stringify(header), "utf8");
  if (json.length > HEADER_MAX_BYTES) throw new BundleError(`header of ${json.length} bytes is too large`);
  yield Buffer.concat([BUNDLE_MAGIC, u32(json.length), json]);
  for (const f of files) yield* encodeFile(f);
}

async function* encodeFile(f: BundleSource): AsyncGenerator<Buffer> {
  const fh = await open(f.path, constants.O_RDONLY | constants.O_NOFOLLOW);
  try {
    const buf = Buffer.alloc(DATA_RECORD_MAX);
    let offset = 0;
    let zeros = 0;
    const zeroRecord = () => {
      const b = Buffer.alloc(9);
      b[0] = REC_ZERO;
      b.writeBigUInt64BE(BigInt(zeros), 1);
      zeros = 0;
      return b;
    };
    while (offset < f.size) {
      const want = Math.min(buf.length, f.size - offset);
      const { bytesRead } = await fh.read(buf, 0, want, offset);
      if (bytesRead !== want) throw new BundleError(`${f.path} shrank while it was sent`);
      // Whole zero blocks become a zero run; the rest is sent as one data record per read.
      let dataStart = -1;
      const out: Buffer[] = [];
      for (let at = 0; at < want; at += BLOCK) {
        const block = buf.subarray(at, Math.min(at + BLOCK, want));
        if (block.equals(ZERO_BLOCK.subarray(0, block.length))) {
          if (dataStart >= 0) {
            out.push(dataRecord(buf.subarray(dataStart, at)));
            dataStart = -1;
          }
          zeros += block.length;
        } else {
          if (zeros > 0) out.push(zeroRecord());
          if (dataStart < 0) dataStart = at;
        }
      }
      if (dataStart >= 0) out.push(dataRecord(buf.subarray(dataStart, want)));
      offset += want;
      if (out.length) yield Buffer.concat(out);
    }
    yield zeros > 0 ? Buffer.concat([zeroRecord(), Buffer.from([REC_END])]) : Buffer.from([REC_END]);
  } finally {
    await fh.close();
  }
}

function dataRecord(data: Buffer): Buffer {
  const head = Buffer.alloc(5);
  head[0] = REC_DATA;
  head.writeUInt32BE(data.length, 1);
  return Buffer.concat([head, data]);
}

/** Reads exactly the bytes asked of a stream, holding at most one chunk beyond them. */
export class ExactReader {
  private readonly reader: {
    read(): Promise<{ done: boolean; value?: Uint8Array }>;
    cancel(): Promise<void>;
  };
  private pending: Buffer = Buffer.alloc(0);
  private ended = false;

  constructor(stream: ReadableStream<Uint8Array>) {
    this.reader = stream.getReader() as unknown as ExactReader["reader"];
  }

  /** `n` bytes, or a BundleError naming `what` when the stream ends first. */
  async read(n: number, what: string): Promise<Buffer> {
    while (this.pending.length < n) {
      const chunk = this.ended ? undefined : await this.reader.read();
      if (!chunk || chunk.done || !chunk.value) {
        this.ended = true;
        throw new BundleError(`the stream ended inside ${what}`);
      }
      this.pending =
        this.pending.length === 0 ? Buffer.from(chunk.value) : Buffer.concat([this.pending, chunk.value]);
    }
    const out = this.pending.subarray(0, n);
    this.pending = this.pending.subarray(n);
    return out;
  }

  /** True when nothing is left: no held bytes and the stream at its end. */
  async atEnd(): Promise<boolean> {
    if (this.pending.length) return false;
    for (;;) {
      const chunk = await this.reader.read();
      if (chunk.done || !chunk.value) return true;
      if (chunk.value.length) {
        this.pending = Buffer.from(chunk.value);
        return false;
      }
    }
  }

  cancel(): void {
    // Ending the read early: what the stream says then is of no interest.
    this.reader.cancel().catch(() => {});
  }
}

/** The bundle's header as JSON (the caller parses it with its schema). */
export async function readBundleHeader(r: ExactReader): Promise<unknown> {
  const magic = await r.read(BUNDLE_MAGIC.length, "the magic");
  if (!magic.equals(BUNDLE_MAGIC)) throw new BundleError("not a sandboxd template bundle (bad magic)");
  const len = (await r.read(4, "the header length")).readUInt32BE(0);
  if (len > HEADER_MAX_BYTES) throw new BundleError(`header of ${len} bytes is over ${HEADER_MAX_BYTES}`);
  const text = (await r.read(len, "the header")).toString("utf8");
  try {
    return JSON.parse(text);
  } catch (err) {
    throw new BundleError("the header is not JSON", { cause: err });
  }
}

/**
 * Writes the next file of the bundle to `path` (created here, must not exist), which the header
 * declared `size` bytes long; `signal` stops it between records.
 */
export async function readBundleFile(
  r: ExactReader,
  name: string,
  path: string,
  size: number,
  signal?: AbortSignal,
): Promise<void> {
  const fh: FileHandle = await open(
    path,
    constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL | constants.O_NOFOLLOW,
    0o600,
  );
  try {
    await fh.truncate(size);
    let offset = 0;
    for (;;) {
      if (signal?.aborted) throw new SandboxdError("gone", "the copy was cancelled");
      const kind = (await r.read(1, `${name}'s records`))[0];
      if (kind === REC_END) {
        if (offset !== size) throw new BundleError(`${name} ended at ${offset} of its ${size} bytes`);
        return;
      }
      if (kind === REC_ZERO) {
        const n = Number((await r.read(8, `${name}'s zero run`)).readBigUInt64BE(0));
        if (n <= 0 || n > size - offset)
          throw new BundleError(`${name}: a zero run of ${n} bytes at ${offset}`);
        offset += n;
        continue;
      }
      if (kind !== REC_DATA) throw new BundleError(`${name}: unknown record 0x${kind?.toString(16)}`);
      const n = (await r.read(4, `${name}'s data length`)).readUInt32BE(0);
      if (n === 0 || n > DATA_RECORD_MAX || n > size - offset)
        throw new BundleError(`${name}: a data record of ${n} bytes at ${offset} of ${size}`);
      const data = await r.read(n, `${name}'s data`);
      let done = 0;
      while (done < n) done += (await fh.write(data, done, n - done, offset + done)).bytesWritten;
      offset += n;
    }
  } finally {
    await fh.close();
  }
}
