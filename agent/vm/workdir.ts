import { existsSync } from "node:fs";
import { mkdir, readdir, rm } from "node:fs/promises";
import { dirname, join } from "node:path";
import { sweepCgroups } from "../qemu/cgroup.ts";
import { DEFAULT_UID_RANGE, sweepUidLocks, type UidRange } from "../qemu/uids.ts";
import {
  claimVm,
  killQemusNaming,
  killRecordedQemu,
  ownedByAnotherLiveAgent,
  readOwner,
  type VmOwner,
} from "./process.ts";
import { removeVmRecords, vmRecordsDir } from "./records-dir.ts";

/**
 * Every VM owns exactly one directory under `<dataDir>/vms/<id>`: its QMP and agent sockets,
 * console log, pid file and (for cold-booted VMs) disk overlay all live there, so removing the
 * directory after killing the process frees everything the VM held. `owner.json` (process.ts)
 * names the agent process that owns the VM, so that a later start can find directories whose
 * owner died (a crash, a kill -9) and reclaim them.
 */
export function vmsRoot(dataDir: string): string {
  return join(dataDir, "vms");
}

/**
 * Removes a VM directory and everything in it (its jail's root is a deep tree of mount points),
 * and its records (records-dir.ts),
 * trying again while entries are still there: two removals racing (a failed VM's own cleanup and
 * a destroy) each stop at the first entry the other took.
 */
export async function removeVmDir(dir: string): Promise<void> {
  await removeVmRecords(dir);
  for (let i = 0; i < 5; i++) {
    try {
      await rm(dir, { recursive: true, force: true });
    } catch {
      // another removal took an entry first: go round again
    }
    if (!existsSync(dir)) return;
  }
}

export async function createVmDir(dataDir: string, id: string): Promise<string> {
  const dir = join(vmsRoot(dataDir), id);
  // Root's until its jail is built (agent/qemu/jail-setup.ts gives the jail's group what QEMU
  // must write there, never the directory itself).
  await mkdir(dir, { recursive: true, mode: 0o700 });
  await claimVm(dir);
  return dir;
}

/**
 * Reclaims the VM directories under `<dataDir>/vms` that `keep` does not claim: kills their QEMU
 * (if it still runs and really is theirs), waits for it, and removes the directory. Directories
 * whose owner is another agent process still alive are never touched. Returns the ids reclaimed.
 */
export async function reapVmDirs(
  dataDir: string,
  keep: (id: string, owner: VmOwner | undefined) => boolean,
  uidRange: UidRange = DEFAULT_UID_RANGE,
): Promise<string[]> {
  const root = vmsRoot(dataDir);
  let ids: string[];
  try {
    ids = await readdir(root);
  } catch {
    return [];
  }
  const reaped: string[] = [];
  for (const id of ids) {
    const dir = join(root, id);
    const owner = await readOwner(dir);
    if (keep(id, owner) || ownedByAnotherLiveAgent(owner)) continue;
    await killRecordedQemu(dir);
    // And any QEMU of the directory no record names (a rollback's standby launched as its agent
    // went): nothing of a reaped directory may run on.
    await killQemusNaming([dir]);
    await removeVmDir(dir);
    reaped.push(id);
  }
  // Records whose VM directory is gone (a removal that crashed between the two).
  const recordsOf = dirname(vmRecordsDir(join(root, "x")));
  for (const id of await readdir(recordsOf).catch(() => [] as string[])) {
    if (!existsSync(join(root, id))) await removeVmRecords(join(root, id));
  }
  // What jails of crashed agents left on the host (their cgroups and uid locks), once no process
  // is in them: killRecordedQemu above frees those of the directories it reaped.
  await sweepCgroups();
  await sweepUidLocks(uidRange);
  return reaped;
}

/**
 * For one-shot users (`sandboxd run`): reclaims the VM directories whose owner process is gone,
 * keeping this process's own.
 */
export function reapOrphanVms(dataDir: string, uidRange?: UidRange): Promise<string[]> {
  return reapVmDirs(dataDir, (_id, owner) => owner?.ownerPid === process.pid, uidRange);
}
