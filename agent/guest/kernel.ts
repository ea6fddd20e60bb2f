/**
 * The guest kernel: the pinned Debian cloud kernel package, downloaded once and checked against
 * its checksum, its uncompressed ELF `vmlinux` (what `-M microvm` boots by PVH), and the virtio
 * modules the guest loads, resolved from its modules tree in dependency order. artifacts.ts puts
 * them into the cache and the initramfs.
 */
import { existsSync } from "node:fs";
import { mkdir, mkdtemp, readdir, readFile, rename, rm, writeFile } from "node:fs/promises";
import { basename, dirname, join, relative } from "node:path";
import { GuestArtifactsError, publishDir, run, sha256 } from "./artifacts-common.ts";

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

// ---------------------------------------------------------------------------------------------
// Kernel package

/** Unpacks the pinned kernel package into `dir` once: vmlinux, lib/modules, its config. */
export async function ensureKernel(
  dir: string,
  guestRoot: string,
  log: (msg: string) => void,
): Promise<string> {
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

function firstLine(err: unknown): string {
  return (err instanceof Error ? err.message : String(err)).split("\n")[0] ?? "";
}
