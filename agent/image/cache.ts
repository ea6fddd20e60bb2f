/**
 * The image cache: `<dataDir>/images/<hex>/`, keyed by the hex of the source's config digest,
 * holding the base disk (rootfs.qcow2), the normalised run config (config.json) and the source's
 * config blob (image.json). A finished image appears there by one rename of a complete
 * directory, so a reader never sees half an image.
 */
import { readFile, rename, stat, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { type ImageConfig, StoredImageConfig } from "./config.ts";
import { touchEntry } from "./evict.ts";
import type { ImageFormat, ResolvedImage } from "./oci.ts";

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

/** The base disk's name inside an image directory (and inside the work dir's `out/`). */
export const DISK_FILE = "rootfs.qcow2";

function imageDir(dataDir: string, digest: string): string {
  return join(dataDir, "images", digest.slice("sha256:".length));
}

/** The cached image with this config digest; undefined when there is none (or half of one). */
export async function loadCached(
  dataDir: string,
  digest: string,
  format: ImageFormat,
): Promise<ImportedImage | undefined> {
  const dir = imageDir(dataDir, digest);
  try {
    const config = StoredImageConfig.parse(JSON.parse(await readFile(join(dir, "config.json"), "utf8")));
    const disk = join(dir, DISK_FILE);
    await stat(disk);
    if (config.digest !== digest) return undefined;
    await touchEntry(dir); // served: the least-recently-used eviction keeps it longest
    return { digest, dir, disk, config, cached: true, format };
  } catch {
    return undefined;
  }
}

/**
 * Writes the run config and the source config beside the disk already in `out`, then moves
 * `out` into the cache. When another import of the same image finished first, theirs is
 * returned (cached: true): it is as good as ours.
 */
export async function publish(
  out: string,
  dataDir: string,
  image: ResolvedImage,
  config: ImageConfig,
): Promise<ImportedImage> {
  await writeFile(join(out, "config.json"), `${JSON.stringify(config, null, 2)}\n`);
  await writeFile(join(out, "image.json"), image.configBytes);
  const final = imageDir(dataDir, image.configDigest);
  try {
    await rename(out, final);
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    if (code === "ENOTEMPTY" || code === "EEXIST") {
      const hit = await loadCached(dataDir, image.configDigest, image.format);
      if (hit) return hit;
    }
    throw err;
  }
  return {
    digest: image.configDigest,
    dir: final,
    disk: join(final, DISK_FILE),
    config,
    cached: false,
    format: image.format,
  };
}
