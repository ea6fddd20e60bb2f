/**
 * The public catalog's images (docs/templates.md "The public catalog"): Debian bookworm minbase
 * root filesystems made by debootstrap from the host's own Debian mirror, packed as OCI image
 * layouts and imported through the same checked path as any user image. One table,
 * CATALOG_IMAGES, says what each is made of:
 *
 * - `python`: python3; its config runs `python3` (so an exec's `code` goes to python3 on stdin,
 *   as `docker run -i IMAGE < code` would);
 * - `base`: what E2B's default template `base` offers that E2B's SDK and its users rely on
 *   (bash, coreutils, procps, sudo, python3, ca-certificates), run as the user `user` (uid 1000,
 *   home /home/user, passwordless sudo) in /home/user.
 */

import { createHash } from "node:crypto";
import { createReadStream, existsSync, readFileSync } from "node:fs";
import { mkdir, mkdtemp, rename, rm, stat, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { bestEffort } from "../../contracts/best-effort.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { runTool, ToolError } from "../host/tool.ts";
import { type ImportedImage, importImage } from "../image/import.ts";

/** Inputs of the build; any change gives a new cache key and a rebuild. */
export const PYTHON_IMAGE = {
  suite: "bookworm",
  variant: "minbase",
  packages: ["python3"],
  config: {
    Env: ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"],
    WorkingDir: "/root",
    Cmd: ["python3"],
  },
  /** Bump when this file's output changes for the same inputs. */
  scriptVersion: 1,
} as const;

/**
 * E2B's default template (`Sandbox.create()` with no template): E2B's own `base` image is a
 * Debian with bash, coreutils, procps, sudo, python3 (`python` too) and curl, run as `user`
 * (uid 1000, passwordless sudo) in /home/user; E2B's SDK tests assume those. No curl here: what
 * the SDK's tests curl is the public internet.
 */
export const BASE_IMAGE = {
  suite: "bookworm",
  variant: "minbase",
  packages: ["bash", "coreutils", "procps", "sudo", "python3", "python-is-python3", "ca-certificates"],
  setup: [
    "useradd --create-home --uid 1000 --user-group --shell /bin/bash user",
    "echo 'user ALL=(ALL:ALL) NOPASSWD: ALL' > /etc/sudoers.d/user",
    "chmod 0440 /etc/sudoers.d/user",
  ].join(" && "),
  config: {
    Env: ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8"],
    User: "user",
    WorkingDir: "/home/user",
    Cmd: ["/bin/bash"],
  },
  scriptVersion: 1,
} as const;

/** What a debootstrapped image is made of; the whole object is its cache key. */
export interface DebootstrapImageSpec {
  suite: string;
  variant: string;
  packages: readonly string[];
  /** A shell script run in the new root (`chroot ROOTFS /bin/sh -ec SCRIPT`) after debootstrap. */
  setup?: string;
  config: object;
  scriptVersion: number;
}

/**
 * The public catalog's images by template id: what each is made of, and the command its template
 * runs before the snapshot (a warm-up: the programs a sandbox's first exec uses are read from
 * disk, and under TCG translated, once at build time instead of in every sandbox).
 */
export const CATALOG_IMAGES = {
  python: {
    spec: PYTHON_IMAGE,
    readyCmd: ["python3", "-c", "import json, os, re, subprocess, sys"],
  },
  base: {
    spec: BASE_IMAGE,
    readyCmd: [
      "/bin/bash",
      "-c",
      "python3 -c 'import json, os, subprocess, sys' && sudo -n true && ps >/dev/null",
    ],
  },
} as const satisfies Record<string, { spec: DebootstrapImageSpec; readyCmd: readonly string[] }>;

export type CatalogImageId = keyof typeof CATALOG_IMAGES;

export function isCatalogImageId(id: string): id is CatalogImageId {
  return Object.hasOwn(CATALOG_IMAGES, id);
}

function cacheKey(spec: DebootstrapImageSpec): string {
  return createHash("sha256").update(JSON.stringify(spec)).digest("hex").slice(0, 16);
}

/**
 * The first Debian archive URI of the host's apt sources (deb822 `.sources` or one-line
 * `sources.list`): the mirror this machine is set up to reach. The operator's
 * `SANDBOXD_DEBIAN_MIRROR` (`setting`, when not empty) overrides.
 */
export function debianMirror(setting?: string): string {
  if (setting) return setting;
  const candidates: string[] = [];
  for (const path of ["/etc/apt/sources.list.d/debian.sources", "/etc/apt/sources.list"]) {
    if (!existsSync(path)) continue;
    const text = readFileSync(path, "utf8");
    for (const m of text.matchAll(/^URIs:\s*(\S+)/gm)) candidates.push(m[1]!);
    for (const m of text.matchAll(/^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+\S+/gm)) candidates.push(m[1]!);
  }
  const mirror = candidates.find((u) => /\/debian\/?$/.test(u));
  if (!mirror) {
    throw new SandboxdError(
      "catalog_build_failed",
      "no Debian mirror in /etc/apt/sources.list(.d); set SANDBOXD_DEBIAN_MIRROR",
    );
  }
  return mirror;
}

/** Runs a build tool (agent/host/tool.ts); a failure is `catalog_build_failed`, the ToolError its cause. */
async function run(argv: string[], log: (m: string) => void, signal?: AbortSignal): Promise<void> {
  log(argv.join(" "));
  try {
    // An abort (the agent stopping) kills the tool's whole process group: debootstrap's chroot
    // children (dpkg, apt) do not outlive it.
    await runTool(argv, { captureStdout: false, ...(signal ? { signal } : {}) });
  } catch (err) {
    if (!(err instanceof ToolError)) throw err;
    const message =
      err.kind === "exit" && err.details.exitCode != null
        ? `${argv[0]} exited ${err.details.exitCode}: ${err.details.output ?? ""}`
        : err.message;
    throw new SandboxdError("catalog_build_failed", message, { cause: err });
  }
}

async function sha256File(path: string): Promise<{ digest: string; size: number }> {
  const h = createHash("sha256");
  for await (const chunk of createReadStream(path)) h.update(chunk as Buffer);
  return { digest: `sha256:${h.digest("hex")}`, size: (await stat(path)).size };
}

async function writeBlob(layout: string, data: Buffer): Promise<{ digest: string; size: number }> {
  const digest = `sha256:${createHash("sha256").update(data).digest("hex")}`;
  await writeFile(join(layout, "blobs/sha256", digest.slice(7)), data);
  return { digest, size: data.length };
}

/** Packs a root filesystem directory as a one-layer OCI image layout. */
export async function packRootfsAsOciLayout(
  rootfs: string,
  layout: string,
  config: object,
  log: (m: string) => void,
): Promise<void> {
  await mkdir(join(layout, "blobs/sha256"), { recursive: true });
  const layerTmp = join(layout, "layer.tar");
  // --numeric-owner: ownership as ids, not names looked up on the host.
  await run(["tar", "--numeric-owner", "--xattrs", "-C", rootfs, "-cf", layerTmp, "."], log);
  const layer = await sha256File(layerTmp);
  await rename(layerTmp, join(layout, "blobs/sha256", layer.digest.slice(7)));
  const cfg = await writeBlob(
    layout,
    Buffer.from(
      JSON.stringify({
        architecture: "amd64",
        os: "linux",
        config,
        rootfs: { type: "layers", diff_ids: [layer.digest] },
      }),
    ),
  );
  const manifest = await writeBlob(
    layout,
    Buffer.from(
      JSON.stringify({
        schemaVersion: 2,
        mediaType: "application/vnd.oci.image.manifest.v1+json",
        config: { mediaType: "application/vnd.oci.image.config.v1+json", ...cfg },
        layers: [{ mediaType: "application/vnd.oci.image.layer.v1.tar", ...layer }],
      }),
    ),
  );
  await writeFile(join(layout, "oci-layout"), JSON.stringify({ imageLayoutVersion: "1.0.0" }));
  await writeFile(
    join(layout, "index.json"),
    JSON.stringify({
      schemaVersion: 2,
      manifests: [
        {
          mediaType: "application/vnd.oci.image.manifest.v1+json",
          ...manifest,
          annotations: { "org.opencontainers.image.ref.name": "latest" },
        },
      ],
    }),
  );
}

/** Where a debootstrapped image's OCI layout is kept: `<dir>/<name>-<key>/`. */
export function debootstrapLayoutDir(dir: string, name: string, spec: DebootstrapImageSpec): string {
  return join(dir, `${name}-${cacheKey(spec)}`);
}

/** Where a catalog image's OCI layout is kept (an image source `sandboxd run --image` takes). */
export function catalogLayoutDir(dataDir: string, id: CatalogImageId): string {
  return debootstrapLayoutDir(join(dataDir, "catalog"), id, CATALOG_IMAGES[id].spec);
}

/** Where the python image's OCI layout is kept. */
export function pythonLayoutDir(dataDir: string): string {
  return catalogLayoutDir(dataDir, "python");
}

/**
 * Builds (once) the OCI layout of a Debian image made by debootstrap from `spec`, in
 * `debootstrapLayoutDir(dir, name, spec)`, and returns that directory. A layout already
 * there is used as it is; a failed build leaves nothing behind.
 */
export async function ensureDebootstrapLayout(opts: {
  /** Parent directory of the layout (and of the build's scratch directory). */
  dir: string;
  name: string;
  spec: DebootstrapImageSpec;
  log?: (m: string) => void;
  /** Stops the build (its tools are killed) and leaves nothing behind; the caller's stop. */
  signal?: AbortSignal;
  /** `SANDBOXD_DEBIAN_MIRROR`; unset or empty: the host's apt sources' mirror. */
  mirror?: string;
}): Promise<string> {
  const { spec, name } = opts;
  const log = opts.log ?? (() => {});
  const layout = debootstrapLayoutDir(opts.dir, name, spec);
  if (existsSync(join(layout, "index.json"))) return layout;
  await mkdir(opts.dir, { recursive: true });
  const work = await mkdtemp(join(opts.dir, ".build-"));
  try {
    const rootfs = join(work, "rootfs");
    log(`catalog: building the ${name} image (debootstrap ${spec.suite})`);
    await run(
      [
        "debootstrap",
        `--variant=${spec.variant}`,
        `--include=${spec.packages.join(",")}`,
        spec.suite,
        rootfs,
        debianMirror(opts.mirror),
      ],
      log,
      opts.signal,
    );
    opts.signal?.throwIfAborted();
    if (spec.setup) {
      await run(["chroot", rootfs, "/bin/sh", "-ec", spec.setup], log, opts.signal);
      opts.signal?.throwIfAborted();
    }
    // The apt lists and caches debootstrap leaves are 30+ MB no sandbox needs.
    await rm(join(rootfs, "var/cache/apt/archives"), { recursive: true, force: true });
    await rm(join(rootfs, "var/lib/apt/lists"), { recursive: true, force: true });
    await mkdir(join(rootfs, "var/lib/apt/lists/partial"), { recursive: true });
    const out = join(work, "layout");
    await packRootfsAsOciLayout(rootfs, out, spec.config, log);
    opts.signal?.throwIfAborted();
    await rm(layout, { recursive: true, force: true });
    await rename(out, layout);
  } finally {
    await unmountUnder(work, log);
    await rm(work, { recursive: true, force: true });
  }
  return layout;
}

/**
 * Detaches what a failed debootstrap left mounted in its target (its /proc, /sys), deepest first.
 * A mounted /proc in a scratch directory is a trap: `cp -a` of a parent copies /proc/kcore
 * (the size of the address space) until the disk is full, and `rm -r` stops at its files.
 */
async function unmountUnder(dir: string, log: (m: string) => void): Promise<void> {
  const points = readFileSync("/proc/self/mounts", "utf8")
    .split("\n")
    .map((line) => line.split(" ")[1] ?? "")
    .filter((p) => p.startsWith(`${dir}/`))
    .sort((x, y) => y.length - x.length);
  for (const p of points) await bestEffort(log, `unmounting ${p}`, run(["umount", "--lazy", p], log));
}

/**
 * Builds (once, ~1 min) and imports a catalog image. The OCI layout is kept in
 * `<dataDir>/catalog/<id>-<key>/` so a later import (e.g. after the image cache was cleared)
 * skips debootstrap; the import itself is cached by digest.
 */
export async function ensureCatalogImage(
  id: CatalogImageId,
  opts: {
    dataDir: string;
    log?: (m: string) => void;
    /** The agent's stop: an aborted build kills its tools and imports nothing. */
    signal?: AbortSignal;
    /** `SANDBOXD_DEBIAN_MIRROR`; unset or empty: the host's apt sources' mirror. */
    mirror?: string;
    /** Free disk the import leaves (`SANDBOXD_DISK_RESERVE_BYTES`); default DEFAULT_DISK_RESERVE_BYTES. */
    diskReserveBytes?: number;
  },
): Promise<ImportedImage> {
  const log = opts.log ?? (() => {});
  const layout = await ensureDebootstrapLayout({
    dir: join(opts.dataDir, "catalog"),
    name: id,
    spec: CATALOG_IMAGES[id].spec,
    log,
    ...(opts.signal ? { signal: opts.signal } : {}),
    ...(opts.mirror ? { mirror: opts.mirror } : {}),
  });
  opts.signal?.throwIfAborted();
  return importImage({
    source: layout,
    dataDir: opts.dataDir,
    log,
    trustedSource: true,
    ...(opts.signal ? { signal: opts.signal } : {}),
    ...(opts.diskReserveBytes !== undefined ? { diskReserveBytes: opts.diskReserveBytes } : {}),
  });
}

/** The python image (ensureCatalogImage "python"). */
export function ensurePythonImage(opts: Parameters<typeof ensureCatalogImage>[1]): Promise<ImportedImage> {
  return ensureCatalogImage("python", opts);
}
