/**
 * Pulling an image by OCI reference (Family B bake, spec 4.2 `image`) into the agent's image
 * cache, then handing the OCI layout to the importer (import.ts) like any uploaded image:
 *
 *   parse the reference (contracts/image-ref.ts: no option injection, no schemes)
 *   -> skopeo inspect          the manifest digest of the reference as it is now
 *   -> <cacheDir>/images/pulled/<hex>/ exists?   yes: done, nothing is fetched again
 *   -> skopeo copy docker://NAME@DIGEST oci:<tmp>:image   then rename into place (atomic)
 *
 * Copying by the inspected digest (not by tag) makes the cache key and the bytes agree even when
 * the tag moves between the two calls. skopeo checks every blob against its digest while it
 * copies, and the importer scans the layout again (paths, links, sizes) before unpacking it.
 *
 * Transport security follows Docker: a registry on a loopback address (127.0.0.0/8, ::1,
 * `localhost`) is spoken to over plain HTTP, any other only over verified TLS unless the operator
 * lists it in `SANDBOXD_INSECURE_REGISTRIES`. Credentials come from a docker `config.json` style
 * file named by `SANDBOXD_REGISTRY_AUTH` (skopeo `--authfile`); without it skopeo looks in its
 * usual places.
 */
import { createHash, randomBytes } from "node:crypto";
import { existsSync } from "node:fs";
import { mkdir, rename, rm, stat } from "node:fs/promises";
import { isIP } from "node:net";
import { join, resolve } from "node:path";
import { SandboxdError } from "../../contracts/errors.ts";
import { type ImageReference, ImageReferenceError, parseImageReference } from "../../contracts/image-ref.ts";
import { runTool, ToolError } from "../host/tool.ts";

export interface RegistryConfig {
  /** A docker `config.json` style credentials file (skopeo `--authfile`). */
  authFile?: string;
  /** `host` or `host:port` entries spoken to without TLS verification (beyond loopback). */
  insecureRegistries: string[];
}

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

/** Reads the registry settings from the agent's environment; a bad entry is refused at start. */
export function registryConfigFromEnv(env: Record<string, string | undefined> = process.env): RegistryConfig {
  const out: RegistryConfig = { insecureRegistries: [] };
  const auth = env.SANDBOXD_REGISTRY_AUTH?.trim();
  if (auth) out.authFile = resolve(auth);
  for (const raw of (env.SANDBOXD_INSECURE_REGISTRIES ?? "").split(",")) {
    const entry = raw.trim().toLowerCase();
    if (entry === "") continue;
    if (!/^(?:[a-z0-9]([a-z0-9.-]*[a-z0-9])?|\[[0-9a-f:.]+\])(?::[0-9]{1,5})?$/.test(entry))
      throw new SandboxdError(
        "bad_request",
        `SANDBOXD_INSECURE_REGISTRIES: ${JSON.stringify(raw)} is not host or host:port`,
      );
    out.insecureRegistries.push(entry);
  }
  return out;
}

/** True for a registry host on the loopback interface: 127.0.0.0/8, ::1, `localhost`. */
export function isLoopbackHost(host: string): boolean {
  const h = host.toLowerCase().replace(/^\[|\]$/g, "");
  if (h === "localhost" || h.endsWith(".localhost")) return true;
  if (isIP(h) === 4) return h.split(".")[0] === "127";
  if (isIP(h) === 6) {
    // Any spelling of ::1 (e.g. 0:0:0:0:0:0:0:1), and ::ffff:127.x.y.z.
    const norm = new URL(`http://[${h}]/`).hostname;
    return norm === "[::1]" || /^\[::ffff:7f[0-9a-f]{2}:[0-9a-f]{1,4}\]$/.test(norm);
  }
  return false;
}

/**
 * Whether to verify TLS for the reference's registry: not for loopback (as Docker), not for a
 * registry the operator listed as insecure (by `host:port`, or by `host` for every port).
 */
export function registryTlsVerify(ref: ImageReference, cfg: RegistryConfig): boolean {
  if (!ref.host) return true; // the default registry: always TLS
  if (isLoopbackHost(ref.host)) return false;
  const domain = (ref.domain ?? "").toLowerCase();
  return !cfg.insecureRegistries.some((e) => e === domain || e === ref.host);
}

export interface PullOptions {
  reference: string;
  /** The agent's cache dir; layouts go to `<cacheDir>/images/pulled/<hex>/`. */
  cacheDir: string;
  registry: RegistryConfig;
  signal?: AbortSignal;
  inspectTimeoutMs?: number;
  pullTimeoutMs?: number;
  log?: (m: string) => void;
}

export interface PulledImage {
  /** An OCI layout directory holding exactly this image (tag `image`). */
  layout: string;
  /** `sha256:<hex>` of the manifest that was pulled. */
  digest: string;
  /** True when the digest was already in the cache: nothing was fetched. */
  cached: boolean;
  /** Wall time of inspect + copy, ms. */
  pullMs: number;
}

/** Pulls `reference` into the cache (once per manifest digest) and returns its OCI layout. */
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
  const common = commonArgs(ref, o.registry);
  const digest = ref.digest ?? (await inspectDigest(ref, common, o, log));
  const hex = digest.slice(digest.indexOf(":") + 1);
  const root = join(resolve(o.cacheDir), "images", "pulled");
  const layout = join(root, hex);
  if (await isLayout(layout)) {
    log(`image: ${ref.canonical} is ${digest}, already pulled`);
    return { layout, digest, cached: true, pullMs: performance.now() - t0 };
  }
  await mkdir(root, { recursive: true });
  const tmpRoot = join(resolve(o.cacheDir), "tmp");
  await mkdir(tmpRoot, { recursive: true, mode: 0o700 });
  const work = join(tmpRoot, `pull-${hex.slice(0, 12)}-${randomBytes(4).toString("hex")}`);
  await mkdir(work, { mode: 0o700 });
  try {
    const dest = join(work, "layout");
    await runSkopeo(
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
  } finally {
    await rm(work, { recursive: true, force: true });
  }
  const pullMs = performance.now() - t0;
  log(`image: pulled ${ref.canonical} (${digest}) in ${pullMs.toFixed(0)} ms`);
  return { layout, digest, cached: false, pullMs };
}

/** Options every skopeo call for `ref` takes: TLS, credentials. */
function commonArgs(ref: ImageReference, cfg: RegistryConfig): string[] {
  const args: string[] = [];
  if (!registryTlsVerify(ref, cfg)) args.push("--src-tls-verify=false");
  if (cfg.authFile) {
    if (!existsSync(cfg.authFile))
      throw new SandboxdError(
        "bad_request",
        `SANDBOXD_REGISTRY_AUTH names ${cfg.authFile}, which does not exist`,
      );
    args.push("--authfile", cfg.authFile);
  }
  return args;
}

async function inspectDigest(
  ref: ImageReference,
  common: string[],
  o: PullOptions,
  log: (m: string) => void,
): Promise<string> {
  // `--raw`: only the manifest (or multi-platform index) is fetched, no config blob; its digest
  // is the sha256 of those exact bytes, what the registry serves it by.
  const raw = await runSkopeo(
    [
      "inspect",
      "--raw",
      // `inspect` spells the TLS option without the `src-` prefix.
      ...common.map((a) => (a === "--src-tls-verify=false" ? "--tls-verify=false" : a)),
      `docker://${ref.canonical}`,
    ],
    { ...o, timeoutMs: o.inspectTimeoutMs ?? INSPECT_TIMEOUT_MS, what: `looking up ${ref.canonical}` },
    log,
  );
  if (raw.length === 0 || raw[0] !== 0x7b /* { */)
    throw new SandboxdError(
      "image_pull_failed",
      `looking up ${ref.canonical}: the registry sent no manifest`,
    );
  return `sha256:${createHash("sha256").update(raw).digest("hex")}`;
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

/** Runs skopeo with a deadline and the caller's abort signal; a failure says skopeo's reason. */
async function runSkopeo(
  args: string[],
  o: { signal?: AbortSignal; timeoutMs: number; what: string; tmp?: string },
  log: (m: string) => void,
): Promise<Buffer> {
  try {
    const { stdout } = await runTool(["skopeo", ...args], {
      timeoutMs: o.timeoutMs,
      signal: o.signal,
      // skopeo stages blobs in TMPDIR (/var/tmp otherwise): keep them in the work dir we remove.
      env: o.tmp ? { TMPDIR: o.tmp } : undefined,
      log: (line) => log(`image: ${line}`),
    });
    return stdout;
  } catch (err) {
    if (!(err instanceof ToolError)) throw err;
    switch (err.kind) {
      case "aborted":
        throw new SandboxdError("gone", `${o.what}: cancelled`, { cause: err });
      case "timeout":
        throw new SandboxdError(
          "image_pull_failed",
          `${o.what}: no answer within ${Math.round(o.timeoutMs / 1000)} s`,
          { cause: err },
        );
      case "spawn":
        throw new SandboxdError("image_pull_failed", `${o.what}: cannot run skopeo`, { cause: err });
      case "output_too_large":
        throw new SandboxdError("image_pull_failed", `${o.what}: ${err.message}`, { cause: err });
      default: {
        const output = err.details.output ?? "";
        throw new SandboxdError("image_pull_failed", `${o.what} failed: ${skopeoReason(output)}`, {
          cause: err,
          details: { exitCode: err.details.exitCode, output },
        });
      }
    }
  }
}

/**
 * The readable part of a skopeo error: its last line, without the `time=... level=fatal msg=`
 * logging prefix and the long Go error chain before the registry's own words.
 */
export function skopeoReason(output: string): string {
  const last =
    output
      .split("\n")
      .filter((l) => l.trim() !== "")
      .pop() ?? "skopeo failed";
  const msg = /msg="((?:[^"\\]|\\.)*)"/.exec(last)?.[1]?.replace(/\\"/g, '"') ?? last;
  return msg.length > 600 ? `...${msg.slice(-600)}` : msg;
}
