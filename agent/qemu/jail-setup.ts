/**
 * What one VM's jail holds, made ready on the host before QEMU starts: the VM's uid (uids.ts),
 * its cgroup (cgroup.ts), ownership of the files QEMU writes, and the list of files it reads
 * (kernel, initramfs, every backing file of its disk). `jail.ts` turns that into the argv.
 * Any missing ingredient is a JailError and nothing is started; what was made is undone.
 */
import { accessSync, constants } from "node:fs";
import { chmod, chown, lstat, mkdir, open, readdir, rm, stat, symlink, writeFile } from "node:fs/promises";
import { dirname, join, resolve } from "node:path";
import { ifExists } from "../../contracts/best-effort.ts";
import { runTool } from "../host/tool.ts";
import { createVmCgroup, removeVmCgroup, vmLimits } from "./cgroup.ts";
import {
  JAIL_KVM_NODE,
  JailError,
  type JailSpec,
  jailFstab,
  jailFstabPath,
  jailRoot,
  jailSkeleton,
  MKNOD,
  missingJailTools,
  UNSHARE,
} from "./jail.ts";
import { ensureRamShim } from "./ram-shim.ts";
import { allocateUid, DEFAULT_UID_RANGE, releaseUid, type UidRange } from "./uids.ts";

/** RLIMIT_NOFILE of a jailed QEMU: its sockets, images and eventfds fit many times over. */
export const JAIL_MAX_OPEN_FILES = 1024;
/** Beyond the largest file a VM may write (its disk or RAM): qcow2 metadata and the console. */
const FILE_SIZE_MARGIN = 64 * 1024 * 1024;
/** Read by the jails that bind it (their uids differ), written by none: root's, 0444. */
const SHARED_RAM_FILE_MODE = 0o444;

export interface JailInput {
  dir: string;
  vmlinux: string;
  initramfs: string;
  disk?: string;
  /** What the agent's records say `disk` may be backed by (args.ts `LaunchOptions.backing`). */
  backing?: ReadonlySet<string>;
  mem?: { path: string; share: boolean };
  memMib: number;
  vcpus: number;
  kvm: boolean;
  hostPidFile: string;
  /** Default: DEFAULT_JAIL. */
  settings?: JailSettings;
}

export interface PreparedJail {
  spec: JailSpec;
  uid: number;
}

/** The operator's jail settings: the uid range (uids.ts) and the `unshare` binary to run. */
export interface JailSettings {
  /** `SANDBOXD_JAIL_UID_BASE` / `SANDBOXD_JAIL_UID_COUNT`. */
  uidRange: UidRange;
  /** `SANDBOXD_JAIL_UNSHARE`: an operator's override of util-linux's. */
  unshare: string;
  /**
   * `SANDBOXD_KSM=qemu`: a sandbox's QEMU offers its own memory (never guest RAM) to KSM
   * (ram-readonly.c; docs/isolation.md "KSM: guest RAM never, QEMU's own memory by choice").
   */
  ksmQemu: boolean;
}

export const DEFAULT_JAIL: JailSettings = { uidRange: DEFAULT_UID_RANGE, unshare: UNSHARE, ksmQemu: false };

/** qcow2's incompatible feature bit for an external data file (header v3, bytes 72..79). */
const QCOW2_INCOMPAT_DATA_FILE = 1n << 2n;
/** The first four bytes of every qcow2 image ("QFI\xfb"). */
export const QCOW2_MAGIC = 0x514649fb;

/**
 * The backing files of the qcow2 image `path`, nearest first, read from the images' headers
 * (magic, then the backing name's offset and length); relative names resolve against the image's
 * directory, as QEMU resolves them.
 *
 * With `allowed` (what the agent's records say the chain is), a name outside it ends the walk
 * unopened: it is the last entry of `files`, for the caller to refuse. A header names it, and a
 * jail that held the image could have written that: opening it as root (a FIFO blocks, a device
 * acts, a file's atime moves) would already be following it. A header that asks for an external
 * data file (a second path QEMU would open) is refused the same way.
 */
export async function backingChain(
  path: string,
  allowed?: ReadonlySet<string>,
): Promise<{ files: string[]; virtualSize: number; foreign?: string }> {
  const files: string[] = [];
  let cur = path;
  let virtualSize = 0;
  for (let depth = 0; depth < 64; depth++) {
    const fh = await open(cur, "r");
    try {
      const hdr = Buffer.alloc(80);
      await fh.read(hdr, 0, 80, 0);
      if (hdr.readUInt32BE(0) !== QCOW2_MAGIC) break; // not qcow2: a raw image has no backing file
      if (hdr.readUInt32BE(4) >= 3 && (hdr.readBigUInt64BE(72) & QCOW2_INCOMPAT_DATA_FILE) !== 0n)
        return { files, virtualSize, foreign: `${cur} (an external data file)` };
      if (depth === 0) virtualSize = Number(hdr.readBigUInt64BE(24));
      const off = Number(hdr.readBigUInt64BE(8));
      const len = hdr.readUInt32BE(16);
      if (off === 0 || len === 0) break;
      const name = Buffer.alloc(len);
      await fh.read(name, 0, len, off);
      cur = resolve(dirname(cur), name.toString("utf8"));
      files.push(cur);
      if (allowed && !allowed.has(cur)) return { files, virtualSize, foreign: cur };
    } finally {
      await fh.close();
    }
  }
  return { files, virtualSize };
}

function inside(dir: string, p: string): boolean {
  return p.startsWith(`${dir.replace(/\/+$/, "")}/`);
}

/**
 * The VM directory's mode (root's, group the jail's): the group may add names and traverse,
 * others nothing; sticky, so the jail removes or renames only the names its uid made.
 */
export const VM_DIR_MODE = 0o1770;

/**
 * Gives the jail one file the agent named (a disk, a RAM file), through a descriptor opened
 * without following a symlink and without blocking on a FIFO, and only when it is a regular file
 * (a disk may have a second link: a fork's staging link): a path is never chowned or chmodded on
 * a name's word alone.
 */
async function ownFile(path: string, o: { uid?: number; mode?: number; create?: boolean }): Promise<void> {
  const flags =
    constants.O_RDONLY | constants.O_NOFOLLOW | constants.O_NONBLOCK | (o.create ? constants.O_CREAT : 0);
  const fh = await open(path, flags, 0o600);
  try {
    const st = await fh.stat();
    if (!st.isFile()) throw new JailError(`${path} is not a regular file`);
    if (o.uid !== undefined) await fh.chown(o.uid, o.uid);
    if (o.mode !== undefined) await fh.chmod(o.mode);
  } finally {
    await fh.close();
  }
}

/** Makes the jail of one VM ready; throws JailError naming the missing ingredient. */
export async function prepareJail(i: JailInput): Promise<PreparedJail> {
  if (process.getuid?.() !== 0) throw new JailError("the agent is not root (it needs root to build jails)");
  const jail = i.settings ?? DEFAULT_JAIL;
  const unshare = jail.unshare;
  const missing = missingJailTools(unshare);
  if (missing.length) throw new JailError(`missing ${missing.join(", ")} (install util-linux)`);
  if (i.kvm) {
    try {
      accessSync("/dev/kvm", constants.R_OK | constants.W_OK);
    } catch {
      throw new JailError("/dev/kvm is not usable");
    }
  }
  // Independent steps at once (the jail is built on every cold spawn's critical path); all are
  // waited for, so a failure undoes what the others made.
  const settled = await Promise.allSettled([
    allocateUid(i.dir, jail.uidRange),
    i.disk
      ? backingChain(i.disk, i.backing)
      : Promise.resolve({ files: [], virtualSize: 0, foreign: undefined }),
    createVmCgroup(i.dir, vmLimits(i.memMib, i.vcpus, !i.kvm)),
    readdir(i.dir),
    i.mem && !i.mem.share ? ensureRamShim() : Promise.resolve(""),
  ] as const);
  const [uidR] = settled;
  const uid = uidR.status === "fulfilled" ? uidR.value : undefined;
  try {
    const [, chainR, cgR, namesR, shimR] = settled;
    if (uid === undefined) throw (uidR as PromiseRejectedResult).reason;
    if (chainR.status === "rejected") throw chainR.reason;
    if (cgR.status === "rejected") throw cgR.reason;
    if (namesR.status === "rejected") throw namesR.reason;
    if (shimR.status === "rejected") throw shimR.reason;
    const chain = chainR.value;
    if (chain.foreign !== undefined)
      throw new JailError(`${i.disk}'s image headers name ${chain.foreign}, which its records do not`);
    const cg = cgR.value;
    // The directory stays root's; the jail's group may add names to it (QEMU makes its sockets
    // and pid file there) and, the sticky bit, remove or rename only what its uid made: the
    // agent's files there (console log, jail root, fstab, an overlay) stay the agent's. Nothing
    // else in it is chowned: what an earlier QEMU left is named by a listing its jail could
    // shape. A file with more than one link is a fork's staging link to what is now a frozen
    // backing file (agent/snapshot/fork.ts): it goes (rm removes the name, never follows it).
    const stale = namesR.value
      .filter((name) => !["root", "jail.fstab"].includes(name))
      .map(async (name) => {
        const p = join(i.dir, name);
        // A name that went between the listing and here (a socket its QEMU removed) is no error.
        const st = await ifExists(lstat(p));
        if (st?.isFile() && st.nlink > 1 && p !== i.disk) await rm(p, { force: true });
      });
    const mem = async () => {
      if (!i.mem) return;
      // QEMU would create a shared one, but only paths that exist can be bound into the jail.
      if (i.mem.share) return ownFile(i.mem.path, { create: true, uid });
      // A RAM file others start from (a template's, a fork point's) is root's and read-only to
      // every jail: the child's QEMU opens it read-only (the preloaded shim, ram-readonly.c: QEMU
      // 7.2 would open it read-write) and maps it privately, and the bind is read-only too, so a
      // QEMU a guest escaped into cannot write what later children of any tenant start from.
      await ownFile(i.mem.path, { uid: 0, mode: SHARED_RAM_FILE_MODE });
    };
    const memBytes = i.memMib * 1024 * 1024;
    const sharedMem =
      i.mem && !i.mem.share
        ? { path: i.mem.path, shim: shimR.value, ...(jail.ksmQemu ? { ksmGuardBytes: memBytes } : {}) }
        : undefined;
    const readWrite = [i.disk, i.mem?.share ? i.mem.path : undefined].filter(
      (p): p is string => p !== undefined && !inside(i.dir, p),
    );
    const shared = sharedMem ? [sharedMem.path] : [];
    const readOnly = [i.vmlinux, i.initramfs, ...shared, ...chain.files].filter((p) => !inside(i.dir, p));
    const spec: JailSpec = {
      dir: i.dir,
      uid,
      gid: uid,
      readOnly: [...new Set(readOnly)],
      readWrite: [...new Set(readWrite)],
      kvm: i.kvm,
      ...(sharedMem ? { readOnlyRam: sharedMem } : {}),
      cgroupProcs: cg.procs,
      maxFileBytes: Math.max(chain.virtualSize, memBytes) + FILE_SIZE_MARGIN,
      maxOpenFiles: JAIL_MAX_OPEN_FILES,
      pidFile: i.hostPidFile,
      unshare,
    };
    await Promise.all([
      chown(i.dir, 0, uid).then(() => chmod(i.dir, VM_DIR_MODE)),
      ...stale,
      i.disk ? ownFile(i.disk, { uid }) : undefined,
      mem(),
      // The shared RAM file's mode is mem()'s to set (a second chmod would race it).
      ...spec.readOnly.filter((p) => p !== sharedMem?.path).map(readableByJail),
      makeSkeleton(spec),
    ]);
    return { spec, uid };
  } catch (err) {
    await releaseJail(i.dir, uid);
    if (err instanceof JailError) throw err;
    throw new JailError((err as Error).message, err);
  }
}

/**
 * Lays out the jail's root on disk under `<vm dir>/root` and writes its fstab. No QEMU of this VM
 * runs now (a VM's earlier QEMU is gone before its next starts), but one could have left symlinks
 * in the directory it owned: what was there is removed first (rm never follows a link), and
 * every entry is made new ("wx" and mkdir fail on an existing name rather than follow it).
 */
async function makeSkeleton(spec: JailSpec): Promise<void> {
  const r = jailRoot(spec.dir);
  const fstab = jailFstabPath(spec.dir);
  await Promise.all([r, fstab, spec.pidFile].map((p) => rm(p, { recursive: true, force: true })));
  const sk = jailSkeleton(spec);
  await mkdir(r, { mode: 0o755 });
  for (const d of sk.dirs) await mkdir(r + d, { recursive: true, mode: 0o755 });
  // QEMU, as its own uid, walks these directories (its root, /dev, the path to its VM directory)
  // after the pivot. mkdir's mode passes through the umask, and the serving commands run under
  // 077 (cli/data-dir.ts), which would leave them root's alone: set 0755 as such.
  await Promise.all([...skeletonDirs(sk.dirs)].map((d) => chmod(r + d, 0o755)));
  await Promise.all([
    ...sk.files.map((f) => writeFile(r + f, "", { flag: "wx", mode: 0o644 })),
    ...sk.links.map(([name, target]) => symlink(target, r + name)),
    // Read by QEMU's uid (its loader reads /etc/ld.so.preload and skips it silently if it
    // cannot), so 0644 as such: the umask would leave them root's alone.
    ...sk.contents.map(([f, text]) =>
      writeFile(r + f, text, { flag: "wx", mode: 0o644 }).then(() => chmod(r + f, 0o644)),
    ),
    writeFile(fstab, `${jailFstab(spec).join("\n")}\n`, { flag: "wx", mode: 0o644 }),
  ]);
  if (spec.kvm) await makeKvmNode(r, spec.uid);
}

/** The host's KVM device, whose device number a KVM jail's own node copies. */
const HOST_KVM = "/dev/kvm";
/** A mknod takes milliseconds: the bound only absorbs a badly overloaded host. */
const MKNOD_TIMEOUT_MS = 10_000;

/**
 * A KVM jail's own /dev/kvm: a character node with the host node's device number (read from it,
 * not assumed), owned by the VM's uid, mode 0600, in the jail's root on disk (jail.ts binds it
 * onto itself, the one mount of the jail that allows devices). The jailed QEMU runs with no
 * supplementary groups, so the host node's owner, group and mode (0600 root, 0660 root:kvm,
 * 0666) never decide its access, and no other uid can open this node. It goes with the jail's
 * root: the next makeSkeleton, releaseJail, the VM directory's removal.
 */
async function makeKvmNode(root: string, uid: number): Promise<void> {
  const node = root + JAIL_KVM_NODE;
  const st = await stat(HOST_KVM, { bigint: true });
  if (!st.isCharacterDevice()) throw new JailError(`${HOST_KVM} is not a character device`);
  // glibc's dev_t layout (major(3), minor(3)): 12 + 20 bits of major, 8 + 24 bits of minor.
  const major = ((st.rdev >> 8n) & 0xfffn) | ((st.rdev >> 32n) & 0xfffff000n);
  const minor = (st.rdev & 0xffn) | ((st.rdev >> 12n) & 0xffffff00n);
  try {
    await runTool([MKNOD, "-m", "0600", node, "c", `${major}`, `${minor}`], {
      timeoutMs: MKNOD_TIMEOUT_MS,
      captureStdout: false,
    });
  } catch (err) {
    throw new JailError(`cannot make the jail's ${JAIL_KVM_NODE} (${major}:${minor})`, err);
  }
  await chown(node, uid, uid);
}

/** Every directory of the skeleton with each of its ancestors, the root itself as "". */
function skeletonDirs(dirs: readonly string[]): Set<string> {
  const out = new Set<string>([""]);
  for (const d of dirs) {
    const parts = d.split("/").filter(Boolean);
    for (let i = 1; i <= parts.length; i++) out.add(`/${parts.slice(0, i).join("/")}`);
  }
  return out;
}

/**
 * A file bound read-only into the jail (kernel, initramfs, a backing file of the disk) must be
 * readable by the VM's uid. Backing files are shared by every VM of a template, each with its own
 * uid, so they cannot be chowned to one: they are made readable by other. Under the serving
 * commands' umask 077 the agent creates them 0600; the data directory above them is 0700
 * (cli/data-dir.ts), so on the host they stay out of any other user's reach, and inside a jail
 * only the files bound into it exist.
 */
async function readableByJail(path: string): Promise<void> {
  // A missing file is left to the jail's mount, whose failure QEMU's start reports.
  const st = await ifExists(stat(path));
  if (st && (st.mode & 0o004) === 0) await chmod(path, (st.mode & 0o7777) | 0o004);
}

/** Frees what a VM's jail held on the host (its QEMU must be gone): its kvm node, cgroup and uid. */
export async function releaseJail(dir: string, uid: number | undefined): Promise<void> {
  // A KVM jail's device node (makeKvmNode) outlives no QEMU, even while the directory stays.
  await rm(jailRoot(dir) + JAIL_KVM_NODE, { force: true });
  await removeVmCgroup(dir);
  if (uid !== undefined) await releaseUid(uid, dir);
}
