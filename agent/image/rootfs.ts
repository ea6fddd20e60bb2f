/**
 * From a scanned source to an unpacked root filesystem: skopeo copies the source into an OCI
 * layout in the work dir, the layout is checked against our own scan (and its layer media types
 * fixed), and umoci unpacks it into a plain directory. The image's /etc/passwd and /etc/group are
 * then read out of that tree without ever following a link out of it.
 */
import { createHash } from "node:crypto";
import { constants as fsc } from "node:fs";
import { type FileHandle, lstat, mkdir, open, rm, symlink, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { ifExists } from "../../contracts/best-effort.ts";
import { parseConfig } from "./config.ts";
import { ImageError, parseJson } from "./errors.ts";
import type { ImportLimits } from "./limits.ts";
import { type Descriptor, layoutStore, mustRead, OciIndex, OciManifest, readVerified } from "./oci.ts";
import { resolveInRootfs } from "./paths.ts";
import type { ScanResult } from "./scan.ts";
import { runImageTool } from "./tools.ts";

/**
 * Copies the scanned source into an OCI layout with skopeo, checks it against the scan and
 * unpacks it with umoci into `<work>/rootfs`, whose path it returns. Everything the tools write,
 * temporary files included, stays under `work`.
 */
export async function unpackRootfs(
  work: string,
  source: string,
  scan: ScanResult,
  limits: ImportLimits,
  log: (m: string) => void,
  signal?: AbortSignal,
): Promise<string> {
  const image = scan.image;
  const tmp = join(work, "tmp");
  await mkdir(tmp, { mode: 0o700 });
  // skopeo and umoci put big temporary files (an oci-archive's extracted blobs) in TMPDIR, which
  // would be /var/tmp otherwise: keep every byte under the work dir that we remove.
  const env = { TMPDIR: tmp };
  // skopeo splits references at ':'; a link with a plain name keeps odd source paths out of it.
  const src = join(work, "source");
  await symlink(source, src);
  const transport =
    image.format === "docker-archive"
      ? "docker-archive"
      : image.format === "oci-archive"
        ? "oci-archive"
        : "oci";
  const layout = join(work, "layout");
  await runImageTool(
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
    { env, log, signal },
  );
  await normaliseLayout(layout, scan, limits);
  const rootfs = join(work, "rootfs");
  await runImageTool(["umoci", "raw", "unpack", "--image", `${layout}:image`, rootfs], {
    env,
    log,
    signal,
  });
  await rm(layout, { recursive: true, force: true });
  return rootfs;
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

/** The image's own /etc/passwd and /etc/group ('' where missing), read inside the rootfs. */
export async function readImageUsers(
  rootfs: string,
  limit: number,
): Promise<{ passwd: string; group: string }> {
  const passwd = await readSmallInRootfs(rootfs, "/etc/passwd", limit);
  const group = await readSmallInRootfs(rootfs, "/etc/group", limit);
  return { passwd, group };
}

async function readSmallInRootfs(root: string, path: string, limit: number): Promise<string> {
  const host = await resolveInRootfs(root, path);
  if (!host) return "";
  // Only a regular file is opened: opening a device node or a FIFO the image planted has effects
  // of its own on the host (a writer waiting on the FIFO is released, a device driver's open runs).
  const st0 = await ifExists(lstat(host));
  if (!st0?.isFile()) return "";
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
