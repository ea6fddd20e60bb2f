import { existsSync } from "node:fs";
import { copyFile, link, mkdir, mkdtemp, readdir, readFile, rm, stat, writeFile } from "node:fs/promises";
import { dirname, join, resolve } from "node:path";
import { gzipSync } from "node:zlib";
import { ifExists } from "../../contracts/best-effort.ts";
import { GuestArtifactsError, publishDir, run, sha256 } from "./artifacts-common.ts";
import { buildInitramfs } from "./initramfs.ts";
import {
  ensureKernel,
  KERNEL_DEB_SHA256,
  KERNEL_PACKAGE,
  KERNEL_PACKAGE_VERSION,
  KERNEL_RELEASE,
  resolveModules,
} from "./kernel.ts";

export { GuestArtifactsError } from "./artifacts-common.ts";
export { buildInitramfs, writeNewc } from "./initramfs.ts";
export {
  extractVmlinux,
  GUEST_MODULES,
  KERNEL_DEB_SHA256,
  KERNEL_PACKAGE,
  KERNEL_PACKAGE_VERSION,
  KERNEL_RELEASE,
  modinfoDepends,
  type ResolvedModule,
  resolveModules,
} from "./kernel.ts";

/**
 * Builds what a guest boots: the uncompressed kernel (`vmlinux`, booted by PVH under `-M microvm`)
 * and a gzip newc initramfs holding the static guest agent as /init plus the virtio modules.
 *
 * Layout under `<dataDir>/guest/`:
 *   kernel-<pkgver>/         the unpacked kernel package: vmlinux + lib/modules (downloaded once)
 *   <key>/                   vmlinux (hard link) + initramfs.cpio.gz + manifest.json
 * `<key>` hashes every input, so a changed agent binary makes a new initramfs without downloading
 * the kernel again, and an unchanged one is reused as-is. Both are built in a temp dir and renamed
 * into place, so a crash mid-build never leaves a half-written cache entry behind.
 */

export interface GuestArtifacts {
  vmlinux: string;
  initramfs: string;
  kernelVersion: string;
  key: string;
}

export interface EnsureGuestArtifactsOptions {
  dataDir: string;
  log?: (msg: string) => void;
  /** Use this agent binary instead of building `build/guest/sandboxd-agent` from agent/guest. */
  agentBinary?: string;
  /**
   * false: only look (doctor without --build): nothing is downloaded or compiled, and a missing
   * piece is a GuestArtifactsError saying what to build. Default true.
   */
  build?: boolean;
}

/**
 * Bump when this file, kernel.ts or initramfs.ts changes what it produces: it is part of every
 * cache key.
 */
export const ARTIFACTS_SCRIPT_VERSION = 1;

const REPO_ROOT = resolve(import.meta.dir, "..", "..");
const AGENT_SRC_DIR = join(REPO_ROOT, "guest");
/** The guest agent's C sources: one file per concern, one shared header, protocol.h. */
const AGENT_C_DIR = AGENT_SRC_DIR;
export const DEFAULT_AGENT_BINARY = join(REPO_ROOT, "build", "guest", "sandboxd-agent");

/** One build per cache directory at a time inside this process. */
const inFlight = new Map<string, Promise<unknown>>();

function once<T>(key: string, fn: () => Promise<T>): Promise<T> {
  const existing = inFlight.get(key);
  if (existing) return existing as Promise<T>;
  const p = fn().finally(() => inFlight.delete(key));
  inFlight.set(key, p);
  return p;
}

export async function ensureGuestArtifacts(opts: EnsureGuestArtifactsOptions): Promise<GuestArtifacts> {
  const log = opts.log ?? (() => {});
  const guestRoot = join(resolve(opts.dataDir), "guest");
  await mkdir(guestRoot, { recursive: true });

  const build = opts.build ?? true;
  const kernelDir = join(guestRoot, `kernel-${KERNEL_PACKAGE_VERSION}`);
  if (!build && !existsSync(join(kernelDir, "complete.json"))) {
    throw new GuestArtifactsError(
      `kernel ${KERNEL_PACKAGE}=${KERNEL_PACKAGE_VERSION} is not unpacked in ${kernelDir}`,
    );
  }
  await once(`kernel:${guestRoot}`, () => ensureKernel(kernelDir, guestRoot, log));
  const agentPath = opts.agentBinary
    ? resolve(opts.agentBinary)
    : build
      ? await buildAgent(log)
      : DEFAULT_AGENT_BINARY;
  const agentBytes = await readFile(agentPath).catch((cause: unknown) => {
    throw new GuestArtifactsError(`guest agent binary ${agentPath} is not readable`, { cause });
  });
  if (agentBytes.subarray(0, 4).toString("latin1") !== "\x7fELF") {
    throw new GuestArtifactsError(`guest agent ${agentPath} is not an ELF binary`);
  }
  const modules = await resolveModules(join(kernelDir, "lib", "modules", KERNEL_RELEASE), log);

  const inputs = {
    script: ARTIFACTS_SCRIPT_VERSION,
    kernel: { pkg: KERNEL_PACKAGE, ver: KERNEL_PACKAGE_VERSION, sha256: KERNEL_DEB_SHA256 },
    agentSha256: sha256(agentBytes),
    modules: modules.map((m) => ({ file: m.file, sha256: m.sha256 })),
  };
  // 16 hex chars (64 bits) is plenty to tell a handful of builds apart.
  const key = sha256(Buffer.from(JSON.stringify(inputs))).slice(0, 16);
  const outDir = join(guestRoot, key);
  const result: GuestArtifacts = {
    vmlinux: join(outDir, "vmlinux"),
    initramfs: join(outDir, "initramfs.cpio.gz"),
    kernelVersion: KERNEL_RELEASE,
    key,
  };
  if (existsSync(join(outDir, "manifest.json"))) {
    log(`guest artifacts ${key} cached in ${outDir}`);
    return result;
  }
  if (!build) throw new GuestArtifactsError(`guest initramfs ${key} is not built (expected in ${outDir})`);
  await once(`initramfs:${outDir}`, async () => {
    if (existsSync(join(outDir, "manifest.json"))) return;
    log(`building guest initramfs ${key} (agent ${agentPath}, ${modules.length} modules)`);
    const tmp = await mkdtemp(join(guestRoot, `.tmp-${key}-`));
    try {
      await linkOrCopy(join(kernelDir, "vmlinux"), join(tmp, "vmlinux"));
      const cpio = buildInitramfs(agentBytes, modules);
      const gz = gzipSync(cpio, { level: 9 });
      await writeFile(join(tmp, "initramfs.cpio.gz"), gz);
      await writeFile(
        join(tmp, "manifest.json"),
        `${JSON.stringify({ key, inputs, builtAt: new Date().toISOString() }, null, 2)}\n`,
      );
      await publishDir(tmp, outDir);
      log(`guest initramfs ${key}: ${gz.length} bytes gzip (${cpio.length} cpio)`);
    } finally {
      await rm(tmp, { recursive: true, force: true });
    }
  });
  return result;
}

// ---------------------------------------------------------------------------------------------
// Agent binary

/**
 * Builds the static guest agent: through guest/Makefile when there is one (its owner knows
 * the flags), else straight from every .c in guest/ with musl-gcc. Skipped when the
 * binary is newer than every source (.c and .h), so a cached initramfs stays valid, and when
 * there are no sources but the binary is there (an installed copy such as the agent image).
 */
async function buildAgent(log: (msg: string) => void): Promise<string> {
  const makefile = join(AGENT_SRC_DIR, "Makefile");
  if (existsSync(makefile)) {
    log("building the guest agent: make -C guest");
    await run("make", ["-C", AGENT_SRC_DIR], { cwd: REPO_ROOT });
  } else {
    const srcs = await agentSources();
    // An installed copy without the sources (the agent image, deploy/images/) ships the binary
    // built at image build time: it is used as it is.
    if (srcs.length === 0 && existsSync(DEFAULT_AGENT_BINARY)) return DEFAULT_AGENT_BINARY;
    if (!srcs.some((f) => f.endsWith(".c"))) {
      throw new GuestArtifactsError(
        `no guest agent: neither ${makefile} nor C sources in ${AGENT_C_DIR} exist (pass agentBinary)`,
      );
    }
    if (await isStale(DEFAULT_AGENT_BINARY, srcs)) {
      log("building the guest agent: musl-gcc -static guest/*.c");
      await mkdir(dirname(DEFAULT_AGENT_BINARY), { recursive: true });
      const cFiles = srcs.filter((f) => f.endsWith(".c"));
      await run("musl-gcc", ["-static", "-Os", "-Wall", "-o", DEFAULT_AGENT_BINARY, ...cFiles], {
        cwd: AGENT_C_DIR,
      });
    }
  }
  if (!existsSync(DEFAULT_AGENT_BINARY))
    throw new GuestArtifactsError(`agent build did not produce ${DEFAULT_AGENT_BINARY}`);
  return DEFAULT_AGENT_BINARY;
}

/** Every .c and .h of the guest agent (sorted, absolute): what the binary is built from. */
async function agentSources(): Promise<string[]> {
  const names = await readdir(AGENT_C_DIR).catch(() => [] as string[]);
  return names
    .filter((f) => /\.(c|h)$/.test(f))
    .sort()
    .map((f) => join(AGENT_C_DIR, f));
}

async function isStale(target: string, srcs: string[]): Promise<boolean> {
  const t = await ifExists(stat(target));
  if (!t) return true;
  for (const f of srcs) {
    if ((await stat(f)).mtimeMs > t.mtimeMs) return true;
  }
  return false;
}

// ---------------------------------------------------------------------------------------------
// Helpers

async function linkOrCopy(src: string, dst: string): Promise<void> {
  try {
    // vmlinux is ~53 MB: share it between cache entries on the same file system.
    await link(src, dst);
  } catch {
    await copyFile(src, dst);
  }
}
