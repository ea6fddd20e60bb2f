/**
 * A strict streaming tar reader. It follows Go's archive/tar (which skopeo and umoci use) and
 * refuses every header the two could read differently, so that what our scan sees is what they
 * unpack. It reads from a file (skipping data by offset) or from any byte stream (a gunzip'd
 * layer), and never holds more than one chunk or one extension header in memory.
 */
import type { FileHandle } from "node:fs/promises";

/**
 * Parse failures inside the tar reader; the caller turns them into an ImageError with the code
 * that fits where the tar was (outer archive: image_not_tar, layer: image_bad_layer).
 */
export class TarFormatError extends Error {
  constructor(
    message: string,
    readonly unsupported = false,
  ) {
    super(message);
    this.name = "TarFormatError";
  }
}

interface ByteSource {
  read(max: number): Promise<Buffer | null>;
  /** Skips without reading where the source can (files); false when that passes the end. */
  skip?(n: number): Promise<boolean>;
  close?(): Promise<void>;
}

/** Read size for files: big enough to keep syscalls cheap, small enough to stay in cache. */
export const READ_CHUNK = 256 * 1024;

export function fileSource(fh: FileHandle, size: number): ByteSource {
  let pos = 0;
  return {
    async read(max) {
      if (pos >= size) return null;
      const buf = Buffer.allocUnsafe(Math.min(max, size - pos));
      const { bytesRead } = await fh.read(buf, 0, buf.length, pos);
      if (bytesRead === 0) return null;
      pos += bytesRead;
      return buf.subarray(0, bytesRead);
    },
    async skip(n) {
      if (pos + n > size) return false;
      pos += n;
      return true;
    },
  };
}

export function iterSource(src: AsyncIterable<Uint8Array>): ByteSource {
  const it = src[Symbol.asyncIterator]();
  return {
    async read() {
      for (;;) {
        const r = await it.next();
        if (r.done) return null;
        if (r.value.length > 0) return Buffer.from(r.value.buffer, r.value.byteOffset, r.value.length);
      }
    },
    async close() {
      await it.return?.();
    },
  };
}

export class ByteReader {
  private pending: Buffer = Buffer.alloc(0);
  position = 0;
  constructor(private readonly src: ByteSource) {}

  private async fill(): Promise<boolean> {
    if (this.pending.length > 0) return true;
    const c = await this.src.read(READ_CHUNK);
    if (c === null || c.length === 0) return false;
    this.pending = c;
    return true;
  }

  /** Exactly n bytes; null at a clean end (no byte left); throws when the data stops midway. */
  async readExact(n: number): Promise<Buffer | null> {
    const parts: Buffer[] = [];
    let got = 0;
    while (got < n) {
      if (!(await this.fill())) {
        if (got === 0) return null;
        throw new TarFormatError("truncated archive");
      }
      const take = Math.min(n - got, this.pending.length);
      parts.push(this.pending.subarray(0, take));
      this.pending = this.pending.subarray(take);
      got += take;
    }
    this.position += n;
    return parts.length === 1 ? (parts[0] as Buffer) : Buffer.concat(parts);
  }

  async *stream(n: number): AsyncGenerator<Buffer> {
    let left = n;
    while (left > 0) {
      if (!(await this.fill())) throw new TarFormatError("truncated archive");
      const take = Math.min(left, this.pending.length);
      const chunk = this.pending.subarray(0, take);
      this.pending = this.pending.subarray(take);
      this.position += take;
      left -= take;
      yield chunk;
    }
  }

  async skip(n: number): Promise<void> {
    const fromPending = Math.min(n, this.pending.length);
    this.pending = this.pending.subarray(fromPending);
    this.position += fromPending;
    let left = n - fromPending;
    if (left === 0) return;
    if (this.src.skip) {
      if (!(await this.src.skip(left))) throw new TarFormatError("truncated archive");
      this.position += left;
      return;
    }
    for await (const c of this.stream(left)) left -= c.length;
  }

  /** Reads and discards everything left (trailing data still has to be hashed and counted). */
  async drain(): Promise<void> {
    while (await this.fill()) {
      this.position += this.pending.length;
      this.pending = Buffer.alloc(0);
    }
  }

  async close(): Promise<void> {
    await this.src.close?.();
  }
}

export type TarEntryType = "file" | "directory" | "symlink" | "link" | "char" | "block" | "fifo";

export interface TarHeader {
  name: string;
  linkname: string;
  type: TarEntryType;
  size: number;
  mode: number;
  uid: number;
  gid: number;
}

export interface TarEntry {
  header: TarHeader;
  /** Offset of the entry's data in the tar stream. */
  offset: number;
  /** The entry's data; the reader skips what the consumer leaves unread. */
  body(): AsyncGenerator<Buffer>;
}

/** PAX and GNU long-name records are held in memory: 1 MiB is far beyond PATH_MAX. */
const MAX_TAR_META = 1024 * 1024;
export const BLOCK = 512;

function cString(buf: Buffer, start: number, len: number): string {
  const field = buf.subarray(start, start + len);
  const nul = field.indexOf(0);
  return (nul === -1 ? field : field.subarray(0, nul)).toString("utf8");
}

/** A numeric header field: octal text, or GNU base-256 when the top bit is set (as Go reads it). */
function tarNumber(buf: Buffer, start: number, len: number): number {
  const field = buf.subarray(start, start + len);
  const first = field[0] ?? 0;
  if (first & 0x80) {
    if (first === 0xff) throw new TarFormatError("negative number in tar header");
    let v = first & 0x7f;
    for (let i = 1; i < field.length; i++) {
      v = v * 256 + (field[i] as number);
      if (v > Number.MAX_SAFE_INTEGER) throw new TarFormatError("number overflow in tar header");
    }
    return v;
  }
  const text = field.toString("latin1").replace(/^[ \0]+|[ \0]+$/g, "");
  if (text === "") return 0;
  if (!/^[0-7]+$/.test(text)) throw new TarFormatError("bad octal number in tar header");
  const v = Number.parseInt(text, 8);
  if (!Number.isSafeInteger(v)) throw new TarFormatError("number overflow in tar header");
  return v;
}

function checksumOk(block: Buffer): boolean {
  let unsigned = 0;
  let signed = 0;
  for (let i = 0; i < BLOCK; i++) {
    const b = i >= 148 && i < 156 ? 0x20 : (block[i] as number);
    unsigned += b;
    signed += b > 127 ? b - 256 : b;
  }
  let want: number;
  try {
    want = tarNumber(block, 148, 8);
  } catch {
    return false;
  }
  // Go accepts either sum (old tars used signed chars); so do we, to read what it reads.
  return want === unsigned || want === signed;
}

function isZeroBlock(b: Buffer): boolean {
  for (let i = 0; i < b.length; i++) if (b[i] !== 0) return false;
  return true;
}

/** True when `head` starts with a tar header block (valid checksum) or a tar end marker. */
export function looksLikeTar(head: Buffer): boolean {
  if (head.length < BLOCK) return false;
  const first = head.subarray(0, BLOCK);
  if (isZeroBlock(first))
    return head.length >= 2 * BLOCK ? isZeroBlock(head.subarray(BLOCK, 2 * BLOCK)) : true;
  return checksumOk(first);
}

function parsePax(data: Buffer): Map<string, string> {
  const out = new Map<string, string>();
  let pos = 0;
  while (pos < data.length) {
    const sp = data.indexOf(0x20, pos);
    if (sp === -1) throw new TarFormatError("malformed pax record");
    const lenText = data.subarray(pos, sp).toString("latin1");
    if (!/^[0-9]+$/.test(lenText)) throw new TarFormatError("malformed pax record");
    const len = Number.parseInt(lenText, 10);
    if (len <= sp - pos + 1 || pos + len > data.length || data[pos + len - 1] !== 0x0a) {
      throw new TarFormatError("malformed pax record");
    }
    const rec = data.subarray(sp + 1, pos + len - 1).toString("utf8");
    const eq = rec.indexOf("=");
    if (eq <= 0) throw new TarFormatError("malformed pax record");
    out.set(rec.slice(0, eq), rec.slice(eq + 1));
    pos += len;
  }
  return out;
}

/** PAX keys that change how many bytes an entry occupies or where it goes. */
const PAX_LAYOUT_KEYS = ["path", "linkpath", "size"];

function hasSparseKeys(pax: Map<string, string>): boolean {
  for (const k of pax.keys()) if (k.startsWith("GNU.sparse")) return true;
  return false;
}

/**
 * Streams tar entries the way Go's archive/tar reads them, refusing the headers where tar
 * parsers disagree, because a scan that sees different entries than umoci unpacks is no scan:
 *  - header-only types (links, dirs, devices, fifos) with a non-zero size (Go reads no data for
 *    them, others skip `size` bytes: the bytes in between would be entries to one, data to the
 *    other);
 *  - global PAX headers that set a path, link path or size (Go does not carry them forward);
 *  - a PAX size that disagrees with the header's size field;
 *  - both a GNU long name and a PAX path for one entry;
 *  - GNU sparse files (old 'S' type and PAX GNU.sparse.*): their real size is not the archive
 *    size, so they would get round our byte count; and every type we do not know.
 * Reading stops at the end marker (two zero blocks) or at end of input, like Go.
 */
export async function* readTar(r: ByteReader, maxEntryName: number): AsyncGenerator<TarEntry> {
  const ext: PendingExtensions = { pax: null, longName: null, longLink: null };
  for (;;) {
    const block = await r.readExact(BLOCK);
    if (block === null) {
      if (ext.pax || ext.longName !== null || ext.longLink !== null)
        throw new TarFormatError("archive ends inside an entry");
      return;
    }
    if (isZeroBlock(block)) {
      const next = await r.readExact(BLOCK);
      if (next === null || isZeroBlock(next)) return;
      throw new TarFormatError("single zero block inside the archive");
    }
    if (!checksumOk(block)) throw new TarFormatError("bad tar header checksum");
    const magic = block.subarray(257, 263).toString("latin1");
    const version = block.subarray(263, 265).toString("latin1");
    const isUstar = magic === "ustar\0" && version === "00";
    if (isUstar && block.subarray(508, 512).toString("latin1") === "tar\0") {
      throw new TarFormatError("star-format header", true);
    }
    const flag = String.fromCharCode(block[156] as number);
    const rawSize = tarNumber(block, 124, 12);
    let name = cString(block, 0, 100);
    if (isUstar) {
      const prefix = cString(block, 345, 155);
      if (prefix) name = `${prefix}/${name}`;
    }
    const dataStart = r.position;
    const pad = (BLOCK - (rawSize % BLOCK)) % BLOCK;

    if (flag === "x" || flag === "g" || flag === "L" || flag === "K") {
      if (rawSize > MAX_TAR_META) throw new TarFormatError("oversized tar extension header");
      const data = (await r.readExact(rawSize)) ?? Buffer.alloc(0);
      if (data.length !== rawSize) throw new TarFormatError("truncated archive");
      await r.skip(pad);
      applyExtension(flag, data, ext);
      continue;
    }

    let linkname = cString(block, 157, 100);
    if (ext.pax?.has("path")) {
      if (ext.longName !== null) throw new TarFormatError("both a GNU long name and a pax path");
      name = ext.pax.get("path") as string;
    }
    if (ext.pax?.has("linkpath")) {
      if (ext.longLink !== null) throw new TarFormatError("both a GNU long link and a pax linkpath");
      linkname = ext.pax.get("linkpath") as string;
    }
    if (ext.longName !== null) name = ext.longName;
    if (ext.longLink !== null) linkname = ext.longLink;
    const paxSize = ext.pax?.get("size");
    if (paxSize !== undefined && (!/^[0-9]+$/.test(paxSize) || Number(paxSize) !== rawSize)) {
      throw new TarFormatError("pax size disagrees with the header size");
    }
    ext.pax = null;
    ext.longName = null;
    ext.longLink = null;
    if (name.length > maxEntryName || linkname.length > maxEntryName) {
      throw new TarFormatError("entry name longer than PATH_MAX");
    }

    const type = entryType(flag, name);
    if (type !== "file" && rawSize !== 0) throw new TarFormatError(`${type} entry with a data size`);

    const header: TarHeader = {
      name,
      linkname,
      type,
      size: rawSize,
      mode: tarNumber(block, 100, 8),
      uid: tarNumber(block, 108, 8),
      gid: tarNumber(block, 116, 8),
    };
    yield { header, offset: dataStart, body: () => r.stream(Math.max(0, dataStart + rawSize - r.position)) };
    const left = dataStart + rawSize - r.position;
    if (left < 0) throw new TarFormatError("entry body over-read");
    await r.skip(left + pad);
  }
}

/** The entry type a header's type flag names; sparse files and unknown types are refused. */
function entryType(flag: string, name: string): TarEntryType {
  switch (flag) {
    case "\0":
      return name.endsWith("/") ? "directory" : "file";
    case "0":
    case "7":
      return "file";
    case "1":
      return "link";
    case "2":
      return "symlink";
    case "3":
      return "char";
    case "4":
      return "block";
    case "5":
      return "directory";
    case "6":
      return "fifo";
    case "S":
      throw new TarFormatError("sparse files are not supported", true);
    default:
      throw new TarFormatError(`unsupported tar entry type ${JSON.stringify(flag)}`, true);
  }
}

/** The extension headers read so far for the next entry (PAX, GNU long name, GNU long link). */
interface PendingExtensions {
  pax: Map<string, string> | null;
  longName: string | null;
  longLink: string | null;
}

/** Takes in one extension header's data ('x', 'g', 'L' or 'K'); a second one of a kind is refused. */
function applyExtension(flag: string, data: Buffer, ext: PendingExtensions): void {
  if (flag === "x") {
    if (ext.pax) throw new TarFormatError("two pax headers for one entry");
    ext.pax = parsePax(data);
    if (hasSparseKeys(ext.pax)) throw new TarFormatError("sparse files are not supported", true);
  } else if (flag === "g") {
    const g = parsePax(data);
    if (hasSparseKeys(g) || PAX_LAYOUT_KEYS.some((k) => g.has(k))) {
      throw new TarFormatError("global pax header sets path, linkpath or size");
    }
  } else {
    const nul = data.indexOf(0);
    const text = (nul === -1 ? data : data.subarray(0, nul)).toString("utf8");
    if (flag === "L") {
      if (ext.longName !== null) throw new TarFormatError("two GNU long names for one entry");
      ext.longName = text;
    } else {
      if (ext.longLink !== null) throw new TarFormatError("two GNU long links for one entry");
      ext.longLink = text;
    }
  }
}
