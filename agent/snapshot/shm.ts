/**
 * Template and fork RAM files live on tmpfs (`/dev/shm/sandboxd/<hash of the data dir>`), outside
 * the data directory they belong to. Removing a data directory (an operator's `rm -rf`, a test's
 * teardown) would leave hundreds of MiB of RAM files behind with nothing pointing at them. So each
 * shm root is claimed by a file BESIDE it, `<root>.owner`, naming its data directory, and any agent
 * start sweeps the roots whose data directory no longer exists.
 *
 * The claim is kept outside the root on purpose: the root itself holds only RAM files, so the
 * chain store's "a directory goes with its last file" and the driver's sweep of unregistered files
 * need to know nothing about it.
 */
import { existsSync } from "node:fs";
import { lstat, mkdir, readdir, readFile, rm, writeFile } from "node:fs/promises";
import { dirname, join, resolve } from "node:path";
import { ifExists } from "../../contracts/best-effort.ts";
import { SandboxdError } from "../../contracts/errors.ts";

export const SHM_BASE = "/dev/shm/sandboxd";
const OWNER_SUFFIX = ".owner";

/** The claim file of `shmRoot`. */
export function ownerFileOf(shmRoot: string): string {
  return `${shmRoot}${OWNER_SUFFIX}`;
}

/**
 * Refuses a RAM-file directory someone else could have made or could change: `/dev/shm` is
 * writable by every user, so `/dev/shm/sandboxd` may have been made by anyone before the agent
 * first ran. One that is not a directory of ours (a symlink, another uid's) or that group or other
 * may write lets that user swap the RAM files QEMU maps, or plant claims the sweep acts on.
 */
export async function checkShmDir(path: string, uid: number = process.getuid?.() ?? 0): Promise<void> {
  const st = await lstat(path);
  const why = !st.isDirectory()
    ? "is not a directory"
    : st.uid !== uid
      ? `is owned by uid ${st.uid}, not ${uid}`
      : (st.mode & 0o022) !== 0
        ? `is writable by group or other (mode ${(st.mode & 0o7777).toString(8)})`
        : undefined;
  if (why)
    throw new SandboxdError(
      "storage_error",
      `refusing the RAM-file directory ${path}: it ${why}; remove it (the agent makes it anew, mode 700)`,
    );
}

/**
 * Creates `shmRoot` and its parent (if needed, mode 0700), checks both are the agent's alone
 * (checkShmDir), and records `dataDir` as the root's owner.
 */
export async function claimShmRoot(shmRoot: string, dataDir: string): Promise<void> {
  const base = dirname(shmRoot);
  await mkdir(base, { recursive: true, mode: 0o700 });
  await checkShmDir(base);
  await mkdir(shmRoot, { recursive: true, mode: 0o700 });
  await checkShmDir(shmRoot);
  const owner = resolve(dataDir);
  const path = ownerFileOf(shmRoot);
  const current = await ifExists(readFile(path, "utf8"));
  if (current !== owner) await writeFile(path, owner, { mode: 0o600 });
}

/**
 * Removes the shm roots under `base` (and their claims) whose recorded data directory is gone.
 * Roots without a claim are left alone: they may belong to a process that has not claimed its
 * root yet. Returns the roots removed.
 */
export async function sweepOrphanShmRoots(base: string = SHM_BASE): Promise<string[]> {
  const names = await readdir(base).catch(() => [] as string[]);
  const removed: string[] = [];
  for (const name of names) {
    if (!name.endsWith(OWNER_SUFFIX)) continue;
    const claim = join(base, name);
    const owner = await ifExists(readFile(claim, "utf8"));
    if (owner === undefined || owner === "" || existsSync(owner)) continue;
    const root = claim.slice(0, -OWNER_SUFFIX.length);
    await rm(root, { recursive: true, force: true });
    await rm(claim, { force: true });
    removed.push(root);
  }
  return removed;
}
