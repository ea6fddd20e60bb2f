/**
 * Template and fork RAM files live on tmpfs (`/dev/shm/sandboxd/<hash of the data dir>`), outside
 * the data directory they belong to. Removing a data directory (an operator's `rm -rf`, a test's
 * teardown) would leave hundreds of MiB of RAM files behind with nothing pointing at them. So each
 * shm root names its data directory in `.owner`, and any agent start sweeps the roots whose data
 * directory no longer exists.
 */
import { existsSync } from "node:fs";
import { mkdir, readdir, readFile, rm, writeFile } from "node:fs/promises";
import { join, resolve } from "node:path";

export const SHM_BASE = "/dev/shm/sandboxd";
/** The file in a shm root naming its data directory (kept by every sweep of the root). */
export const OWNER_FILE = ".owner";

/** Creates `shmRoot` (if needed) and records `dataDir` as its owner. */
export async function claimShmRoot(shmRoot: string, dataDir: string): Promise<void> {
  await mkdir(shmRoot, { recursive: true, mode: 0o700 });
  const owner = resolve(dataDir);
  const path = join(shmRoot, OWNER_FILE);
  const current = await readFile(path, "utf8").catch(() => undefined);
  if (current !== owner) await writeFile(path, owner, { mode: 0o600 });
}

/**
 * Removes the shm roots under `base` whose recorded data directory is gone. Roots without an
 * owner record are left alone: they may belong to a process that has not claimed its root yet.
 * Returns the roots removed.
 */
export async function sweepOrphanShmRoots(base: string = SHM_BASE): Promise<string[]> {
  const names = await readdir(base).catch(() => [] as string[]);
  const removed: string[] = [];
  for (const name of names) {
    const root = join(base, name);
    const owner = await readFile(join(root, OWNER_FILE), "utf8").catch(() => undefined);
    if (owner === undefined || owner === "" || existsSync(owner)) continue;
    await rm(root, { recursive: true, force: true });
    removed.push(root);
  }
  return removed;
}
