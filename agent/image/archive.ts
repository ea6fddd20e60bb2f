/**
 * Source archives (docker-archive, oci-archive): the outer tar's own rules (no absolute or `..`
 * names, links that stay inside, no devices, no name twice), a cheap header-only pass that finds
 * the config digest for a cache lookup, and the full streaming scan of every entry and layer.
 */
import { constants as fsc } from "node:fs";
import { open } from "node:fs/promises";
import { ImageError } from "./errors.ts";
import { type Budget, chargeEntry, type ImportLimits, stopIfCancelled } from "./limits.ts";
import { type ImageFormat, type MetaStore, type ResolvedImage, resolveDocker, resolveOci } from "./oci.ts";
import { MAX_SYMLINK_HOPS, normalizeEntryPath, resolveInside } from "./paths.ts";
import { type BlobInfo, checkLayers, type ScanResult, scanBlob } from "./scan.ts";
import { ByteReader, fileSource, readTar, type TarEntryType, TarFormatError, type TarHeader } from "./tar.ts";

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
async function indexArchive(
  path: string,
  limits: ImportLimits,
  signal?: AbortSignal,
): Promise<Map<string, ArchiveEntry>> {
  const fh = await open(path, fsc.O_RDONLY);
  try {
    const size = (await fh.stat()).size;
    const reader = new ByteReader(fileSource(fh, size));
    const entries = new Map<string, ArchiveEntry>();
    let n = 0;
    for await (const e of readTar(reader, limits.maxPathBytes)) {
      stopIfCancelled(signal);
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

export async function quickResolveArchive(
  path: string,
  limits: ImportLimits,
  signal?: AbortSignal,
): Promise<ResolvedImage> {
  const entries = await indexArchive(path, limits, signal);
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

/** The full streaming scan of an archive: every entry checked, every layer read to its end. */
export async function scanArchive(path: string, budget: Budget): Promise<ScanResult> {
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
