/**
 * Blob scanning: every blob of an image is read to its end before skopeo or umoci see it. We
 * sniff the compression, hash the stored bytes (the descriptor digest) and, for tar and gzip'd
 * tar layers, the uncompressed stream (the config's diff id), count decompressed bytes and
 * entries against the Budget (gzip bombs end here), and check every layer entry's name and link
 * target. The archive scan (archive.ts) and the layout scan below both end in `checkLayers`.
 */
import { createHash, type Hash } from "node:crypto";
import type { FileHandle } from "node:fs/promises";
import { Readable } from "node:stream";
import { createGunzip } from "node:zlib";
import { ImageError } from "./errors.ts";
import { type Budget, chargeBytes, chargeEntry, stopIfCancelled } from "./limits.ts";
import { type LayerRef, openInLayout, type ResolvedImage } from "./oci.ts";
import { normalizeEntryPath } from "./paths.ts";
import {
  BLOCK,
  ByteReader,
  iterSource,
  looksLikeTar,
  READ_CHUNK,
  readTar,
  TarFormatError,
  type TarHeader,
} from "./tar.ts";

export type BlobKind = "tar" | "gzip" | "zstd" | "xz" | "bzip2" | "other";

function sniff(head: Buffer): BlobKind {
  if (head.length >= 2 && head[0] === 0x1f && head[1] === 0x8b) return "gzip";
  if (head.length >= 4 && head.readUInt32BE(0) === 0x28b52ffd) return "zstd";
  if (head.length >= 6 && head.subarray(0, 6).equals(Buffer.from([0xfd, 0x37, 0x7a, 0x58, 0x5a, 0x00])))
    return "xz";
  if (head.length >= 3 && head.subarray(0, 3).toString("latin1") === "BZh") return "bzip2";
  if (looksLikeTar(head)) return "tar";
  return "other";
}

export interface BlobInfo {
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
export async function scanBlob(
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
    // Blobs that are no tar (configs, or junk in an archive) are read to their end uncharged.
    stopIfCancelled(budget.signal);
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

export interface ScanResult {
  image: ResolvedImage;
  /** Every layer blob that was scanned, by raw digest: what skopeo's output may contain. */
  layerBlobs: Map<string, BlobInfo>;
}

/** Layers must be scanned tars whose digests match the manifest and the config's diff_ids. */
export function checkLayers(image: ResolvedImage, infos: BlobInfo[]): Map<string, BlobInfo> {
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

/**
 * The full scan of an OCI layout directory whose metadata `resolveOci` has read: every layer
 * blob its manifest names, opened without following links, read to its end.
 */
export async function scanLayoutLayers(
  root: string,
  image: ResolvedImage,
  budget: Budget,
): Promise<ScanResult> {
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
