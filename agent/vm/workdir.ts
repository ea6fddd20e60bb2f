import { mkdir, readdir, readFile, rm, writeFile } from "node:fs/promises";
import { join } from "node:path";

/**
 * Every VM owns exactly one directory under `<dataDir>/vms/<id>`: its QMP and agent sockets,
 * console log, pid file and disk overlay all live there, so removing the directory after killing
 * the process frees everything the VM held. `owner.json` names the process that owns the VM, so
 * that a later start can find directories whose owner died (a crash, a kill -9) and reclaim them.
 */
export interface VmOwner {
  ownerPid: number;
  qemuPid?: number;
  createdAt: string;
}

export function vmsRoot(dataDir: string): string {
  return join(dataDir, "vms");
}

export async function createVmDir(dataDir: string, id: string): Promise<string> {
  const dir = join(vmsRoot(dataDir), id);
  await mkdir(dir, { recursive: true, mode: 0o700 });
  await writeOwner(dir, { ownerPid: process.pid, createdAt: new Date().toISOString() });
  return dir;
}

export async function writeOwner(dir: string, owner: VmOwner): Promise<void> {
  await writeFile(join(dir, "owner.json"), JSON.stringify(owner));
}

export function pidAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === "EPERM";
  }
}

/** True when `pid` is a QEMU started for `dir` (guards against a recycled pid). */
async function isQemuFor(pid: number, dir: string): Promise<boolean> {
  try {
    const cmdline = await readFile(`/proc/${pid}/cmdline`, "utf8");
    return cmdline.includes("qemu-system") && cmdline.includes(dir);
  } catch {
    return false;
  }
}

/**
 * Reclaims VM directories whose owner process is gone: kills their QEMU (if it still runs and
 * really is theirs) and removes the directory. Returns the ids reclaimed. `keepOwners` lists owner
 * pids that are alive and adopt their VMs themselves (the agent's restart path).
 */
export async function reapOrphanVms(dataDir: string): Promise<string[]> {
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
    let owner: VmOwner | undefined;
    try {
      owner = JSON.parse(await readFile(join(dir, "owner.json"), "utf8")) as VmOwner;
    } catch {
      owner = undefined;
    }
    if (owner && owner.ownerPid !== process.pid && pidAlive(owner.ownerPid)) continue;
    if (owner && owner.ownerPid === process.pid) continue;
    const qemuPid = owner?.qemuPid ?? (await readPidFile(join(dir, "qemu.pid")));
    if (qemuPid && (await isQemuFor(qemuPid, dir))) {
      try {
        process.kill(qemuPid, "SIGKILL");
      } catch {
        // already gone
      }
    }
    await rm(dir, { recursive: true, force: true });
    reaped.push(id);
  }
  return reaped;
}

async function readPidFile(path: string): Promise<number | undefined> {
  try {
    const n = Number.parseInt((await readFile(path, "utf8")).trim(), 10);
    return Number.isFinite(n) && n > 0 ? n : undefined;
  } catch {
    return undefined;
  }
}
