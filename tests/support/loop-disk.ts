/**
 * A small ext4 filesystem on a loop device, for tests that fill the agent's data disk. Test code
 * only; needs root and a free loop device.
 */
import { execFileSync } from "node:child_process";
import { mkdir, mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";

/** Whether this process may loop-mount (root, and `losetup -f` finds a free device). */
export function canLoopMount(): boolean {
  if (process.getuid?.() !== 0) return false;
  try {
    execFileSync("losetup", ["-f"], { stdio: "ignore" });
    return true;
  } catch {
    return false;
  }
}

export interface LoopDisk {
  /** The temp dir holding the image and the mount point. */
  root: string;
  /** Where the filesystem is mounted. */
  mnt: string;
  /** Unmounts (lazily: a straggler's open file does not keep it) and removes `root`. */
  remove(): Promise<void>;
}

/** A fresh `mib`-MiB ext4 image under a temp dir named `prefix`, mounted at `<root>/d`. */
export async function mountLoopDisk(prefix: string, mib: number): Promise<LoopDisk> {
  const root = await mkdtemp(join(tmpdir(), prefix));
  const mnt = join(root, "d");
  await mkdir(mnt);
  const img = join(root, "disk.img");
  execFileSync("truncate", ["-s", `${mib}M`, img]);
  execFileSync("mkfs.ext4", ["-q", img]);
  execFileSync("mount", ["-o", "loop", img, mnt]);
  return {
    root,
    mnt,
    remove: async () => {
      execFileSync("umount", ["-l", mnt]);
      await rm(root, { recursive: true, force: true });
    },
  };
}
