import { createHash } from "node:crypto";
import { existsSync } from "node:fs";
import {
  chmod,
  copyFile,
  link,
  mkdir,
  mkdtemp,
  readdir,
  readFile,
  rename,
  rm,
  stat,
  writeFile,
} from "node:fs/promises";
import { basename, dirname, join, relative, resolve } from "node:path";
import { gzipSync } from "node:zlib";
import { ifExists } from "../../contracts/best-effort.ts";
import { runTool, ToolError } from "../host/tool.ts";

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
 * The kernel is pinned: a new Debian kernel is a deliberate change (bump these three and the
 * checksum), never something a rebuild picks up by itself. Debian keeps superseded security
 * versions in the archive (snapshot.debian.org at worst), so the pin stays fetchable.
 */
export const KERNEL_PACKAGE = "linux-image-6.1.0-56-cloud-amd64";
export const KERNEL_PACKAGE_VERSION = "6.1.192-2";
/** `uname -r` of that package: the directory name under lib/modules. */
export const KERNEL_RELEASE = "6.1.0-56-cloud-amd64";
/** sha256 of linux-image-6.1.0-56-cloud-amd64_6.1.192-2_amd64.deb, computed when pinned. */
export const KERNEL_DEB_SHA256 = "e7d02b943971edcb8790e256c02cfab3bca6c3d37c1bf25392a57c71300615ee";

/** Bump when this file changes what it produces: it is part of every cache key. */
export const ARTIFACTS_SCRIPT_VERSION = 1;

/**
 * The modules the guest loads, by module name. In the Debian cloud kernel virtio is modular
 * (virtio_ring, virtio, virtio_mmio, virtio_blk, virtio_console are `.ko` files, not built in);
 * dependencies are added and ordered automatically from each module's
 * `depends=`. Required ones fail the build when missing; optional ones are skipped with a log.
 */
export const GUEST_MODULES: ReadonlyArray<{ name: string; required: boolean }> = [
  { name: "virtio_ring", required: true },
  { name: "virtio", required: true },
  { name: "virtio_mmio", required: true },
  { name: "virtio_blk", required: true },
  { name: "virtio_console", required: true },
  // Networking (virtio-net-device needs the failover pair).
  { name: "failover", required: false },
  { name: "net_failover", required: false },
  { name: "virtio_net", required: false },
  // Entropy from the host (virtio-rng-device); the file is virtio-rng.ko.
  { name: "virtio_rng", required: false },
];

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

export class GuestArtifactsError extends Error {
  readonly code = "guest_artifacts";
  constructor(message: string, opts?: { cause?: unknown }) {
    super(message, opts);
    this.name = "GuestArtifactsError";
  }
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
// Kernel package

async function ensureKernel(dir: string, guestRoot: string, log: (msg: string) => void): Promise<string> {
  if (existsSync(join(dir, "complete.json"))) return dir;
  log(`fetching kernel ${KERNEL_PACKAGE}=${KERNEL_PACKAGE_VERSION}`);
  const tmp = await mkdtemp(join(guestRoot, ".tmp-kernel-"));
  try {
    const deb = await downloadKernelDeb(tmp, log);
    const debSha = sha256(await readFile(deb));
    if (debSha !== KERNEL_DEB_SHA256) {
      throw new GuestArtifactsError(
        `${basename(deb)} has sha256 ${debSha}, expected the pinned ${KERNEL_DEB_SHA256}: refusing to boot an unverified kernel`,
      );
    }
    const root = join(tmp, "root");
    await run("dpkg", ["-x", deb, root]);
    const vmlinuz = join(root, "boot", `vmlinuz-${KERNEL_RELEASE}`);
    log(`extracting the ELF vmlinux from ${basename(vmlinuz)}`);
    await extractVmlinux(vmlinuz, join(tmp, "final", "vmlinux"));
    // Keep only what later builds need: vmlinux, the modules tree, the kernel config (for humans).
    await rename(join(root, "lib"), join(tmp, "final", "lib"));
    await rename(join(root, "boot", `config-${KERNEL_RELEASE}`), join(tmp, "final", "config"));
    await writeFile(
      join(tmp, "final", "complete.json"),
      `${JSON.stringify({ pkg: KERNEL_PACKAGE, ver: KERNEL_PACKAGE_VERSION, sha256: debSha, release: KERNEL_RELEASE })}\n`,
    );
    await publishDir(join(tmp, "final"), dir);
    log(`kernel ${KERNEL_RELEASE} unpacked in ${dir}`);
    return dir;
  } finally {
    await rm(tmp, { recursive: true, force: true });
  }
}

async function downloadKernelDeb(tmp: string, log: (msg: string) => void): Promise<string> {
  const spec = `${KERNEL_PACKAGE}=${KERNEL_PACKAGE_VERSION}`;
  // apt drops privileges to _apt for downloads; our temp dir is root-only, so say so explicitly
  // rather than get a warning on every build.
  const args = ["-o", "APT::Sandbox::User=root", "download", spec];
  try {
    await run("apt-get", args, { cwd: tmp });
  } catch (first) {
    // A fresh machine has no package lists: refresh them once, then try again.
    log(`apt-get download failed (${firstLine(first)}); running apt-get update once`);
    await run("apt-get", ["update"]);
    await run("apt-get", args, { cwd: tmp });
  }
  const deb = (await readdir(tmp)).find((f) => f.startsWith(`${KERNEL_PACKAGE}_`) && f.endsWith(".deb"));
  if (!deb) throw new GuestArtifactsError(`apt-get download ${spec} produced no .deb`);
  return join(tmp, deb);
}

/** LZ4 "legacy" frame magic (0x184C2102 little-endian): the kernel's lz4 payload starts with it. */
const LZ4_LEGACY_MAGIC = Buffer.from([0x02, 0x21, 0x4c, 0x18]);

/**
 * `-M microvm` boots an ELF by PVH; Debian ships only the bzImage, whose payload is LZ4 (the
 * bzImage itself hangs under microvm with QEMU 7.2). Find the payload (the LZ4 legacy magic) and
 * decompress it.
 */
export async function extractVmlinux(vmlinuz: string, out: string): Promise<void> {
  const image = await readFile(vmlinuz);
  const at = image.indexOf(LZ4_LEGACY_MAGIC);
  if (at < 0)
    throw new GuestArtifactsError(`${vmlinuz}: no LZ4 payload found (is this kernel still LZ4-compressed?)`);
  await mkdir(dirname(out), { recursive: true });
  // lz4 exits 1 here even on success: the payload is followed by the rest of the bzImage, which
  // it reports as trailing garbage. The ELF checks below are what decide success.
  await run("lz4", ["-d", "-f", "-", out], { stdin: image.subarray(at), allowExit: [0, 1] });
  checkElf(await readFile(out), out);
}

/** Checks the ELF header and that every section lies inside the file (a truncated stream fails). */
function checkElf(buf: Buffer, what: string): void {
  if (buf.length < 64 || buf.subarray(0, 4).toString("latin1") !== "\x7fELF") {
    throw new GuestArtifactsError(`${what} is not an ELF file`);
  }
  if (buf[4] !== 2 || buf[5] !== 1)
    throw new GuestArtifactsError(`${what} is not a 64-bit little-endian ELF`);
  const shoff = Number(buf.readBigUInt64LE(0x28));
  const shentsize = buf.readUInt16LE(0x3a);
  const shnum = buf.readUInt16LE(0x3c);
  // The decompressed payload is vmlinux followed by its relocation table, so the ELF ends before
  // the file does; it may not extend past it.
  if (shoff + shentsize * shnum > buf.length) throw new GuestArtifactsError(`${what}: ELF is truncated`);
}

// ---------------------------------------------------------------------------------------------
// Modules

export interface ResolvedModule {
  name: string;
  /** File name as shipped (virtio-rng.ko), which is what /lib/modules/ and modules.order use. */
  file: string;
  path: string;
  bytes: Buffer;
  sha256: string;
}

/** Module name as the kernel knows it: file name without .ko, dashes as underscores. */
function moduleName(file: string): string {
  return file.replace(/\.ko$/, "").replaceAll("-", "_");
}

/**
 * Resolves GUEST_MODULES to files under `<modulesDir>/kernel` and orders them so that every
 * module comes after what it depends on. The Debian package ships no modules.dep (depmod makes
 * it at install time), so dependencies come from each module's own `.modinfo` `depends=` field.
 */
export async function resolveModules(
  modulesDir: string,
  log: (msg: string) => void,
): Promise<ResolvedModule[]> {
  const index = new Map<string, string>();
  for (const path of await walk(join(modulesDir, "kernel"))) {
    if (path.endsWith(".ko")) index.set(moduleName(basename(path)), path);
  }
  const ordered: ResolvedModule[] = [];
  const visiting = new Set<string>();
  const done = new Set<string>();
  const visit = async (name: string, required: boolean, chain: string[]): Promise<boolean> => {
    if (done.has(name)) return true;
    if (visiting.has(name))
      throw new GuestArtifactsError(`module dependency cycle: ${[...chain, name].join(" -> ")}`);
    const path = index.get(name);
    if (!path) {
      if (required) throw new GuestArtifactsError(`required module ${name} is not in ${modulesDir}`);
      log(`module ${name} not in this kernel; skipped`);
      return false;
    }
    visiting.add(name);
    const bytes = await readFile(path);
    for (const dep of modinfoDepends(bytes)) {
      // A dependency of a module we load is required for that module to load at all.
      if (!(await visit(dep, true, [...chain, name]))) return false;
    }
    visiting.delete(name);
    done.add(name);
    ordered.push({ name, file: basename(path), path, bytes, sha256: sha256(bytes) });
    return true;
  };
  for (const m of GUEST_MODULES) await visit(m.name, m.required, []);
  log(`guest modules: ${ordered.map((m) => relative(join(modulesDir, "kernel"), m.path)).join(" ")}`);
  return ordered;
}

/** Reads `depends=a,b` from a module's .modinfo strings (NUL-separated `key=value`). */
export function modinfoDepends(ko: Buffer): string[] {
  const needle = Buffer.from("\0depends=");
  const at = ko.indexOf(needle);
  if (at < 0) return [];
  const start = at + needle.length;
  const end = ko.indexOf(0, start);
  const value = ko.subarray(start, end < 0 ? undefined : end).toString("latin1");
  return value
    .split(",")
    .map((s) => s.trim())
    .filter((s) => s.length > 0)
    .map((s) => s.replaceAll("-", "_"));
}

async function walk(dir: string): Promise<string[]> {
  const out: string[] = [];
  for (const ent of await readdir(dir, { withFileTypes: true })) {
    const p = join(dir, ent.name);
    if (ent.isDirectory()) out.push(...(await walk(p)));
    else if (ent.isFile()) out.push(p);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Agent binary

/**
 * Builds the static guest agent: through guest/Makefile when there is one (its owner knows
 * the flags), else straight from every .c in guest/ with musl-gcc. Skipped when the
 * binary is newer than every source (.c and .h), so a cached initramfs stays valid.
 */
async function buildAgent(log: (msg: string) => void): Promise<string> {
  const makefile = join(AGENT_SRC_DIR, "Makefile");
  if (existsSync(makefile)) {
    log("building the guest agent: make -C guest");
    await run("make", ["-C", AGENT_SRC_DIR], { cwd: REPO_ROOT });
  } else {
    const srcs = await agentSources();
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
// Initramfs (newc cpio, written here so it needs no root: /dev/console is a device node)

interface CpioEntry {
  name: string;
  mode: number;
  data?: Buffer;
  rdevMajor?: number;
  rdevMinor?: number;
}

const S_IFDIR = 0o040000;
const S_IFREG = 0o100000;
const S_IFCHR = 0o020000;

export function buildInitramfs(agent: Buffer, modules: ResolvedModule[]): Buffer {
  const entries: CpioEntry[] = [
    // /dev/console must exist before /init runs: the kernel opens it as init's stdin/out/err, and
    // without it the agent has no console until it mounts devtmpfs (and early errors are lost).
    { name: "dev", mode: S_IFDIR | 0o755 },
    { name: "dev/console", mode: S_IFCHR | 0o600, rdevMajor: 5, rdevMinor: 1 },
    { name: "proc", mode: S_IFDIR | 0o755 },
    { name: "sys", mode: S_IFDIR | 0o755 },
    { name: "newroot", mode: S_IFDIR | 0o755 },
    { name: "etc", mode: S_IFDIR | 0o755 },
    {
      name: "etc/modules.order",
      mode: S_IFREG | 0o644,
      data: Buffer.from(modules.map((m) => `${m.file}\n`).join("")),
    },
    { name: "lib", mode: S_IFDIR | 0o755 },
    { name: "lib/modules", mode: S_IFDIR | 0o755 },
    ...modules.map((m) => ({ name: `lib/modules/${m.file}`, mode: S_IFREG | 0o644, data: m.bytes })),
    { name: "init", mode: S_IFREG | 0o755, data: agent },
  ];
  return writeNewc(entries);
}

/**
 * newc format (the kernel's Documentation/driver-api/early-userspace/buffer-format.rst): a
 * 110-byte ASCII header of 8-hex-digit fields, the NUL-terminated name, padding to 4 bytes, the
 * data, padding to 4 bytes; ends with "TRAILER!!!". mtime 0 and uid/gid 0 keep the output
 * identical for identical inputs.
 */
export function writeNewc(entries: CpioEntry[]): Buffer {
  const parts: Buffer[] = [];
  let offset = 0;
  const push = (b: Buffer) => {
    parts.push(b);
    offset += b.length;
  };
  const pad = () => {
    const n = (4 - (offset % 4)) % 4;
    if (n) push(Buffer.alloc(n));
  };
  const hex = (n: number) => n.toString(16).padStart(8, "0");
  const all: CpioEntry[] = [...entries, { name: "TRAILER!!!", mode: 0 }];
  all.forEach((e, i) => {
    const data = e.data ?? Buffer.alloc(0);
    const name = Buffer.from(`${e.name}\0`);
    const isDir = (e.mode & 0o170000) === S_IFDIR;
    const header =
      "070701" +
      hex(e.name === "TRAILER!!!" ? 0 : i + 1) + // ino
      hex(e.mode) +
      hex(0) + // uid
      hex(0) + // gid
      hex(isDir ? 2 : 1) + // nlink
      hex(0) + // mtime
      hex(data.length) +
      hex(0) + // devmajor
      hex(0) + // devminor
      hex(e.rdevMajor ?? 0) +
      hex(e.rdevMinor ?? 0) +
      hex(name.length) +
      hex(0); // check
    push(Buffer.from(header, "latin1"));
    push(name);
    pad();
    if (data.length) {
      push(data);
      pad();
    }
  });
  return Buffer.concat(parts);
}

// ---------------------------------------------------------------------------------------------
// Helpers

function sha256(b: Buffer): string {
  return createHash("sha256").update(b).digest("hex");
}

async function linkOrCopy(src: string, dst: string): Promise<void> {
  try {
    // vmlinux is ~53 MB: share it between cache entries on the same file system.
    await link(src, dst);
  } catch {
    await copyFile(src, dst);
  }
}

/** Renames a finished temp dir into place; if another builder won the race, theirs is kept. */
async function publishDir(tmp: string, final: string): Promise<void> {
  // mkdtemp makes 0700; the cache is read by whoever runs QEMU, so publish it world-readable.
  await chmod(tmp, 0o755);
  try {
    await rename(tmp, final);
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code;
    if ((code === "ENOTEMPTY" || code === "EEXIST") && existsSync(final)) return;
    throw err;
  }
}

function firstLine(err: unknown): string {
  return (err instanceof Error ? err.message : String(err)).split("\n")[0] ?? "";
}

interface RunOptions {
  cwd?: string;
  stdin?: Buffer;
  /** Exit codes that count as success (default: 0). */
  allowExit?: number[];
}

/**
 * Runs a tool to completion (agent/host/tool.ts); a failure or a non-allowed exit is a
 * GuestArtifactsError carrying the tail of its output, the ToolError as its cause.
 */
async function run(cmd: string, args: string[], opts: RunOptions = {}): Promise<void> {
  try {
    await runTool([cmd, ...args], {
      ...(opts.cwd ? { cwd: opts.cwd } : {}),
      ...(opts.stdin ? { input: opts.stdin } : {}),
      captureStdout: false,
    });
  } catch (err) {
    if (!(err instanceof ToolError)) throw err;
    const code = err.details.exitCode;
    if (err.kind === "exit" && code != null && (opts.allowExit ?? [0]).includes(code)) return;
    if (err.kind === "spawn") throw new GuestArtifactsError(err.message, { cause: err });
    const how = err.kind === "exit" ? (err.details.signal ?? `exit ${code}`) : err.message;
    throw new GuestArtifactsError(`${cmd} ${args.join(" ")} failed (${how}): ${err.details.output ?? ""}`, {
      cause: err,
    });
  }
}
