/**
 * What an image is made of, read from its metadata: docker-archive's manifest.json, or an OCI
 * layout's oci-layout + index.json -> (nested index) -> manifest -> config and layer
 * descriptors. Every blob read by descriptor is checked against its digest; names are checked
 * before they are used as paths. The metadata comes from a MetaStore (an archive's scan, a
 * positional index of an archive, or an OCI layout directory opened without following links).
 */
import { createHash } from "node:crypto";
import { constants as fsc, type Stats } from "node:fs";
import { type FileHandle, lstat, open } from "node:fs/promises";
import { join } from "node:path";
import { z } from "zod";
import { parseConfig, type RawImageConfig } from "./config.ts";
import { ImageError, parseJson } from "./errors.ts";
import type { ImportLimits } from "./limits.ts";
import { normalizeEntryPath } from "./paths.ts";

export type ImageFormat = "docker-archive" | "oci-archive" | "oci-layout";

const Digest = z.string().regex(/^sha256:[a-f0-9]{64}$/);

export const Descriptor = z.object({
  mediaType: z.string().optional(),
  digest: z.string(),
  size: z.number().int().nonnegative().optional(),
  annotations: z.record(z.string(), z.string()).optional(),
  platform: z.object({ architecture: z.string().optional(), os: z.string().optional() }).optional(),
});
export type Descriptor = z.infer<typeof Descriptor>;

export const OciIndex = z.object({ manifests: z.array(Descriptor) });
export const OciManifest = z.object({ config: Descriptor, layers: z.array(Descriptor) });
const DockerManifest = z
  .array(
    z.object({ Config: z.string(), Layers: z.array(z.string()), RepoTags: z.array(z.string()).nullish() }),
  )
  .min(1);

const INDEX_TYPES = new Set([
  "application/vnd.oci.image.index.v1+json",
  "application/vnd.docker.distribution.manifest.list.v2+json",
]);
const REF_NAME = "org.opencontainers.image.ref.name";

export interface LayerRef {
  /** Path of the blob inside the archive or layout. */
  path: string;
  /** Descriptor digest (OCI) that the blob's bytes must hash to. */
  digest?: string;
  mediaType?: string;
}

export interface ResolvedImage {
  format: ImageFormat;
  configBytes: Buffer;
  configDigest: string;
  config: RawImageConfig;
  layers: LayerRef[];
  /** skopeo's reference suffix after the path (`:@0`, `:tag` or ''). */
  ref: string;
}

/** Where small metadata files come from: an archive's scan, a positional index, or a directory. */
export interface MetaStore {
  /** The file's bytes; undefined when it does not exist. Throws when over the metadata limit. */
  read(path: string): Promise<Buffer | undefined>;
}

export async function mustRead(store: MetaStore, path: string, what: string): Promise<Buffer> {
  const data = await store.read(path);
  if (data === undefined)
    throw new ImageError("image_bad_manifest", `${what} ${JSON.stringify(path)} is missing`);
  return data;
}

export function blobPath(d: Descriptor): string {
  if (!Digest.safeParse(d.digest).success) {
    throw new ImageError(
      "image_unsupported",
      `unsupported or malformed digest ${JSON.stringify(d.digest)} (sha256 only)`,
    );
  }
  return `blobs/sha256/${d.digest.slice(7)}`;
}

export async function readVerified(store: MetaStore, d: Descriptor, what: string): Promise<Buffer> {
  const data = await mustRead(store, blobPath(d), what);
  const got = `sha256:${createHash("sha256").update(data).digest("hex")}`;
  if (got !== d.digest) {
    throw new ImageError("image_digest_mismatch", `${what} hashes to ${got}, not ${d.digest}`, {
      details: { expected: d.digest, actual: got },
    });
  }
  return data;
}

export async function resolveDocker(store: MetaStore, limits: ImportLimits): Promise<ResolvedImage> {
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

export async function resolveOci(
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

/**
 * Opens `rel` under `root` refusing symlinks at every step, so a layout cannot point its blobs
 * at host files; returns null when missing.
 */
export async function openInLayout(root: string, rel: string): Promise<FileHandle | null> {
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

export function layoutStore(root: string, limits: ImportLimits): MetaStore {
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
