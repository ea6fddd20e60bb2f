/**
 * Pulling an image by OCI reference (sandboxes API bake, docs/sandboxes.md "Rules of the sandboxes API" `image`) into the agent's image
 * cache, then handing the OCI layout to the importer (import.ts) like any uploaded image:
 *
 *   parse the reference (contracts/image-ref.ts: no option injection, no schemes)
 *   -> the registry's address through the egress fence (RegistryConfig.checkDestination)
 *   -> a pull proxy (pull-proxy.ts) on a unix socket in the pull's work dir: skopeo runs in a
 *      network namespace with no route out (skopeo.ts), and every connection it makes (the
 *      registry, each redirect, the token realm) goes through the proxy, which checks it with the
 *      same fence (RegistryConfig.fence) and connects to the checked address
 *   -> skopeo inspect --raw    with THIS bake's credentials, every time, also for a digest:
 *                              the registry authorizes the caller for the repository and
 *                              serves the manifest, whose hash we check against the digest
 *   -> <cacheDir>/images/pulled/<sha256(name@digest)>/ exists?   yes: done, no blob is fetched
 *   -> skopeo copy docker://NAME@DIGEST oci:<tmp>:image   then rename into place (atomic)
 *
 * Why every bake asks the registry: the cache is shared by all tenants of the host, and a
 * digest is not a secret (it is printed in logs, CI output, image listings). A layout is used
 * only after the registry has served its manifest to the credentials of the bake asking for it,
 * so a tenant that knows another tenant's private digest but cannot read the repository is
 * refused by the registry and never reaches the cached blobs. The cache key holds the repository
 * name with the digest: the check is the registry's own per-repository permission, and a tenant
 * serving a copy of someone's manifest bytes from its own registry gets its own cache entry,
 * filled only with blobs its registry really has. The cost is one manifest GET per bake (a few KB,
 * no blob); docs/templates.md "Bakes from registries: choices" has the figures.
 *
 * Credentials: a bake may carry its own (`registryAuth`, username and password; a token is
 * given as the password, as GHCR, Docker Hub and GitLab take it). They are written to a 0600
 * authfile in the pull's private work dir, removed with it, and never appear in argv or logs.
 * The operator's host-wide file (`SANDBOXD_REGISTRY_AUTH`) is used only for registries the
 * operator lists in `SANDBOXD_SHARED_REGISTRIES`; every other pull runs with an authfile of only
 * the bake's credentials (or none), so skopeo never falls back to the host's docker or
 * containers auth files.
 *
 * Copying by the inspected digest (not by tag) makes the cache key and the bytes agree even when
 * the tag moves between the two calls. skopeo checks every blob against its digest while it
 * copies, and the importer scans the layout again (paths, links, sizes) before unpacking it.
 *
 * Transport security follows Docker: a registry on a loopback address (127.0.0.0/8, ::1,
 * `localhost`) is spoken to over plain HTTP, any other only over verified TLS unless the operator
 * lists it in `SANDBOXD_INSECURE_REGISTRIES`.
 *
 * Errors: the message of a failed pull is written for the tenant: the reference as they gave it
 * and a short, stable reason (`details.reason`: registry_denied, image_not_found, ...). skopeo's
 * own words (host paths, internal URLs, token realms) stay in the ToolError kept as `cause`, which
 * reaches the agent's log and nothing else.
 */
import { createHash, randomBytes } from "node:crypto";
import { existsSync } from "node:fs";
import { mkdir, rename, rm, stat, writeFile } from "node:fs/promises";
import { join, resolve } from "node:path";
import { DEFAULT_DISK_RESERVE_BYTES, needFreeSpace } from "../../contracts/disk-space.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { type ImageReference, ImageReferenceError, parseImageReference } from "../../contracts/image-ref.ts";
import { touchEntry } from "./evict.ts";
import { type PullProxy, proxyRefusal, startPullProxy } from "./pull-proxy.ts";
import {
  DEFAULT_MAX_PULL_BYTES,
  DEFAULT_REGISTRY,
  isLoopbackHost,
  isSharedRegistry,
  type RegistryAuth,
  type RegistryConfig,
  registryAddress,
  registryTlsVerify,
} from "./registry.ts";
import { type PullRoute, pullError, runSkopeo as runSkopeoDirect } from "./skopeo.ts";

export {
  DEFAULT_MAX_PULL_BYTES,
  DEFAULT_REGISTRY,
  type DestinationCheck,
  isLoopbackHost,
  isSharedRegistry,
  parseRegistryList,
  type RegistryAuth,
  type RegistryConfig,
  registryAddress,
  registryConfigFromEnv,
  registryTlsVerify,
} from "./registry.ts";
export { classifySkopeoFailure, skopeoReason } from "./skopeo.ts";

/**
 * Inspecting a manifest is a few KB: a registry that has not answered in a minute is down or
 * unreachable, and the bake should fail with that reason rather than sit in Converting.
 */
export const INSPECT_TIMEOUT_MS = 60_000;
/**
 * The whole copy. 30 minutes is the bound the gateway already gives an image upload: a
 * multi-GB image over a modest link fits in it, and a registry that stalls mid-blob cannot hold a
 * build (and its slot in the build queue) forever.
 */
export const PULL_TIMEOUT_MS = 30 * 60_000;

export interface PullOptions {
  reference: string;
  /** The agent's cache dir; layouts go to `<cacheDir>/images/pulled/<hex>/`. */
  cacheDir: string;
  registry: RegistryConfig;
  /** This bake's credentials for the reference's registry. */
  auth?: RegistryAuth;
  signal?: AbortSignal;
  inspectTimeoutMs?: number;
  pullTimeoutMs?: number;
  /** Free disk the pull leaves (`SANDBOXD_DISK_RESERVE_BYTES`); default DEFAULT_DISK_RESERVE_BYTES. */
  diskReserveBytes?: number;
  log?: (m: string) => void;
}

export interface PulledImage {
  /** An OCI layout directory holding exactly this image (tag `image`). */
  layout: string;
  /** `sha256:<hex>` of the manifest that was pulled. */
  digest: string;
  /** True when the digest was already in the cache: nothing but the manifest was fetched. */
  cached: boolean;
  /** Wall time of inspect + copy, ms. */
  pullMs: number;
}

/** The cache directory name of `name@digest`: the repository is part of the key (see above). */
export function pulledKey(name: string, digest: string): string {
  return createHash("sha256").update(`${name}@${digest}`).digest("hex");
}

/**
 * Pulls `reference` into the cache (once per repository and manifest digest) and returns its OCI
 * layout; a cached layout is returned only after the registry served this caller the manifest.
 */
export async function pullImage(o: PullOptions): Promise<PulledImage> {
  const log = o.log ?? (() => {});
  const t0 = performance.now();
  let ref: ImageReference;
  try {
    ref = parseImageReference(o.reference);
  } catch (err) {
    if (err instanceof ImageReferenceError) throw new SandboxdError("bad_request", err.message);
    throw err;
  }
  await checkRegistryAddress(ref, o.registry);
  const tmpRoot = join(resolve(o.cacheDir), "tmp");
  await mkdir(tmpRoot, { recursive: true, mode: 0o700 });
  const work = join(tmpRoot, `pull-${randomBytes(6).toString("hex")}`);
  await mkdir(work, { mode: 0o700 });
  let proxy: PullProxy | undefined;
  try {
    proxy = await startPullProxy({
      socket: proxySocket(work),
      ...(o.registry.fence ? { fence: o.registry.fence } : {}),
      log,
    });
    const { host, port } = registryAddress(ref);
    const route: PullRoute = {
      socket: proxy.socket,
      tunnels: ref.host && isLoopbackHost(host) ? [`${host.includes(":") ? `[${host}]` : host}:${port}`] : [],
    };
    const fenced = withRoute(proxy, route);
    const common = await commonArgs(ref, o, work);
    const { digest, raw } = await authorizedDigest(ref, common, o, work, log, fenced);
    const root = join(resolve(o.cacheDir), "images", "pulled");
    const layout = join(root, pulledKey(ref.name, digest));
    if (await isLayout(layout)) {
      log(`image: ${ref.canonical} is ${digest}, already pulled`);
      await touchEntry(layout);
      return { layout, digest, cached: true, pullMs: performance.now() - t0 };
    }
    // Sized before a blob is fetched: over the cap is refused, short of disk is 507.
    const bytes = await declaredImageBytes(ref, raw, common, o, work, log, fenced);
    const cap = o.registry.maxPullBytes ?? DEFAULT_MAX_PULL_BYTES;
    if (bytes > cap)
      throw pullError(
        `pulling ${ref.canonical}`,
        "image_too_large",
        `the image is ${bytes} bytes, over the ${cap}-byte pull limit`,
      );
    await needFreeSpace(
      work,
      `pulling ${ref.canonical}`,
      bytes,
      o.diskReserveBytes ?? DEFAULT_DISK_RESERVE_BYTES,
    );
    await mkdir(root, { recursive: true });
    const dest = join(work, "layout");
    await fenced(
      [
        "copy",
        "--quiet",
        ...common,
        // sandboxd guests are linux/amd64: pick that image from a multi-platform index.
        "--override-os",
        "linux",
        "--override-arch",
        "amd64",
        `docker://${ref.name}@${digest}`,
        `oci:${dest}:image`,
      ],
      { ...o, timeoutMs: o.pullTimeoutMs ?? PULL_TIMEOUT_MS, what: `pulling ${ref.canonical}`, tmp: work },
      log,
    );
    try {
      await rename(dest, layout);
    } catch (err) {
      // A concurrent pull of the same digest won the rename: its layout is as good as ours.
      if (!(await isLayout(layout))) throw err;
    }
    const pullMs = performance.now() - t0;
    log(`image: pulled ${ref.canonical} (${digest}) in ${pullMs.toFixed(0)} ms`);
    return { layout, digest, cached: false, pullMs };
  } finally {
    await proxy?.close();
    await rm(work, { recursive: true, force: true });
  }
}

/** The proxy's socket; a unix socket path is at most 107 bytes, so a deep cache dir is refused. */
function proxySocket(work: string): string {
  const socket = join(work, "proxy.sock");
  if (Buffer.byteLength(socket) > 107)
    throw new SandboxdError("internal", `the pull proxy's socket path ${socket} is over 107 bytes`);
  return socket;
}

type RunSkopeo = typeof runSkopeoDirect;

/**
 * skopeo through `proxy` (in its namespace); a failure after the proxy refused a destination is
 * `registry_forbidden` whatever skopeo made of the 403, with the fence's words in the cause.
 */
function withRoute(proxy: PullProxy, route: PullRoute): RunSkopeo {
  return async (args, o, log) => {
    try {
      return await runSkopeoDirect(args, { ...o, route }, log);
    } catch (err) {
      if (proxy.refused.length > 0 && !(err instanceof SandboxdError && err.code === "gone"))
        throw proxyRefusal(o.what, proxy.refused, err);
      throw err;
    }
  };
}

async function checkRegistryAddress(ref: ImageReference, cfg: RegistryConfig): Promise<void> {
  if (!cfg.checkDestination) return;
  const { host, port } = registryAddress(ref);
  try {
    await cfg.checkDestination(host, port);
  } catch (err) {
    throw new SandboxdError(
      "image_pull_failed",
      `looking up ${ref.canonical} failed: the registry's address is not allowed`,
      { cause: err, details: { reason: "registry_forbidden" } },
    );
  }
}

/**
 * Options every skopeo call for `ref` takes: TLS, and always `--authfile`: the bake's own
 * credentials, the operator's file for a shared registry, or an empty file (anonymous), so that
 * skopeo never reads the host's default auth files.
 */
async function commonArgs(ref: ImageReference, o: PullOptions, work: string): Promise<string[]> {
  const args: string[] = [];
  if (!registryTlsVerify(ref, o.registry)) args.push("--src-tls-verify=false");
  const shared = o.registry.authFile;
  if (!o.auth && shared && isSharedRegistry(ref, o.registry)) {
    if (!existsSync(shared))
      throw new SandboxdError("internal", `SANDBOXD_REGISTRY_AUTH names ${shared}, which does not exist`);
    args.push("--authfile", shared);
    return args;
  }
  const file = join(work, "auth.json");
  const auths: Record<string, { auth: string }> = {};
  if (o.auth) {
    const key = ref.domain ?? DEFAULT_REGISTRY;
    auths[key] = { auth: Buffer.from(`${o.auth.username}:${o.auth.password}`).toString("base64") };
  }
  await writeFile(file, JSON.stringify({ auths }), { mode: 0o600 });
  args.push("--authfile", file);
  return args;
}

/**
 * The manifest digest the registry serves THIS caller for `ref`: its manifest is fetched with the
 * caller's credentials (for a pinned digest too) and hashed. A pinned digest the registry serves
 * other bytes for is refused.
 */
async function authorizedDigest(
  ref: ImageReference,
  common: string[],
  o: PullOptions,
  work: string,
  log: (m: string) => void,
  run: RunSkopeo,
): Promise<{ digest: string; raw: Buffer }> {
  // `--raw`: only the manifest (or multi-platform index) is fetched, no config blob; its digest
  // is the hash of those exact bytes, what the registry serves it by.
  const what = `looking up ${ref.canonical}`;
  const raw = await run(
    [
      "inspect",
      "--raw",
      // `inspect` spells the TLS option without the `src-` prefix.
      ...common.map((a) => (a === "--src-tls-verify=false" ? "--tls-verify=false" : a)),
      `docker://${ref.digest ? `${ref.name}@${ref.digest}` : ref.canonical}`,
    ],
    { ...o, timeoutMs: o.inspectTimeoutMs ?? INSPECT_TIMEOUT_MS, what, tmp: work },
    log,
  );
  if (raw.length === 0 || raw[0] !== 0x7b /* { */)
    throw pullError(what, "bad_manifest", "the registry sent no manifest");
  const algo = ref.digest?.startsWith("sha512:") ? "sha512" : "sha256";
  const digest = `${algo}:${createHash(algo).update(raw).digest("hex")}`;
  if (ref.digest && digest !== ref.digest)
    throw pullError(what, "digest_mismatch", "the registry served a manifest with another digest");
  return { digest, raw };
}

/**
 * What a manifest says about size: an image manifest's bytes (config plus layers, as declared;
 * skopeo checks every blob against its digest, so a blob cannot be longer than its descriptor
 * says), or, for a multi-platform index, the digest of its linux/amd64 manifest.
 */
export function manifestSize(raw: Buffer | string): { bytes: number } | { platform: string } {
  let m: unknown;
  try {
    m = JSON.parse(raw.toString());
  } catch {
    throw pullError("reading the manifest", "bad_manifest", "the registry sent a manifest that is not JSON");
  }
  const o = (m ?? {}) as { layers?: unknown; config?: unknown; manifests?: unknown };
  const sizeOf = (d: unknown): number => {
    const n = (d as { size?: unknown } | null)?.size;
    if (typeof n !== "number" || !Number.isSafeInteger(n) || n < 0)
      throw pullError("reading the manifest", "bad_manifest", "the manifest declares no size for a blob");
    return n;
  };
  if (Array.isArray(o.layers))
    return { bytes: o.layers.reduce((a: number, l) => a + sizeOf(l), sizeOf(o.config)) };
  if (Array.isArray(o.manifests)) {
    const hit = o.manifests.find((d) => {
      const p = (d as { platform?: { os?: unknown; architecture?: unknown } }).platform;
      return p?.os === "linux" && p.architecture === "amd64";
    }) as { digest?: unknown } | undefined;
    if (typeof hit?.digest !== "string" || !/^sha256:[a-f0-9]{64}$/.test(hit.digest))
      throw pullError("reading the manifest", "no_platform", "the image has no linux/amd64 variant");
    return { platform: hit.digest };
  }
  throw pullError("reading the manifest", "bad_manifest", "the manifest lists no layers");
}

/** The bytes the copy will write: the manifest's declared sizes (the platform's, for an index). */
async function declaredImageBytes(
  ref: ImageReference,
  raw: Buffer,
  common: string[],
  o: PullOptions,
  work: string,
  log: (m: string) => void,
  run: RunSkopeo,
): Promise<number> {
  const first = manifestSize(raw);
  if ("bytes" in first) return first.bytes;
  const what = `looking up ${ref.canonical}`;
  const inner = await run(
    [
      "inspect",
      "--raw",
      ...common.map((a) => (a === "--src-tls-verify=false" ? "--tls-verify=false" : a)),
      `docker://${ref.name}@${first.platform}`,
    ],
    { ...o, timeoutMs: o.inspectTimeoutMs ?? INSPECT_TIMEOUT_MS, what, tmp: work },
    log,
  );
  if (`sha256:${createHash("sha256").update(inner).digest("hex")}` !== first.platform)
    throw pullError(what, "digest_mismatch", "the registry served a manifest with another digest");
  const second = manifestSize(inner);
  if ("bytes" in second) return second.bytes;
  throw pullError(what, "bad_manifest", "the platform's manifest is another index");
}

async function isLayout(dir: string): Promise<boolean> {
  try {
    await stat(join(dir, "index.json"));
    await stat(join(dir, "oci-layout"));
    return true;
  } catch {
    return false;
  }
}
