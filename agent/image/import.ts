/**
 * Image import: a `docker save` tar (docker-archive), an `oci-archive` tar or an OCI layout
 * directory becomes a cached ext4 base disk plus the normalised run config, keyed by the image's
 * config digest (spec section 1: the image runs unmodified, its entrypoint, env, working dir and
 * PATH as in a container runtime).
 *
 *   source --(our own scan: paths, links, sizes, digests)--> skopeo copy --> OCI layout (work dir)
 *          --> umoci raw unpack --> rootfs dir --> mkfs.ext4 -d --> qemu-img convert --> cache
 *
 * The input is hostile. Before skopeo or umoci see a byte we read the archive and every layer
 * ourselves, streaming, with a tar reader that follows Go's archive/tar (which skopeo and umoci
 * use) and refuses every header the two could read differently; we check names, link targets,
 * entry counts, decompressed sizes and digests, and stop at the first problem. Everything is
 * written under a private work directory in `<dataDir>/tmp/` that is removed on success and on
 * failure; the finished image appears in `<dataDir>/images/<hex>/` by one rename.
 */
import { createHash, type Hash } from "node:crypto";
import { constants as fsc, type Stats } from "node:fs";
import {
  type FileHandle,
  lstat,
  mkdir,
  mkdtemp,
  open,
  readdir,
  readFile,
  readlink,
  rename,
  rm,
  stat,
  symlink,
  writeFile,
} from "node:fs/promises";
import { join, resolve as resolvePath } from "node:path";
import { Readable } from "node:stream";
import { createGunzip } from "node:zlib";
import { z } from "zod";
import { SandboxdError } from "../../contracts/errors.ts";

// ---------------------------------------------------------------------------------------------
// Errors

/** Stable codes: callers (and tests) branch on these, never on message text (style.md habit 3). */
export const ImageErrorCode = [
  "image_not_found", // the source path does not exist
  "image_not_tar", // the source file is not a tar archive (or is a corrupt one)
  "image_no_manifest", // a tar, but no manifest.json / index.json to say what the image is
  "image_bad_manifest", // the manifest or index is malformed or names blobs that are missing
  "image_bad_config", // the image config is not valid JSON of the expected shape
  "image_bad_layer", // a layer is not a (gzip'd) tar, or holds an entry we refuse
  "image_unsupported", // a valid but unsupported feature: zstd layers, sparse files, ...
  "image_path_escape", // an entry name with `..` components or an absolute outer path
  "image_link_escape", // a symlink/hardlink target leaving the archive root
  "image_too_large", // a size or count limit was hit (gzip bombs end here)
  "image_digest_mismatch", // a blob's bytes do not hash to the digest that names it
  "image_user_unknown", // config User names a user or group missing from /etc/passwd, /etc/group
  "image_no_command", // neither Entrypoint nor Cmd, and no command given
  "image_tool_failed", // skopeo, umoci, mkfs.ext4 or qemu-img failed
] as const;
export type ImageErrorCode = (typeof ImageErrorCode)[number];

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

// ---------------------------------------------------------------------------------------------
// Limits and sizing

export interface ImportLimits {
  /**
   * Total bytes of decompressed layer streams. 8 GiB: larger than any image we mean to run as a
   * sandbox template (a full CUDA/PyTorch image is ~6-8 GiB unpacked), small enough that a gzip
   * bomb (1000:1 for zeros) is stopped before it fills the host's disk; counted while streaming,
   * so the scan aborts as soon as the limit is crossed.
   */
  maxUnpackedBytes: number;
  /** Tar entries over the archive and all layers: bounds the scan's time and the rootfs' inodes. */
  maxEntries: number;
  /** Layers per image: overlay-based runtimes stop at 127-128; more is abuse, not an image. */
  maxLayers: number;
  /** manifest.json / index.json / manifests / configs are held in memory: 4 MiB is 100x a real one. */
  maxMetadataBytes: number;
  /** One entry name or link target: Linux PATH_MAX. */
  maxPathBytes: number;
}

export const DEFAULT_IMPORT_LIMITS: ImportLimits = {
  maxUnpackedBytes: 8 * 1024 ** 3,
  maxEntries: 1_000_000,
  maxLayers: 128,
  maxMetadataBytes: 4 * 1024 ** 2,
  maxPathBytes: 4096,
};

/**
 * Base disk size = max(minBytes, factor * rootfsBytes + headroomBytes), rounded up to 1 MiB.
 * The guest writes into its copy-on-write overlay of this disk and has no other writable disk,
 * so the free space here is all it gets: a floor of 256 MiB for tiny images, 1.5x for ext4's own
 * metadata (inode tables, bitmaps, journal: a few %) plus room for packages and caches in big ones,
 * and 128 MiB on top for the journal and small images. Free space is sparse in the qcow2 and
 * costs the host nothing until written.
 */
export interface DiskSizing {
  minBytes: number;
  factor: number;
  headroomBytes: number;
}

export const DEFAULT_DISK_SIZING: DiskSizing = {
  minBytes: 256 * 1024 ** 2,
  factor: 1.5,
  headroomBytes: 128 * 1024 ** 2,
};

export function diskSizeFor(rootfsBytes: number, sizing: DiskSizing = DEFAULT_DISK_SIZING): number {
  const want = Math.max(sizing.minBytes, Math.ceil(sizing.factor * rootfsBytes) + sizing.headroomBytes);
  return Math.ceil(want / MIB) * MIB;
}

const MIB = 1024 * 1024;

// ---------------------------------------------------------------------------------------------
// Public types

export interface ImageUser {
  uid: number;
  gid: number;
  name: string;
}

/** The image config as the guest needs it to start the process the way Docker would. */
export interface ImageConfig {
  env: string[];
  workingDir: string;
  entrypoint: string[];
  cmd: string[];
  user: ImageUser;
  /** `sha256:<hex>` of the source image's config blob (Docker's image id). */
  digest: string;
  /** TCP ports from ExposedPorts (the only protocol the connect tunnel carries). */
  exposedPorts: number[];
}

export interface ImportedImage {
  digest: string;
  /** `<dataDir>/images/<hex>` */
  dir: string;
  /** The base disk: an ext4 filesystem in qcow2; VMs use copy-on-write overlays on top. */
  disk: string;
  config: ImageConfig;
  /** True when the image was already in the cache and nothing was unpacked. */
  cached: boolean;
  format: ImageFormat;
}

export type ImageFormat = "docker-archive" | "oci-archive" | "oci-layout";

export interface ImportOptions {
  source: string;
  dataDir: string;
  log?: (m: string) => void;
  limits?: Partial<ImportLimits>;
  disk?: Partial<DiskSizing>;
}

/** Docker's PATH for images whose Env lacks one (moby `oci.DefaultPathEnv` on Linux). */
export const DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

// ---------------------------------------------------------------------------------------------
// Path safety (pure; property-tested in import.test.ts)

/**
 * Cleans a tar entry name into a root-relative path ('' = the root itself), or null when it is
 * unsafe: NUL bytes, any `..` component (no legitimate archive needs one, and refusing them all
 * means a later symlink can never turn `a/..` into an escape), or an absolute name where the
 * caller does not allow one. In layers absolute names are joined under the rootfs, as Docker does.
 */
export function normalizeEntryPath(name: string, opts: { allowAbsolute: boolean }): string | null {
  if (name.length === 0 || name.includes("\0")) return null;
  if (name.startsWith("/") && !opts.allowAbsolute) return null;
  const parts: string[] = [];
  for (const p of name.split("/")) {
    if (p === "" || p === ".") continue;
    if (p === "..") return null;
    parts.push(p);
  }
  return parts.join("/");
}

export function isSafeEntryPath(
  name: string,
  opts: { allowAbsolute: boolean } = { allowAbsolute: false },
): boolean {
  return normalizeEntryPath(name, opts) !== null;
}

/**
 * Resolves a relative symlink `target` found in directory `baseDir` (root-relative, already
 * clean) lexically; null when it is absolute or climbs above the root. The result never holds
 * `.` or `..` components, so joining it under any root stays inside that root.
 */
export function resolveInside(baseDir: string, target: string): string | null {
  if (target.length === 0 || target.includes("\0") || target.startsWith("/")) return null;
  const stack = baseDir.split("/").filter((p) => p !== "" && p !== ".");
  if (stack.includes("..")) return null;
  for (const p of target.split("/")) {
    if (p === "" || p === ".") continue;
    if (p === "..") {
      if (stack.length === 0) return null;
      stack.pop();
    } else stack.push(p);
  }
  return stack.join("/");
}

/** Symlink hops allowed while resolving one path: the kernel's own limit (MAXSYMLINKS). */
const MAX_SYMLINK_HOPS = 40;

/**
 * Resolves `path` inside the directory `root` as the guest kernel would with `root` as `/`:
 * symlinks (absolute ones too) are followed relative to `root`, and `..` stops at `root`. Returns
 * a host path that is always `root` or below it, or null for loops, too many hops or a
 * non-directory in the middle. A missing final component resolves to where it would be.
 * We read /etc/passwd and /etc/group of untrusted rootfs trees through this.
 */
export async function resolveInRootfs(root: string, path: string): Promise<string | null> {
  let pending = path.split("/").filter((p) => p !== "" && p !== ".");
  const done: string[] = [];
  let hops = 0;
  while (pending.length > 0) {
    const comp = pending[0] as string;
    pending = pending.slice(1);
    if (comp === "..") {
      done.pop();
      continue;
    }
    const host = join(root, ...done, comp);
    let st: Stats;
    try {
      st = await lstat(host);
    } catch (err) {
      const code = (err as NodeJS.ErrnoException).code;
      if (code === "ENOENT" && pending.length === 0) {
        done.push(comp);
        break;
      }
      return null;
    }
    if (st.isSymbolicLink()) {
      if (++hops > MAX_SYMLINK_HOPS) return null;
      const target = await readlink(host);
      if (target.startsWith("/")) done.length = 0;
      pending = [...target.split("/").filter((p) => p !== "" && p !== "."), ...pending];
      continue;
    }
    if (pending.length > 0 && !st.isDirectory()) return null;
    done.push(comp);
  }
  return done.length === 0 ? root : join(root, ...done);
}

// ---------------------------------------------------------------------------------------------
// A strict streaming tar reader

/**
 * Parse failures inside the tar reader; the caller turns them into an ImageError with the code
 * that fits where the tar was (outer archive: image_not_tar, layer: image_bad_layer).
 */
class TarFormatError extends Error {
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
const READ_CHUNK = 256 * 1024;

function fileSource(fh: FileHandle, size: number): ByteSource {
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

function iterSource(src: AsyncIterable<Uint8Array>): ByteSource {
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

class ByteReader {
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

interface TarEntry {
  header: TarHeader;
  /** Offset of the entry's data in the tar stream. */
  offset: number;
  /** The entry's data; the reader skips what the consumer leaves unread. */
  body(): AsyncGenerator<Buffer>;
}

/** PAX and GNU long-name records are held in memory: 1 MiB is far beyond PATH_MAX. */
const MAX_TAR_META = 1024 * 1024;
const BLOCK = 512;

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
function looksLikeTar(head: Buffer): boolean {
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
async function* readTar(r: ByteReader, maxEntryName: number): AsyncGenerator<TarEntry> {
  let pax: Map<string, string> | null = null;
  let longName: string | null = null;
  let longLink: string | null = null;
  for (;;) {
    const block = await r.readExact(BLOCK);
    if (block === null) {
      if (pax || longName !== null || longLink !== null)
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
      if (flag === "x") {
        if (pax) throw new TarFormatError("two pax headers for one entry");
        pax = parsePax(data);
        if (hasSparseKeys(pax)) throw new TarFormatError("sparse files are not supported", true);
      } else if (flag === "g") {
        const g = parsePax(data);
        if (hasSparseKeys(g) || PAX_LAYOUT_KEYS.some((k) => g.has(k))) {
          throw new TarFormatError("global pax header sets path, linkpath or size");
        }
      } else {
        const nul = data.indexOf(0);
        const text = (nul === -1 ? data : data.subarray(0, nul)).toString("utf8");
        if (flag === "L") {
          if (longName !== null) throw new TarFormatError("two GNU long names for one entry");
          longName = text;
        } else {
          if (longLink !== null) throw new TarFormatError("two GNU long links for one entry");
          longLink = text;
        }
      }
      continue;
    }

    let linkname = cString(block, 157, 100);
    if (pax?.has("path")) {
      if (longName !== null) throw new TarFormatError("both a GNU long name and a pax path");
      name = pax.get("path") as string;
    }
    if (pax?.has("linkpath")) {
      if (longLink !== null) throw new TarFormatError("both a GNU long link and a pax linkpath");
      linkname = pax.get("linkpath") as string;
    }
    if (longName !== null) name = longName;
    if (longLink !== null) linkname = longLink;
    const paxSize = pax?.get("size");
    if (paxSize !== undefined && (!/^[0-9]+$/.test(paxSize) || Number(paxSize) !== rawSize)) {
      throw new TarFormatError("pax size disagrees with the header size");
    }
    pax = null;
    longName = null;
    longLink = null;
    if (name.length > maxEntryName || linkname.length > maxEntryName) {
      throw new TarFormatError("entry name longer than PATH_MAX");
    }

    let type: TarEntryType;
    switch (flag) {
      case "\0":
        type = name.endsWith("/") ? "directory" : "file";
        break;
      case "0":
      case "7":
        type = "file";
        break;
      case "1":
        type = "link";
        break;
      case "2":
        type = "symlink";
        break;
      case "3":
        type = "char";
        break;
      case "4":
        type = "block";
        break;
      case "5":
        type = "directory";
        break;
      case "6":
        type = "fifo";
        break;
      case "S":
        throw new TarFormatError("sparse files are not supported", true);
      default:
        throw new TarFormatError(`unsupported tar entry type ${JSON.stringify(flag)}`, true);
    }
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

// ---------------------------------------------------------------------------------------------
// Blob scanning: sniff, hash, decompress, count, check every layer entry

interface Budget {
  limits: ImportLimits;
  bytes: number;
  entries: number;
}

function chargeBytes(b: Budget, n: number): void {
  b.bytes += n;
  if (b.bytes > b.limits.maxUnpackedBytes) {
    throw new ImageError(
      "image_too_large",
      `image unpacks to more than ${b.limits.maxUnpackedBytes} bytes (the import limit); stopped reading`,
      { details: { limit: "maxUnpackedBytes", value: b.limits.maxUnpackedBytes } },
    );
  }
}

function chargeEntry(b: Budget): void {
  b.entries += 1;
  if (b.entries > b.limits.maxEntries) {
    throw new ImageError(
      "image_too_large",
      `image has more than ${b.limits.maxEntries} tar entries (the import limit)`,
      {
        details: { limit: "maxEntries", value: b.limits.maxEntries },
      },
    );
  }
}

type BlobKind = "tar" | "gzip" | "zstd" | "xz" | "bzip2" | "other";

function sniff(head: Buffer): BlobKind {
  if (head.length >= 2 && head[0] === 0x1f && head[1] === 0x8b) return "gzip";
  if (head.length >= 4 && head.readUInt32BE(0) === 0x28b52ffd) return "zstd";
  if (head.length >= 6 && head.subarray(0, 6).equals(Buffer.from([0xfd, 0x37, 0x7a, 0x58, 0x5a, 0x00])))
    return "xz";
  if (head.length >= 3 && head.subarray(0, 3).toString("latin1") === "BZh") return "bzip2";
  if (looksLikeTar(head)) return "tar";
  return "other";
}

interface BlobInfo {
  kind: BlobKind;
  /** Digest of the bytes as stored (what OCI descriptors name). */
  rawDigest: string;
  size: number;
  /** Digest of the uncompressed tar stream (the config's rootfs.diff_ids); tar and gzip only. */
  diffId?: string;
  /** Content of small non-layer blobs (manifests, configs, index.json). */
  data?: Buffer;
}

async function* tap(
  src: AsyncIterable<Buffer>,
  hash: Hash,
  onBytes?: (n: number) => void,
): AsyncGenerator<Buffer> {
  for await (const c of src) {
    hash.update(c);
    onBytes?.(c.length);
    yield c;
  }
}

async function* count(src: AsyncIterable<Buffer>, onBytes: (n: number) => void): AsyncGenerator<Buffer> {
  for await (const c of src) {
    onBytes(c.length);
    yield c;
  }
}

/** Streams through gunzip; leaving the loop early (a bomb caught) destroys the inflater at once. */
async function* gunzip(src: AsyncIterable<Buffer>): AsyncGenerator<Buffer> {
  const input = Readable.from(src, { objectMode: false });
  const gz = createGunzip();
  input.on("error", (err) => gz.destroy(err));
  input.pipe(gz);
  try {
    for await (const c of gz) yield c as Buffer;
  } finally {
    input.destroy();
    gz.destroy();
  }
}

/** Splits off the first `n` bytes (fewer at the end of input) without losing the rest. */
async function peek(
  src: AsyncIterable<Buffer>,
  n: number,
): Promise<{ head: Buffer; all: AsyncGenerator<Buffer>; close: () => Promise<void> }> {
  const it = src[Symbol.asyncIterator]();
  const chunks: Buffer[] = [];
  let got = 0;
  let ended = false;
  while (got < n) {
    const r = await it.next();
    if (r.done) {
      ended = true;
      break;
    }
    chunks.push(r.value);
    got += r.value.length;
  }
  const head = Buffer.concat(chunks);
  async function* all(): AsyncGenerator<Buffer> {
    if (head.length > 0) yield head;
    if (ended) return;
    for (;;) {
      const r = await it.next();
      if (r.done) return;
      yield r.value;
    }
  }
  return { head, all: all(), close: async () => void (await it.return?.()) };
}

export interface LayerEntryContext {
  limits: ImportLimits;
}

/**
 * The rules for one entry inside a layer. Absolute symlinks are normal (they resolve inside the
 * guest's root); names and hardlink targets must stay inside the root, and a whiteout may only
 * name a real sibling.
 */
function checkLayerEntry(h: TarHeader, layer: string): void {
  const name = normalizeEntryPath(h.name, { allowAbsolute: true });
  if (name === null) {
    throw new ImageError(
      "image_path_escape",
      `layer ${layer}: entry ${JSON.stringify(h.name)} escapes the root`,
      {
        details: { layer, entry: h.name },
      },
    );
  }
  const base = name.slice(name.lastIndexOf("/") + 1);
  if (base.startsWith(".wh.") && base !== ".wh..wh..opq") {
    const target = base.slice(4);
    if (target === "" || target === "." || target === ".." || target.startsWith(".wh.")) {
      throw new ImageError("image_path_escape", `layer ${layer}: bad whiteout ${JSON.stringify(h.name)}`, {
        details: { layer, entry: h.name },
      });
    }
  }
  if (h.type === "link") {
    const target = normalizeEntryPath(h.linkname, { allowAbsolute: true });
    if (target === null || target === "") {
      throw new ImageError(
        "image_link_escape",
        `layer ${layer}: hardlink ${JSON.stringify(h.name)} -> ${JSON.stringify(h.linkname)} leaves the root`,
        { details: { layer, entry: h.name, target: h.linkname } },
      );
    }
  }
  if (h.type === "symlink" && (h.linkname.length === 0 || h.linkname.includes("\0"))) {
    throw new ImageError(
      "image_bad_layer",
      `layer ${layer}: symlink ${JSON.stringify(h.name)} has no target`,
    );
  }
}

async function scanLayerTar(src: AsyncIterable<Buffer>, budget: Budget, layer: string): Promise<void> {
  const reader = new ByteReader(iterSource(src));
  try {
    for await (const entry of readTar(reader, budget.limits.maxPathBytes)) {
      chargeEntry(budget);
      checkLayerEntry(entry.header, layer);
    }
    // Bytes after the end marker are part of the blob (and of its digest): read and count them.
    await reader.drain();
  } catch (err) {
    if (err instanceof TarFormatError) {
      throw new ImageError(
        err.unsupported ? "image_unsupported" : "image_bad_layer",
        `layer ${layer}: ${err.message}`,
        {
          cause: err,
          details: { layer },
        },
      );
    }
    throw err;
  } finally {
    await reader.close();
  }
}

/**
 * Reads one blob to its end: hashes it, and when it is a tar or a gzip'd tar scans it as a layer
 * (counting decompressed bytes against the budget, hashing them for the diff id). Small other
 * blobs are kept when `keepSmall` (they may be the manifest or config).
 */
async function scanBlob(
  src: AsyncIterable<Buffer>,
  budget: Budget,
  label: string,
  keepSmall: boolean,
): Promise<BlobInfo> {
  const { head, all, close } = await peek(src, 2 * BLOCK);
  const kind = sniff(head);
  const raw = createHash("sha256");
  let size = 0;
  const counted = tap(all, raw, (n) => {
    size += n;
  });
  try {
    if (kind === "tar") {
      await scanLayerTar(
        count(counted, (n) => chargeBytes(budget, n)),
        budget,
        label,
      );
      const rawDigest = `sha256:${raw.digest("hex")}`;
      return { kind, rawDigest, size, diffId: rawDigest };
    }
    if (kind === "gzip") {
      const diff = createHash("sha256");
      try {
        await scanLayerTar(
          tap(gunzip(counted), diff, (n) => chargeBytes(budget, n)),
          budget,
          label,
        );
      } catch (err) {
        if (err instanceof ImageError) throw err;
        throw new ImageError("image_bad_layer", `layer ${label}: bad gzip stream`, {
          cause: err,
          details: { layer: label },
        });
      }
      return { kind, rawDigest: `sha256:${raw.digest("hex")}`, size, diffId: `sha256:${diff.digest("hex")}` };
    }
    const keep: Buffer[] = [];
    let keepBytes = 0;
    for await (const c of counted) {
      if (keepSmall && keepBytes <= budget.limits.maxMetadataBytes) {
        keep.push(c);
        keepBytes += c.length;
      }
    }
    const info: BlobInfo = { kind, rawDigest: `sha256:${raw.digest("hex")}`, size };
    if (keepSmall && size <= budget.limits.maxMetadataBytes) info.data = Buffer.concat(keep);
    return info;
  } finally {
    await close();
  }
}

// ---------------------------------------------------------------------------------------------
// Manifests and configs

const Digest = z.string().regex(/^sha256:[a-f0-9]{64}$/);

const Descriptor = z.object({
  mediaType: z.string().optional(),
  digest: z.string(),
  size: z.number().int().nonnegative().optional(),
  annotations: z.record(z.string(), z.string()).optional(),
  platform: z.object({ architecture: z.string().optional(), os: z.string().optional() }).optional(),
});
type Descriptor = z.infer<typeof Descriptor>;

const OciIndex = z.object({ manifests: z.array(Descriptor) });
const OciManifest = z.object({ config: Descriptor, layers: z.array(Descriptor) });
const DockerManifest = z
  .array(
    z.object({ Config: z.string(), Layers: z.array(z.string()), RepoTags: z.array(z.string()).nullish() }),
  )
  .min(1);

const StrList = z.array(z.string()).nullish();
const RawImageConfig = z.object({
  architecture: z.string().optional(),
  os: z.string().optional(),
  config: z
    .object({
      Env: StrList,
      WorkingDir: z.string().nullish(),
      Entrypoint: StrList,
      Cmd: StrList,
      User: z.string().nullish(),
      ExposedPorts: z.record(z.string(), z.unknown()).nullish(),
    })
    .nullish(),
  rootfs: z.object({ type: z.string().optional(), diff_ids: z.array(z.string()) }),
});
export type RawImageConfig = z.infer<typeof RawImageConfig>;

const INDEX_TYPES = new Set([
  "application/vnd.oci.image.index.v1+json",
  "application/vnd.docker.distribution.manifest.list.v2+json",
]);
const REF_NAME = "org.opencontainers.image.ref.name";

interface LayerRef {
  /** Path of the blob inside the archive or layout. */
  path: string;
  /** Descriptor digest (OCI) that the blob's bytes must hash to. */
  digest?: string;
  mediaType?: string;
}

interface ResolvedImage {
  format: ImageFormat;
  configBytes: Buffer;
  configDigest: string;
  config: RawImageConfig;
  layers: LayerRef[];
  /** skopeo's reference suffix after the path (`:@0`, `:tag` or ''). */
  ref: string;
}

/** Where small metadata files come from: an archive's scan, a positional index, or a directory. */
interface MetaStore {
  /** The file's bytes; undefined when it does not exist. Throws when over the metadata limit. */
  read(path: string): Promise<Buffer | undefined>;
}

function parseJson<T>(bytes: Buffer, schema: z.ZodType<T>, code: ImageErrorCode, what: string): T {
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

async function mustRead(store: MetaStore, path: string, what: string): Promise<Buffer> {
  const data = await store.read(path);
  if (data === undefined)
    throw new ImageError("image_bad_manifest", `${what} ${JSON.stringify(path)} is missing`);
  return data;
}

function blobPath(d: Descriptor): string {
  if (!Digest.safeParse(d.digest).success) {
    throw new ImageError(
      "image_unsupported",
      `unsupported or malformed digest ${JSON.stringify(d.digest)} (sha256 only)`,
    );
  }
  return `blobs/sha256/${d.digest.slice(7)}`;
}

async function readVerified(store: MetaStore, d: Descriptor, what: string): Promise<Buffer> {
  const data = await mustRead(store, blobPath(d), what);
  const got = `sha256:${createHash("sha256").update(data).digest("hex")}`;
  if (got !== d.digest) {
    throw new ImageError("image_digest_mismatch", `${what} hashes to ${got}, not ${d.digest}`, {
      details: { expected: d.digest, actual: got },
    });
  }
  return data;
}

function parseConfig(bytes: Buffer, limits: ImportLimits): { config: RawImageConfig; digest: string } {
  const config = parseJson(bytes, RawImageConfig, "image_bad_config", "image config");
  if (config.rootfs.diff_ids.length > limits.maxLayers) {
    throw new ImageError(
      "image_too_large",
      `image has ${config.rootfs.diff_ids.length} layers (limit ${limits.maxLayers})`,
      {
        details: { limit: "maxLayers", value: limits.maxLayers },
      },
    );
  }
  return { config, digest: `sha256:${createHash("sha256").update(bytes).digest("hex")}` };
}

async function resolveDocker(store: MetaStore, limits: ImportLimits): Promise<ResolvedImage> {
  const bytes = await store.read("manifest.json");
  if (bytes === undefined) throw new ImageError("image_no_manifest", "archive has no manifest.json");
  const manifest = parseJson(bytes, DockerManifest, "image_bad_manifest", "manifest.json");
  const first = manifest[0] as (typeof manifest)[number];
  const cfgPath = normalizeEntryPath(first.Config, { allowAbsolute: false });
  if (cfgPath === null)
    throw new ImageError("image_path_escape", `manifest.json Config ${JSON.stringify(first.Config)}`);
  const configBytes = await mustRead(store, cfgPath, "image config");
  const { config, digest } = parseConfig(configBytes, limits);
  const layers: LayerRef[] = first.Layers.map((l) => {
    const p = normalizeEntryPath(l, { allowAbsolute: false });
    if (p === null) throw new ImageError("image_path_escape", `manifest.json layer ${JSON.stringify(l)}`);
    return { path: p };
  });
  // With several images in one archive skopeo needs to be told which: the first, as we read it.
  return {
    format: "docker-archive",
    configBytes,
    configDigest: digest,
    config,
    layers,
    ref: manifest.length > 1 ? ":@0" : "",
  };
}

function pickPlatform(ds: Descriptor[]): Descriptor | undefined {
  // skopeo picks the host's platform from an index; sandboxd guests are linux/amd64.
  return (
    ds.find((d) => d.platform?.os === "linux" && d.platform.architecture === "amd64") ??
    (ds.length === 1 ? ds[0] : undefined)
  );
}

async function resolveOci(
  store: MetaStore,
  format: ImageFormat,
  limits: ImportLimits,
): Promise<ResolvedImage> {
  const layoutBytes = await store.read("oci-layout");
  const indexBytes = await store.read("index.json");
  if (indexBytes === undefined || layoutBytes === undefined) {
    throw new ImageError(
      "image_no_manifest",
      "no manifest.json (docker-archive) or oci-layout + index.json (OCI)",
    );
  }
  const index = parseJson(indexBytes, OciIndex, "image_bad_manifest", "index.json");
  let chosen: Descriptor | undefined;
  let ref = "";
  if (index.manifests.length === 1) chosen = index.manifests[0];
  else {
    // skopeo needs a name to choose among several images: take the first named one.
    chosen = index.manifests.find((d) => d.annotations?.[REF_NAME]);
    const name = chosen?.annotations?.[REF_NAME];
    if (!chosen || !name)
      throw new ImageError("image_unsupported", "index.json holds several images and none is named");
    if (!/^[A-Za-z0-9._-]+$/.test(name))
      throw new ImageError("image_bad_manifest", `bad image name ${JSON.stringify(name)}`);
    ref = `:${name}`;
  }
  if (!chosen) throw new ImageError("image_no_manifest", "index.json lists no image");
  if (chosen.mediaType && INDEX_TYPES.has(chosen.mediaType)) {
    const nested = parseJson(
      await readVerified(store, chosen, "image index"),
      OciIndex,
      "image_bad_manifest",
      "image index",
    );
    const pick = pickPlatform(nested.manifests);
    if (!pick) throw new ImageError("image_unsupported", "image index has no linux/amd64 image");
    chosen = pick;
  }
  const manifest = parseJson(
    await readVerified(store, chosen, "image manifest"),
    OciManifest,
    "image_bad_manifest",
    "image manifest",
  );
  if (manifest.layers.length > limits.maxLayers) {
    throw new ImageError(
      "image_too_large",
      `image has ${manifest.layers.length} layers (limit ${limits.maxLayers})`,
      {
        details: { limit: "maxLayers", value: limits.maxLayers },
      },
    );
  }
  const configBytes = await readVerified(store, manifest.config, "image config");
  const { config, digest } = parseConfig(configBytes, limits);
  const layers = manifest.layers.map((d) => ({
    path: blobPath(d),
    digest: d.digest,
    mediaType: d.mediaType,
  }));
  return { format, configBytes, configDigest: digest, config, layers, ref };
}

// ---------------------------------------------------------------------------------------------
// Archive scanning (docker-archive, oci-archive)

interface ArchiveEntry {
  type: TarEntryType;
  linkname: string;
  offset: number;
  size: number;
  info?: BlobInfo;
}

/** Follows symlinks and hardlinks inside the archive's own namespace to a regular file. */
function lookupArchive(entries: Map<string, ArchiveEntry>, path: string): ArchiveEntry | undefined {
  let cur = path;
  for (let hops = 0; hops <= MAX_SYMLINK_HOPS; hops++) {
    const e = entries.get(cur);
    if (!e) return undefined;
    if (e.type === "file") return e;
    if (e.type === "symlink") {
      const next = resolveInside(cur.includes("/") ? cur.slice(0, cur.lastIndexOf("/")) : "", e.linkname);
      if (next === null) return undefined;
      cur = next;
    } else if (e.type === "link") {
      const next = normalizeEntryPath(e.linkname, { allowAbsolute: false });
      if (next === null) return undefined;
      cur = next;
    } else return undefined;
  }
  return undefined;
}

function checkOuterEntry(h: TarHeader, entries: Map<string, ArchiveEntry>): string {
  const name = normalizeEntryPath(h.name, { allowAbsolute: false });
  if (name === null) {
    throw new ImageError(
      "image_path_escape",
      `archive entry ${JSON.stringify(h.name)} is absolute or climbs out with ..`,
      {
        details: { entry: h.name },
      },
    );
  }
  if (h.type === "symlink") {
    const dir = name.includes("/") ? name.slice(0, name.lastIndexOf("/")) : "";
    if (resolveInside(dir, h.linkname) === null) {
      throw new ImageError(
        "image_link_escape",
        `archive symlink ${name} -> ${JSON.stringify(h.linkname)} leaves the archive`,
        {
          details: { entry: h.name, target: h.linkname },
        },
      );
    }
  } else if (h.type === "link") {
    if (!normalizeEntryPath(h.linkname, { allowAbsolute: false })) {
      throw new ImageError(
        "image_link_escape",
        `archive hardlink ${name} -> ${JSON.stringify(h.linkname)} leaves the archive`,
        {
          details: { entry: h.name, target: h.linkname },
        },
      );
    }
  } else if (h.type !== "file" && h.type !== "directory") {
    throw new ImageError("image_not_tar", `archive entry ${name} is a ${h.type}: not an image archive`);
  }
  const prev = entries.get(name);
  if (prev && !(prev.type === "directory" && h.type === "directory")) {
    // Readers differ on which copy of a duplicated name wins; refuse the ambiguity.
    throw new ImageError("image_not_tar", `archive holds ${name} twice`, { details: { entry: name } });
  }
  return name;
}

function formatOf(entries: Map<string, ArchiveEntry>): ImageFormat | undefined {
  if (entries.has("manifest.json")) return "docker-archive";
  if (entries.has("index.json") || entries.has("oci-layout")) return "oci-archive";
  return undefined;
}

function wrapOuterTarError(err: unknown): never {
  if (err instanceof TarFormatError) {
    throw new ImageError(
      err.unsupported ? "image_unsupported" : "image_not_tar",
      `not a usable tar archive: ${err.message}`,
      {
        cause: err,
      },
    );
  }
  throw err;
}

/**
 * The cheap pass over an archive: headers only, skipping data by file offset, then the few small
 * JSON files read in place. Enough to learn the config digest for a cache lookup without reading
 * layers; the full scan below decides everything else.
 */
async function indexArchive(path: string, limits: ImportLimits): Promise<Map<string, ArchiveEntry>> {
  const fh = await open(path, fsc.O_RDONLY);
  try {
    const size = (await fh.stat()).size;
    const reader = new ByteReader(fileSource(fh, size));
    const entries = new Map<string, ArchiveEntry>();
    let n = 0;
    for await (const e of readTar(reader, limits.maxPathBytes)) {
      if (++n > limits.maxEntries) throw new ImageError("image_too_large", "too many archive entries");
      const name = checkOuterEntry(e.header, entries);
      entries.set(name, {
        type: e.header.type,
        linkname: e.header.linkname,
        offset: e.offset,
        size: e.header.size,
      });
    }
    return entries;
  } catch (err) {
    return wrapOuterTarError(err);
  } finally {
    await fh.close();
  }
}

async function quickResolveArchive(path: string, limits: ImportLimits): Promise<ResolvedImage> {
  const entries = await indexArchive(path, limits);
  const format = formatOf(entries);
  if (!format) throw new ImageError("image_no_manifest", "archive has no manifest.json or index.json");
  const fh = await open(path, fsc.O_RDONLY);
  try {
    const store: MetaStore = {
      async read(p) {
        const e = lookupArchive(entries, p);
        if (!e) return undefined;
        if (e.size > limits.maxMetadataBytes)
          throw new ImageError("image_too_large", `${p} is over the metadata limit`);
        const buf = Buffer.alloc(e.size);
        const { bytesRead } = await fh.read(buf, 0, e.size, e.offset);
        if (bytesRead !== e.size) throw new ImageError("image_not_tar", "truncated archive");
        return buf;
      },
    };
    return format === "docker-archive"
      ? await resolveDocker(store, limits)
      : await resolveOci(store, format, limits);
  } finally {
    await fh.close();
  }
}

interface ScanResult {
  image: ResolvedImage;
  /** Every layer blob that was scanned, by raw digest: what skopeo's output may contain. */
  layerBlobs: Map<string, BlobInfo>;
}

/** The full streaming scan of an archive: every entry checked, every layer read to its end. */
async function scanArchive(path: string, budget: Budget): Promise<ScanResult> {
  const fh = await open(path, fsc.O_RDONLY);
  const entries = new Map<string, ArchiveEntry>();
  try {
    const size = (await fh.stat()).size;
    const reader = new ByteReader(fileSource(fh, size));
    try {
      for await (const e of readTar(reader, budget.limits.maxPathBytes)) {
        chargeEntry(budget);
        const name = checkOuterEntry(e.header, entries);
        const rec: ArchiveEntry = {
          type: e.header.type,
          linkname: e.header.linkname,
          offset: e.offset,
          size: e.header.size,
        };
        if (e.header.type === "file") rec.info = await scanBlob(e.body(), budget, name, true);
        entries.set(name, rec);
      }
    } catch (err) {
      wrapOuterTarError(err);
    }
  } finally {
    await fh.close();
  }
  const format = formatOf(entries);
  if (!format)
    throw new ImageError(
      "image_no_manifest",
      "archive has no manifest.json (docker-archive) or index.json (OCI)",
    );
  const store: MetaStore = {
    async read(p) {
      const e = lookupArchive(entries, p);
      if (!e?.info) return undefined;
      if (!e.info.data)
        throw new ImageError("image_too_large", `${p} is over the metadata limit or is not metadata`);
      return e.info.data;
    },
  };
  const image =
    format === "docker-archive"
      ? await resolveDocker(store, budget.limits)
      : await resolveOci(store, format, budget.limits);
  const infos = image.layers.map((l) => {
    const info = lookupArchive(entries, l.path)?.info;
    if (!info) throw new ImageError("image_bad_manifest", `layer ${l.path} is missing from the archive`);
    return info;
  });
  return { image, layerBlobs: checkLayers(image, infos) };
}

/** Layers must be scanned tars whose digests match the manifest and the config's diff_ids. */
function checkLayers(image: ResolvedImage, infos: BlobInfo[]): Map<string, BlobInfo> {
  const diffIds = image.config.rootfs.diff_ids;
  if (diffIds.length !== infos.length) {
    throw new ImageError(
      "image_digest_mismatch",
      `config lists ${diffIds.length} layers, manifest ${infos.length}`,
    );
  }
  const out = new Map<string, BlobInfo>();
  infos.forEach((info, i) => {
    const ref = image.layers[i] as LayerRef;
    if (info.kind === "zstd" || info.kind === "xz" || info.kind === "bzip2") {
      throw new ImageError(
        "image_unsupported",
        `layer ${ref.path} is ${info.kind}-compressed; only gzip and plain tar layers are supported`,
        {
          details: { layer: ref.path, compression: info.kind },
        },
      );
    }
    if (ref.mediaType?.includes("zstd")) {
      throw new ImageError(
        "image_unsupported",
        `layer ${ref.path} is declared zstd-compressed (${ref.mediaType})`,
      );
    }
    if (info.kind !== "tar" && info.kind !== "gzip") {
      throw new ImageError("image_bad_layer", `layer ${ref.path} is not a tar or gzip'd tar`, {
        details: { layer: ref.path },
      });
    }
    if (ref.digest && ref.digest !== info.rawDigest) {
      throw new ImageError(
        "image_digest_mismatch",
        `layer ${ref.path} hashes to ${info.rawDigest}, not ${ref.digest}`,
      );
    }
    if (info.diffId !== diffIds[i]) {
      throw new ImageError(
        "image_digest_mismatch",
        `layer ${i} (${ref.path}) has diff id ${info.diffId}, config says ${diffIds[i]}`,
        {
          details: { layer: ref.path, expected: diffIds[i], actual: info.diffId },
        },
      );
    }
    out.set(info.rawDigest, info);
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// OCI layout directories

/**
 * Opens `rel` under `root` refusing symlinks at every step, so a layout cannot point its blobs
 * at host files; returns null when missing.
 */
async function openInLayout(root: string, rel: string): Promise<FileHandle | null> {
  const parts = rel.split("/");
  let cur = root;
  for (let i = 0; i < parts.length; i++) {
    cur = join(cur, parts[i] as string);
    let st: Stats;
    try {
      st = await lstat(cur);
    } catch {
      return null;
    }
    if (st.isSymbolicLink())
      throw new ImageError("image_link_escape", `OCI layout path ${rel} goes through a symlink`);
    const last = i === parts.length - 1;
    if (last ? !st.isFile() : !st.isDirectory()) {
      throw new ImageError(
        "image_bad_manifest",
        `OCI layout path ${rel} is not a ${last ? "file" : "directory"}`,
      );
    }
  }
  return open(cur, fsc.O_RDONLY | fsc.O_NOFOLLOW | fsc.O_NONBLOCK);
}

function layoutStore(root: string, limits: ImportLimits): MetaStore {
  return {
    async read(p) {
      const fh = await openInLayout(root, p);
      if (!fh) return undefined;
      try {
        const st = await fh.stat();
        if (st.size > limits.maxMetadataBytes)
          throw new ImageError("image_too_large", `${p} is over the metadata limit`);
        return await fh.readFile();
      } finally {
        await fh.close();
      }
    },
  };
}

async function* readHandle(fh: FileHandle): AsyncGenerator<Buffer> {
  let pos = 0;
  for (;;) {
    const buf = Buffer.allocUnsafe(READ_CHUNK);
    const { bytesRead } = await fh.read(buf, 0, READ_CHUNK, pos);
    if (bytesRead === 0) return;
    pos += bytesRead;
    yield buf.subarray(0, bytesRead);
  }
}

async function scanLayoutLayers(root: string, image: ResolvedImage, budget: Budget): Promise<ScanResult> {
  const infos: BlobInfo[] = [];
  for (const l of image.layers) {
    const fh = await openInLayout(root, l.path);
    if (!fh) throw new ImageError("image_bad_manifest", `layer blob ${l.path} is missing`);
    try {
      infos.push(await scanBlob(readHandle(fh), budget, l.path, false));
    } finally {
      await fh.close();
    }
  }
  return { image, layerBlobs: checkLayers(image, infos) };
}

// ---------------------------------------------------------------------------------------------
// Config normalisation (pure)

interface PasswdEntry {
  name: string;
  uid: number;
  gid: number;
  home: string;
}

interface GroupEntry {
  name: string;
  gid: number;
}

const MAX_ID = 2 ** 32 - 2; // (uid_t)-1 means "no change" to the kernel; ids stop below it

function parseId(s: string): number | undefined {
  if (!/^[0-9]{1,10}$/.test(s)) return undefined;
  const n = Number(s);
  return n <= MAX_ID ? n : undefined;
}

export function parsePasswd(text: string): PasswdEntry[] {
  const out: PasswdEntry[] = [];
  for (const line of text.split("\n")) {
    if (line.startsWith("#")) continue;
    const f = line.split(":");
    if (f.length < 4) continue;
    const uid = parseId(f[2] as string);
    const gid = parseId(f[3] as string);
    if (uid === undefined || gid === undefined || !f[0]) continue;
    out.push({ name: f[0], uid, gid, home: f[5] ?? "" });
  }
  return out;
}

export function parseGroup(text: string): GroupEntry[] {
  const out: GroupEntry[] = [];
  for (const line of text.split("\n")) {
    if (line.startsWith("#")) continue;
    const f = line.split(":");
    if (f.length < 3) continue;
    const gid = parseId(f[2] as string);
    if (gid === undefined || !f[0]) continue;
    out.push({ name: f[0], gid });
  }
  return out;
}

/**
 * Resolves config User the way runc does: `user`, `uid`, `user:group`, `uid:gid` (and mixes).
 * A name is looked up in the image's own /etc/passwd (/etc/group); a numeric id needs no entry
 * (gid then defaults to the passwd entry's, or 0). An unknown name is an error, not root.
 */
export function resolveUser(
  spec: string,
  passwdText: string,
  groupText: string,
): ImageUser & { home: string } {
  const passwd = parsePasswd(passwdText);
  const groups = parseGroup(groupText);
  const [userPart = "", groupPart] = spec.split(":", 2);
  let entry: PasswdEntry | undefined;
  let uid: number;
  let name: string;
  if (userPart === "") {
    uid = 0;
    entry = passwd.find((p) => p.uid === 0);
    name = entry?.name ?? "root";
  } else {
    entry = passwd.find((p) => p.name === userPart);
    const numeric = parseId(userPart);
    if (!entry && numeric !== undefined) entry = passwd.find((p) => p.uid === numeric);
    if (entry) {
      uid = entry.uid;
      name = entry.name;
    } else if (numeric !== undefined) {
      uid = numeric;
      name = userPart;
    } else {
      throw new ImageError(
        "image_user_unknown",
        `config User ${JSON.stringify(spec)}: no user ${JSON.stringify(userPart)} in the image's /etc/passwd`,
        {
          details: { user: spec },
        },
      );
    }
  }
  let gid = entry?.gid ?? 0;
  if (groupPart !== undefined && groupPart !== "") {
    const g = groups.find((x) => x.name === groupPart);
    const numeric = parseId(groupPart);
    if (g) gid = g.gid;
    else if (numeric !== undefined) gid = numeric;
    else {
      throw new ImageError(
        "image_user_unknown",
        `config User ${JSON.stringify(spec)}: no group ${JSON.stringify(groupPart)} in the image's /etc/group`,
        {
          details: { user: spec },
        },
      );
    }
  }
  // runc sets HOME from the passwd entry, "/" when there is none.
  return { uid, gid, name, home: entry?.home || "/" };
}

/** Normalises a raw image config into what the guest runs (Docker's defaults filled in). */
export function normalizeConfig(
  raw: RawImageConfig,
  digest: string,
  passwdText: string,
  groupText: string,
): ImageConfig {
  const c = raw.config ?? {};
  const env = [...(c.Env ?? [])];
  const has = (k: string) => env.some((e) => e.startsWith(`${k}=`));
  if (!has("PATH")) env.push(`PATH=${DEFAULT_PATH}`);
  const user = resolveUser(c.User ?? "", passwdText, groupText);
  if (!has("HOME")) env.push(`HOME=${user.home}`);
  let workingDir = c.WorkingDir || "/";
  if (!workingDir.startsWith("/")) {
    // Docker refuses to create a container whose working dir is relative; so do we, up front.
    throw new ImageError("image_bad_config", `WorkingDir ${JSON.stringify(workingDir)} is not absolute`);
  }
  workingDir = `/${workingDir
    .split("/")
    .filter((p) => p !== "" && p !== ".")
    .join("/")}`;
  const ports = new Set<number>();
  for (const key of Object.keys(c.ExposedPorts ?? {})) {
    const m = /^([0-9]{1,5})(?:\/(tcp|udp|sctp))?$/i.exec(key);
    if (!m) continue;
    const port = Number(m[1]);
    if ((m[2] ?? "tcp").toLowerCase() === "tcp" && port >= 1 && port <= 65535) ports.add(port);
  }
  return {
    env,
    workingDir,
    entrypoint: [...(c.Entrypoint ?? [])],
    cmd: [...(c.Cmd ?? [])],
    user: { uid: user.uid, gid: user.gid, name: user.name },
    digest,
    exposedPorts: [...ports].sort((a, b) => a - b),
  };
}

/**
 * Docker's rule for the argv: a given CMD replaces the image's Cmd; the image's Entrypoint is
 * prepended to whichever Cmd is used; nothing at all is an error.
 */
export function resolveCommand(config: Pick<ImageConfig, "entrypoint" | "cmd">, cmd?: string[]): string[] {
  const argv = [...config.entrypoint, ...(cmd && cmd.length > 0 ? cmd : config.cmd)];
  if (argv.length === 0) {
    throw new ImageError("image_no_command", "the image has no Entrypoint or Cmd and no command was given");
  }
  return argv;
}

// ---------------------------------------------------------------------------------------------
// Cache

function imageDir(dataDir: string, digest: string): string {
  return join(dataDir, "images", digest.slice("sha256:".length));
}

async function loadCached(
  dataDir: string,
  digest: string,
  format: ImageFormat,
): Promise<ImportedImage | undefined> {
  const dir = imageDir(dataDir, digest);
  try {
    const config = JSON.parse(await readFile(join(dir, "config.json"), "utf8")) as ImageConfig;
    const disk = join(dir, "rootfs.qcow2");
    await stat(disk);
    if (config.digest !== digest) return undefined;
    return { digest, dir, disk, config, cached: true, format };
  } catch {
    return undefined;
  }
}

// ---------------------------------------------------------------------------------------------
// Tools

/** How much tool output to keep for an error: the end is where the reason is. */
const TOOL_OUTPUT_TAIL = 4096;

async function runTool(argv: string[], env: Record<string, string>, log: (m: string) => void): Promise<void> {
  const tool = argv[0] as string;
  log(`image: ${argv.join(" ")}`);
  let proc: ReturnType<typeof Bun.spawn>;
  try {
    proc = Bun.spawn(argv, {
      stdin: "ignore",
      stdout: "pipe",
      stderr: "pipe",
      env: { ...process.env, ...env },
    });
  } catch (err) {
    throw new ImageError("image_tool_failed", `cannot run ${tool}`, { cause: err, details: { tool } });
  }
  const [out, errText, code] = await Promise.all([
    new Response(proc.stdout as ReadableStream).text(),
    new Response(proc.stderr as ReadableStream).text(),
    proc.exited,
  ]);
  if (code !== 0) {
    const output = `${out}\n${errText}`.trim().slice(-TOOL_OUTPUT_TAIL);
    const last = output.split("\n").filter(Boolean).pop() ?? "";
    throw new ImageError("image_tool_failed", `${tool} failed (exit ${code}): ${last}`, {
      details: { tool, exitCode: code, output },
    });
  }
}

const MEDIA_TAR = "application/vnd.oci.image.layer.v1.tar";
const MEDIA_TAR_GZ = "application/vnd.oci.image.layer.v1.tar+gzip";

/**
 * Checks skopeo's output against what we scanned, and fixes the layer media types. Every layer
 * in the layout must be a blob we read ourselves (same digest; umoci verifies blobs against
 * their digests when it reads them), with the same diff ids in its config. skopeo 1.9 keeps
 * docker-archive's uncompressed layers as they are (fast: no recompression) but labels them
 * tar+gzip, which umoci then cannot read, so the manifest gets the true type.
 */
async function normaliseLayout(layout: string, scan: ScanResult, limits: ImportLimits): Promise<void> {
  const store = layoutStore(layout, limits);
  const index = parseJson(
    await mustRead(store, "index.json", "index.json"),
    OciIndex,
    "image_bad_manifest",
    "skopeo index.json",
  );
  const desc = index.manifests[0];
  if (index.manifests.length !== 1 || !desc)
    throw new ImageError("image_tool_failed", "skopeo wrote an unexpected index.json");
  const manifestBytes = await readVerified(store, desc, "skopeo manifest");
  const manifest = JSON.parse(manifestBytes.toString("utf8")) as { layers: Descriptor[]; config: Descriptor };
  const parsed = OciManifest.parse(manifest);
  const cfg = parseConfig(await readVerified(store, parsed.config, "skopeo config"), limits).config;
  const want = scan.image.config.rootfs.diff_ids;
  if (JSON.stringify(cfg.rootfs.diff_ids) !== JSON.stringify(want)) {
    throw new ImageError("image_digest_mismatch", "the copied image's diff ids differ from the scanned ones");
  }
  if (manifest.layers.length !== want.length)
    throw new ImageError("image_digest_mismatch", "the copied image has other layers");
  manifest.layers.forEach((l, i) => {
    const info = scan.layerBlobs.get(l.digest);
    if (!info || info.diffId !== want[i]) {
      throw new ImageError(
        "image_digest_mismatch",
        `the copied image holds layer ${l.digest}, which was not the one scanned`,
      );
    }
    l.mediaType = info.kind === "gzip" ? MEDIA_TAR_GZ : MEDIA_TAR;
  });
  const fixed = Buffer.from(JSON.stringify(manifest));
  const fixedDigest = `sha256:${createHash("sha256").update(fixed).digest("hex")}`;
  await writeFile(join(layout, "blobs/sha256", fixedDigest.slice(7)), fixed);
  const newIndex = JSON.parse((await mustRead(store, "index.json", "index.json")).toString("utf8")) as {
    manifests: Descriptor[];
  };
  const d0 = newIndex.manifests[0] as Descriptor;
  d0.digest = fixedDigest;
  d0.size = fixed.length;
  await writeFile(join(layout, "index.json"), JSON.stringify(newIndex));
}

/** Data bytes (4 KiB blocks) and inodes of a tree, hardlinks counted once. */
async function measureTree(root: string): Promise<{ bytes: number; inodes: number }> {
  const BLK = 4096;
  const seen = new Set<number>();
  let bytes = 0;
  let inodes = 0;
  const stack = [root];
  while (stack.length > 0) {
    const dir = stack.pop() as string;
    const st = await lstat(dir);
    inodes++;
    bytes += Math.max(BLK, Math.ceil(st.size / BLK) * BLK);
    for (const ent of await readdir(dir, { withFileTypes: true })) {
      const p = join(dir, ent.name);
      if (ent.isDirectory()) {
        stack.push(p);
        continue;
      }
      const s = await lstat(p);
      if (s.nlink > 1) {
        if (seen.has(s.ino)) continue;
        seen.add(s.ino);
      }
      inodes++;
      // Symlinks under 60 bytes live in the inode itself; longer ones take a block.
      if (s.isSymbolicLink()) bytes += s.size >= 60 ? BLK : 0;
      else if (s.isFile()) bytes += Math.ceil(s.size / BLK) * BLK;
    }
  }
  return { bytes, inodes };
}

/** mke2fs's default bytes-per-inode for filesystems of this size (mke2fs.conf, "default"). */
const BYTES_PER_INODE = 16384;

async function readSmallInRootfs(root: string, path: string, limit: number): Promise<string> {
  const host = await resolveInRootfs(root, path);
  if (!host) return "";
  let fh: FileHandle;
  try {
    // O_NOFOLLOW: resolveInRootfs already followed every link inside the root; O_NONBLOCK: a
    // FIFO planted at /etc/passwd must not hang the import.
    fh = await open(host, fsc.O_RDONLY | fsc.O_NOFOLLOW | fsc.O_NONBLOCK);
  } catch {
    return "";
  }
  try {
    const st = await fh.stat();
    if (!st.isFile()) return "";
    if (st.size > limit)
      throw new ImageError("image_too_large", `${path} in the image is over ${limit} bytes`);
    return (await fh.readFile()).toString("utf8");
  } finally {
    await fh.close();
  }
}

// ---------------------------------------------------------------------------------------------
// importImage

async function detectSource(source: string): Promise<"dir" | "file"> {
  let st: Stats;
  try {
    st = await stat(source);
  } catch (err) {
    throw new ImageError("image_not_found", `image source ${source} does not exist`, { cause: err });
  }
  if (st.isDirectory()) return "dir";
  if (st.isFile()) return "file";
  throw new ImageError("image_not_tar", `image source ${source} is neither a file nor a directory`);
}

/**
 * Imports an image into `<dataDir>/images/<hex>/` (hex of the source's config digest) and returns
 * it; an image already there is returned without unpacking anything.
 */
export async function importImage(opts: ImportOptions): Promise<ImportedImage> {
  const limits: ImportLimits = { ...DEFAULT_IMPORT_LIMITS, ...opts.limits };
  const sizing: DiskSizing = { ...DEFAULT_DISK_SIZING, ...opts.disk };
  const log = opts.log ?? (() => {});
  const source = resolvePath(opts.source);
  const dataDir = resolvePath(opts.dataDir);
  const kind = await detectSource(source);
  const t0 = performance.now();

  // Quick look for a cache hit: the config digest without reading any layer. A hit is safe to
  // return whatever the rest of the archive holds: the config pins every layer by diff id, and
  // the cached disk was built from layers verified against exactly those.
  let quick: ResolvedImage | undefined;
  try {
    quick =
      kind === "dir"
        ? await resolveOci(layoutStore(source, limits), "oci-layout", limits)
        : await quickResolveArchive(source, limits);
  } catch (err) {
    if (kind === "dir") throw err;
    quick = undefined; // the full scan below reports what is wrong, with the right code
  }
  if (quick) {
    const hit = await loadCached(dataDir, quick.configDigest, quick.format);
    if (hit) {
      log(`image: ${hit.digest} cached (${(performance.now() - t0).toFixed(0)} ms)`);
      return hit;
    }
  }

  await mkdir(join(dataDir, "tmp"), { recursive: true, mode: 0o700 });
  await mkdir(join(dataDir, "images"), { recursive: true });
  const work = await mkdtemp(join(dataDir, "tmp", "import-"));
  try {
    const budget: Budget = { limits, bytes: 0, entries: 0 };
    const scan =
      kind === "dir" && quick
        ? await scanLayoutLayers(source, quick, budget)
        : await scanArchive(source, budget);
    const digest = scan.image.configDigest;
    log(
      `image: scanned ${scan.image.format} ${digest}: ${scan.image.layers.length} layers, ${budget.entries} entries, ${budget.bytes} bytes (${(performance.now() - t0).toFixed(0)} ms)`,
    );
    const raced = await loadCached(dataDir, digest, scan.image.format);
    if (raced) return raced;
    return await build({ work, source, kind, scan, dataDir, limits, sizing, log, t0 });
  } finally {
    await rm(work, { recursive: true, force: true });
  }
}

interface BuildArgs {
  work: string;
  source: string;
  kind: "dir" | "file";
  scan: ScanResult;
  dataDir: string;
  limits: ImportLimits;
  sizing: DiskSizing;
  log: (m: string) => void;
  t0: number;
}

async function build(a: BuildArgs): Promise<ImportedImage> {
  const { work, scan, log } = a;
  const image = scan.image;
  const tmp = join(work, "tmp");
  await mkdir(tmp, { mode: 0o700 });
  // skopeo and umoci put big temporary files (an oci-archive's extracted blobs) in TMPDIR, which
  // would be /var/tmp otherwise: keep every byte under the work dir that we remove.
  const env = { TMPDIR: tmp };
  // skopeo splits references at ':'; a link with a plain name keeps odd source paths out of it.
  const src = join(work, "source");
  await symlink(a.source, src);
  const transport =
    image.format === "docker-archive"
      ? "docker-archive"
      : image.format === "oci-archive"
        ? "oci-archive"
        : "oci";
  const layout = join(work, "layout");
  await runTool(
    [
      "skopeo",
      "copy",
      "--quiet",
      // Local files carry no signatures; the host's registry policy is not ours to depend on.
      "--insecure-policy",
      "--dest-oci-accept-uncompressed-layers",
      `${transport}:${src}${image.ref}`,
      `oci:${layout}:image`,
    ],
    env,
    log,
  );
  await normaliseLayout(layout, scan, a.limits);
  const rootfs = join(work, "rootfs");
  await runTool(["umoci", "raw", "unpack", "--image", `${layout}:image`, rootfs], env, log);
  await rm(layout, { recursive: true, force: true });

  const passwd = await readSmallInRootfs(rootfs, "/etc/passwd", a.limits.maxMetadataBytes);
  const group = await readSmallInRootfs(rootfs, "/etc/group", a.limits.maxMetadataBytes);
  const config = normalizeConfig(image.config, image.configDigest, passwd, group);

  const { bytes, inodes } = await measureTree(rootfs);
  const size = diskSizeFor(bytes, a.sizing);
  // Twice the inodes in use plus a margin, so the guest can create files as well as bytes; never
  // fewer than mke2fs would pick by itself.
  const inodeCount = Math.max(Math.ceil(size / BYTES_PER_INODE), inodes * 2 + 4096);
  const raw = join(work, "rootfs.raw");
  const fh = await open(raw, "w");
  await fh.truncate(size);
  await fh.close();
  await runTool(
    [
      "mkfs.ext4",
      "-F",
      "-q",
      "-b",
      "4096",
      "-I",
      "256",
      "-N",
      String(inodeCount),
      // No blocks reserved for root: the guest's workload often is root, and the space is its.
      "-m",
      "0",
      // Zero inode tables and journal now (zeros cost nothing in qcow2) rather than have every
      // guest's lazy-init thread write them into its own overlay.
      "-E",
      "lazy_itable_init=0,lazy_journal_init=0",
      "-L",
      "sandboxd-root",
      "-d",
      rootfs,
      raw,
    ],
    {},
    log,
  );
  await rm(rootfs, { recursive: true, force: true });
  const out = join(work, "out");
  await mkdir(out);
  await runTool(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, join(out, "rootfs.qcow2")], {}, log);
  await rm(raw, { force: true });
  await writeFile(join(out, "config.json"), `${JSON.stringify(config, null, 2)}\n`);
  await writeFile(join(out, "image.json"), image.configBytes);

  const final = imageDir(a.dataDir, image.configDigest);
  try {
    await rename(out, final);
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    // Another import of the same image finished first: theirs is as good as ours.
    if (code === "ENOTEMPTY" || code === "EEXIST") {
      const hit = await loadCached(a.dataDir, image.configDigest, image.format);
      if (hit) return hit;
    }
    throw err;
  }
  log(
    `image: imported ${image.configDigest} (${image.format}): rootfs ${bytes} bytes, disk ${size} bytes, ${(performance.now() - a.t0).toFixed(0)} ms`,
  );
  return {
    digest: image.configDigest,
    dir: final,
    disk: join(final, "rootfs.qcow2"),
    config,
    cached: false,
    format: image.format,
  };
}
