/**
 * Image import: a `docker save` tar (docker-archive), an `oci-archive` tar or an OCI layout
 * directory becomes a cached ext4 base disk plus the normalised run config, keyed by the image's
 * config digest (docs/templates.md "Rules of templates": the image runs unmodified, its entrypoint, env, working dir and
 * PATH as in a container runtime). This file is the pipeline; each stage has its own file:
 *
 *   source --scan (archive.ts | scan.ts, over tar.ts, oci.ts, paths.ts, limits.ts)
 *          --> skopeo copy --> OCI layout --> umoci raw unpack --> rootfs dir      (rootfs.ts)
 *          --> config normalised against the rootfs' /etc/passwd, /etc/group       (config.ts)
 *          --> mkfs.ext4 -d --> qemu-img convert                                   (ext4.ts)
 *          --> one rename into <dataDir>/images/<hex>/                             (cache.ts)
 *
 * The input is hostile. Before skopeo or umoci see a byte we read the archive and every layer
 * ourselves, streaming, with a tar reader that follows Go's archive/tar (which skopeo and umoci
 * use) and refuses every header the two could read differently; we check names, link targets,
 * entry counts, decompressed sizes and digests, and stop at the first problem. Everything is
 * written under a private work directory in `<dataDir>/tmp/` that is removed on success and on
 * failure; the finished image appears in `<dataDir>/images/<hex>/` by one rename.
 */
import type { Stats } from "node:fs";
import { mkdir, mkdtemp, rm, stat } from "node:fs/promises";
import { join, resolve as resolvePath } from "node:path";
import { asNoSpace, DEFAULT_DISK_RESERVE_BYTES, needFreeSpace } from "../../contracts/disk-space.ts";
import { quickResolveArchive, scanArchive } from "./archive.ts";
import { DISK_FILE, type ImportedImage, loadCached, publish } from "./cache.ts";
import { normalizeConfig } from "./config.ts";
import { ImageError } from "./errors.ts";
import { DEFAULT_DISK_SIZING, type DiskSizing, makeBaseDisk } from "./ext4.ts";
import { type Budget, DEFAULT_IMPORT_LIMITS, type ImportLimits, stopIfCancelled } from "./limits.ts";
import { layoutStore, type ResolvedImage, resolveOci } from "./oci.ts";
import { readImageUsers, unpackRootfs } from "./rootfs.ts";
import { scanLayoutLayers } from "./scan.ts";

// The module's face for the rest of the agent: what importers use lives in its stage file.
export type { ImportedImage } from "./cache.ts";
export { type ImageConfig, resolveCommand } from "./config.ts";
export { ImageError, ImageErrorCode } from "./errors.ts";

export interface ImportOptions {
  source: string;
  dataDir: string;
  log?: (m: string) => void;
  limits?: Partial<ImportLimits>;
  disk?: Partial<DiskSizing>;
  /**
   * The source was made by this host, not handed in by a tenant: the catalog build, the
   * operator's own file on the command line. (A layout pulled from a registry the tenant names is
   * the tenant's: the registry chooses its manifest, so it is scanned like an upload.) Only then may a cache hit be served on the config digest alone, before any layer
   * is read. A tenant's upload is scanned first (every layer hashed against the config's diff
   * ids), so a hit proves the uploader holds every layer of the cached image: knowing another
   * tenant's config blob is not enough to be served its disk.
   */
  trustedSource?: boolean;
  /**
   * Cancels the import (its template was deleted): every stage stops within a chunk, a directory
   * or a tool kill, the work dir is removed and the import rejects with `gone`.
   */
  signal?: AbortSignal;
  /** Free disk the import leaves (`SANDBOXD_DISK_RESERVE_BYTES`); default DEFAULT_DISK_RESERVE_BYTES. */
  diskReserveBytes?: number;
}

/**
 * Imports an image into `<dataDir>/images/<hex>/` (hex of the source's config digest) and returns
 * it; an image already there is returned without unpacking anything (see `trustedSource` for
 * when its layers are read first).
 */
export async function importImage(opts: ImportOptions): Promise<ImportedImage> {
  const limits: ImportLimits = { ...DEFAULT_IMPORT_LIMITS, ...opts.limits };
  const sizing: DiskSizing = { ...DEFAULT_DISK_SIZING, ...opts.disk };
  const log = opts.log ?? (() => {});
  const source = resolvePath(opts.source);
  const dataDir = resolvePath(opts.dataDir);
  const signal = opts.signal;
  stopIfCancelled(signal);
  const kind = await detectSource(source);
  const t0 = performance.now();
  const ms = () => `${(performance.now() - t0).toFixed(0)} ms`;

  const quick = await quickLook(source, kind, limits, signal);
  const hit = opts.trustedSource && quick && (await loadCached(dataDir, quick.configDigest, quick.format));
  if (hit) {
    log(`image: ${hit.digest} cached (${ms()})`);
    return hit;
  }

  await mkdir(join(dataDir, "tmp"), { recursive: true, mode: 0o700 });
  await mkdir(join(dataDir, "images"), { recursive: true });
  const work = await mkdtemp(join(dataDir, "tmp", "import-"));
  try {
    const budget: Budget = { limits, bytes: 0, entries: 0, signal };
    const scan =
      kind === "dir" && quick
        ? await scanLayoutLayers(source, quick, budget)
        : await scanArchive(source, budget);
    const image = scan.image;
    log(
      `image: scanned ${image.format} ${image.configDigest}: ${image.layers.length} layers, ${budget.entries} entries, ${budget.bytes} bytes (${ms()})`,
    );
    // Every layer is verified now (scan.ts): the cached disk is one the source could build.
    const raced = await loadCached(dataDir, image.configDigest, image.format);
    if (raced) {
      log(`image: ${raced.digest} cached, its layers verified (${ms()})`);
      return raced;
    }

    // The unpacked tree, the raw ext4 image and its qcow2 each hold about the layers' bytes; ask
    // before writing any of them (a short disk is a clear refusal, not a half-built image).
    await needFreeSpace(
      work,
      "importing the image",
      3 * budget.bytes,
      opts.diskReserveBytes ?? DEFAULT_DISK_RESERVE_BYTES,
    );
    const rootfs = await unpackRootfs(work, source, scan, limits, log, signal);
    const { passwd, group } = await readImageUsers(rootfs, limits.maxMetadataBytes);
    const config = normalizeConfig(image.config, image.configDigest, passwd, group);
    const out = join(work, "out");
    await mkdir(out);
    const disk = await makeBaseDisk(work, rootfs, join(out, DISK_FILE), sizing, log, signal);
    // Cancelled at the last moment: the half-owned disk goes with the work dir, not into the cache.
    stopIfCancelled(signal);
    const imported = await publish(out, dataDir, image, config);
    if (!imported.cached) {
      log(
        `image: imported ${image.configDigest} (${image.format}): rootfs ${disk.bytes} bytes, disk ${disk.size} bytes, ${ms()}`,
      );
    }
    return imported;
  } catch (err) {
    throw asNoSpace(err, "importing the image");
  } finally {
    await rm(work, { recursive: true, force: true });
  }
}

async function detectSource(source: string): Promise<"dir" | "file"> {
  let st: Stats;
  try {
    st = await stat(source);
  } catch (err) {
    throw new ImageError("image_not_found", "the image source does not exist", {
      cause: err,
      details: { source },
    });
  }
  if (st.isDirectory()) return "dir";
  if (st.isFile()) return "file";
  throw new ImageError("image_not_tar", "the image source is neither a file nor a directory", {
    details: { source },
  });
}

/**
 * Quick look for a cache hit: the config digest without reading any layer. For a trusted source
 * a hit is safe to return whatever the rest of the source holds: the config pins every layer by
 * diff id, and the cached disk was built from layers verified against exactly those.
 */
async function quickLook(
  source: string,
  kind: "dir" | "file",
  limits: ImportLimits,
  signal: AbortSignal | undefined,
): Promise<ResolvedImage | undefined> {
  if (kind === "dir") return await resolveOci(layoutStore(source, limits), "oci-layout", limits);
  try {
    return await quickResolveArchive(source, limits, signal);
  } catch {
    stopIfCancelled(signal);
    return undefined; // the full scan reports what is wrong, with the right code
  }
}
