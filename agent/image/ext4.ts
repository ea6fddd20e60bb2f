/**
 * The base disk: an unpacked rootfs directory becomes an ext4 filesystem (mkfs.ext4 -d, sized
 * for the tree plus the room the guest gets to write) in a qcow2 file, which VMs use under
 * copy-on-write overlays.
 */
import { lstat, open, readdir, rm } from "node:fs/promises";
import { join } from "node:path";
import { stopIfCancelled } from "./limits.ts";
import { runImageTool } from "./tools.ts";

/**
 * Base disk size = max(minBytes, factor * rootfsBytes + headroomBytes), rounded up to 1 MiB.
 * The guest writes into its copy-on-write overlay of this disk and has no other writable disk,
 * so the free space here is all it gets: a floor of 256 MiB for tiny images, 1.5x for ext4's own
 * metadata (inode tables, bitmaps, journal: a few %) plus room for packages and caches in big ones,
 * and 128 MiB on top for the journal and small images. Free space is sparse in the qcow2 and
 * costs the host nothing until written.
 */
export interface DiskSizing {
  minBytes: number;
  factor: number;
  headroomBytes: number;
}

export const DEFAULT_DISK_SIZING: DiskSizing = {
  minBytes: 256 * 1024 ** 2,
  factor: 1.5,
  headroomBytes: 128 * 1024 ** 2,
};

export function diskSizeFor(rootfsBytes: number, sizing: DiskSizing = DEFAULT_DISK_SIZING): number {
  const want = Math.max(sizing.minBytes, Math.ceil(sizing.factor * rootfsBytes) + sizing.headroomBytes);
  return Math.ceil(want / MIB) * MIB;
}

const MIB = 1024 * 1024;

/** Data bytes (4 KiB blocks) and inodes of a tree, hardlinks counted once. */
async function measureTree(root: string, signal?: AbortSignal): Promise<{ bytes: number; inodes: number }> {
  const BLK = 4096;
  const seen = new Set<number>();
  let bytes = 0;
  let inodes = 0;
  const stack = [root];
  while (stack.length > 0) {
    const dir = stack.pop() as string;
    stopIfCancelled(signal);
    const st = await lstat(dir);
    inodes++;
    bytes += Math.max(BLK, Math.ceil(st.size / BLK) * BLK);
    for (const ent of await readdir(dir, { withFileTypes: true })) {
      const p = join(dir, ent.name);
      if (ent.isDirectory()) {
        stack.push(p);
        continue;
      }
      const s = await lstat(p);
      if (s.nlink > 1) {
        if (seen.has(s.ino)) continue;
        seen.add(s.ino);
      }
      inodes++;
      // Symlinks under 60 bytes live in the inode itself; longer ones take a block.
      if (s.isSymbolicLink()) bytes += s.size >= 60 ? BLK : 0;
      else if (s.isFile()) bytes += Math.ceil(s.size / BLK) * BLK;
    }
  }
  return { bytes, inodes };
}

/** mke2fs's default bytes-per-inode for filesystems of this size (mke2fs.conf, "default"). */
const BYTES_PER_INODE = 16384;

/**
 * Builds the ext4 filesystem of `rootfs` in `<work>/rootfs.raw` and converts it to the qcow2
 * `dest`; the rootfs directory and the raw file are removed on the way. Returns the measured
 * size of the tree and the size of the disk.
 */
export async function makeBaseDisk(
  work: string,
  rootfs: string,
  dest: string,
  sizing: DiskSizing,
  log: (m: string) => void,
  signal?: AbortSignal,
): Promise<{ bytes: number; size: number }> {
  const { bytes, inodes } = await measureTree(rootfs, signal);
  const size = diskSizeFor(bytes, sizing);
  // Twice the inodes in use plus a margin, so the guest can create files as well as bytes; never
  // fewer than mke2fs would pick by itself.
  const inodeCount = Math.max(Math.ceil(size / BYTES_PER_INODE), inodes * 2 + 4096);
  const raw = join(work, "rootfs.raw");
  const fh = await open(raw, "w");
  await fh.truncate(size);
  await fh.close();
  await runImageTool(
    [
      "mkfs.ext4",
      "-F",
      "-q",
      "-b",
      "4096",
      "-I",
      "256",
      "-N",
      String(inodeCount),
      // No blocks reserved for root: the guest's workload often is root, and the space is its.
      "-m",
      "0",
      // Zero inode tables and journal now (zeros cost nothing in qcow2) rather than have every
      // guest's lazy-init thread write them into its own overlay.
      "-E",
      "lazy_itable_init=0,lazy_journal_init=0",
      "-L",
      "sandboxd-root",
      "-d",
      rootfs,
      raw,
    ],
    { log, signal },
  );
  await rm(rootfs, { recursive: true, force: true });
  await runImageTool(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, dest], { log, signal });
  await rm(raw, { force: true });
  return { bytes, size };
}
