/**
 * The data directory of a serving command (`up`, `agent`, `gateway`) is the agent's and the
 * gateway's alone: it holds the database, the keys, every image, template and VM disk. Each
 * serving command calls `lockDownDataDir` first: from then on what the process creates is
 * readable by root only (umask 077), and the data directory is 0700, so nothing under it, even a
 * file an earlier version left 0644, is reachable by another user of the host. The jailed QEMUs
 * reach their files through bind mounts and the ownership the jail gives them
 * (agent/qemu/jail-setup.ts), never through the host's directory modes.
 */
import { chmod, mkdir, stat } from "node:fs/promises";

/** Only the owner (root) may list, enter or write the data directory. */
export const DATA_DIR_MODE = 0o700;
/** Files and directories this process creates get no group or other bits. */
export const SERVING_UMASK = 0o077;

/**
 * Sets the process's umask to 077 and makes `dataDir` 0700: created so, or tightened (and said
 * in the log) when an earlier run left it looser.
 */
export async function lockDownDataDir(dataDir: string, log: (m: string) => void): Promise<void> {
  process.umask(SERVING_UMASK);
  await mkdir(dataDir, { recursive: true, mode: DATA_DIR_MODE });
  const mode = (await stat(dataDir)).mode & 0o7777;
  if (mode !== DATA_DIR_MODE) {
    await chmod(dataDir, DATA_DIR_MODE);
    log(`data dir ${dataDir} was mode ${mode.toString(8)}: tightened to ${DATA_DIR_MODE.toString(8)}`);
  }
}
