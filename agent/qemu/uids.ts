/**
 * Per-VM uids: each jailed QEMU runs as its own uid/gid (gid = uid) from a range no real user
 * holds, so two VMs never share an identity (one QEMU cannot signal, ptrace or open the files of
 * another). The range is the operator's `SANDBOXD_JAIL_UID_BASE` (default 900000) and
 * `SANDBOXD_JAIL_UID_COUNT` (default 65536), passed in (jail-setup.ts `JailSettings`).
 *
 * A uid is taken by creating `/run/sandboxd/jail-uids/<uid>` exclusively (O_EXCL), naming the VM
 * directory: that holds across every agent process on the host (tests, `bench` and `run` beside
 * an agent). The VM's owner record (agent/vm/process.ts) records the uid, and the lock is removed
 * when the VM ends. A lock whose uid no process runs as, older than a minute (a launch takes
 * seconds), is stale: a crashed agent's, and taken over.
 */
import { readdirSync, readFileSync } from "node:fs";
import { mkdir, open, readdir, readFile, rm, stat } from "node:fs/promises";
import { join } from "node:path";
import { JailError } from "./jail.ts";

export const UID_LOCK_DIR = "/run/sandboxd/jail-uids";
const STALE_LOCK_MS = 60_000;

export interface UidRange {
  base: number;
  count: number;
}

/**
 * Far from any distribution's own users (which stay below 65536) and from the subuid ranges
 * `useradd` hands out (100000 onward, 65536 each for the first few users): 900000 is unlikely to
 * be anyone's; 65536 uids is more VMs than one host runs.
 */
export const DEFAULT_UID_RANGE: UidRange = { base: 900_000, count: 65_536 };

/** The uids of running processes inside `range` (from /proc/<pid>/status). */
export function uidsInUse(range: UidRange): Set<number> {
  const used = new Set<number>();
  let names: string[] = [];
  try {
    names = readdirSync("/proc");
  } catch {
    return used;
  }
  for (const n of names) {
    if (!/^\d+$/.test(n)) continue;
    try {
      const m = /^Uid:\s+(\d+)/m.exec(readFileSync(`/proc/${n}/status`, "utf8"));
      const uid = m ? Number(m[1]) : -1;
      if (uid >= range.base && uid < range.base + range.count) used.add(uid);
    } catch {
      // gone
    }
  }
  return used;
}

/** True when /etc/passwd or /etc/group names an id inside `range` (the range must be free). */
export function rangeClashes(range: UidRange): string[] {
  const out: string[] = [];
  for (const f of ["/etc/passwd", "/etc/group"]) {
    let text = "";
    try {
      text = readFileSync(f, "utf8");
    } catch {
      continue;
    }
    for (const line of text.split("\n")) {
      const [name, , id] = line.split(":");
      const n = Number(id);
      if (name && Number.isInteger(n) && n >= range.base && n < range.base + range.count)
        out.push(`${f}: ${name} (${n})`);
    }
  }
  return out;
}

/**
 * The files that hand users ranges of subordinate ids for their user namespaces (shadow-utils'
 * format, `name:start:count` a line). A jail uid inside such a range is one a user can map to in
 * a namespace of their own, and so own files as or signal: the ranges must not meet.
 */
export const SUBID_FILES = ["/etc/subuid", "/etc/subgid"] as const;

/** The lines of `files` whose range overlaps `range`, each as `file: name start+count`. */
export function subidOverlaps(range: UidRange, files: readonly string[] = SUBID_FILES): string[] {
  const out: string[] = [];
  for (const f of files) {
    let text = "";
    try {
      text = readFileSync(f, "utf8");
    } catch {
      continue; // no such file: nobody has subordinate ids
    }
    for (const line of text.split("\n")) {
      const [name, start, count] = line.trim().split(":");
      const lo = Number(start);
      const n = Number(count);
      if (!name || name.startsWith("#") || !Number.isInteger(lo) || !Number.isInteger(n) || n <= 0) continue;
      if (lo < range.base + range.count && range.base < lo + n) out.push(`${f}: ${name} ${lo}+${n}`);
    }
  }
  return out;
}

/**
 * Refuses, at the agent's start, a jail uid range that a real user or group holds (/etc/passwd,
 * /etc/group) or that overlaps a user's subordinate ids (`subidFiles`): a JailError naming each
 * overlap (the first few).
 */
export function refuseTakenUidRange(range: UidRange, subidFiles: readonly string[] = SUBID_FILES): void {
  const taken = [...rangeClashes(range), ...subidOverlaps(range, subidFiles)];
  if (taken.length === 0) return;
  // Enough to find the lines; a file of thousands of users would drown the message.
  const shown = taken.slice(0, 5).join("; ");
  const more = taken.length > 5 ? ` and ${taken.length - 5} more` : "";
  throw new JailError(
    `the jail uid range ${range.base}+${range.count} overlaps ${shown}${more}: set SANDBOXD_JAIL_UID_BASE / SANDBOXD_JAIL_UID_COUNT to a range no user holds`,
  );
}

/** Takes a free uid for the VM directory `dir`; throws JailError when none is left. */
export async function allocateUid(dir: string, range: UidRange): Promise<number> {
  if (range.count <= 0) throw new JailError("the jail uid range is empty (SANDBOXD_JAIL_UID_COUNT=0)");
  if (range.base <= 0)
    throw new JailError("the jail uid range must not include root (SANDBOXD_JAIL_UID_BASE)");
  await mkdir(UID_LOCK_DIR, { recursive: true, mode: 0o700 });
  // A random start: the lock directory rarely holds a collision to step over. Scanning /proc for
  // running uids is left to stale locks, off a spawn's critical path.
  const start = Math.floor(Math.random() * range.count);
  for (let i = 0; i < range.count; i++) {
    const uid = range.base + ((start + i) % range.count);
    if (await tryLock(uid, dir)) return uid;
    if (await staleLock(uid)) {
      await rm(lockPath(uid), { force: true });
      if (await tryLock(uid, dir)) return uid;
    }
  }
  throw new JailError(`no free uid left in ${range.base}..${range.base + range.count - 1}`);
}

function lockPath(uid: number): string {
  return join(UID_LOCK_DIR, String(uid));
}

async function tryLock(uid: number, dir: string): Promise<boolean> {
  try {
    const fh = await open(lockPath(uid), "wx", 0o600);
    await fh.writeFile(dir);
    await fh.close();
    return true;
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code === "EEXIST") return false;
    throw new JailError(`cannot take a uid lock in ${UID_LOCK_DIR}: ${(err as Error).message}`, err);
  }
}

async function staleLock(uid: number): Promise<boolean> {
  try {
    if (Date.now() - (await stat(lockPath(uid))).mtimeMs < STALE_LOCK_MS) return false;
  } catch {
    return false;
  }
  return !uidsInUse({ base: uid, count: 1 }).has(uid);
}

/** Frees `uid` (its QEMU must be gone) if the VM directory `dir` still holds it. */
export async function releaseUid(uid: number, dir: string): Promise<void> {
  try {
    if ((await readFile(lockPath(uid), "utf8")) !== dir) return;
  } catch {
    return;
  }
  await rm(lockPath(uid), { force: true });
}

/** Removes the stale locks (a crashed agent's); returns the uids freed. */
export async function sweepUidLocks(range: UidRange): Promise<number[]> {
  let names: string[];
  try {
    names = await readdir(UID_LOCK_DIR);
  } catch {
    return [];
  }
  const freed: number[] = [];
  for (const n of names) {
    const uid = Number(n);
    if (!Number.isInteger(uid) || uid < range.base || uid >= range.base + range.count) continue;
    if (await staleLock(uid)) {
      await rm(lockPath(uid), { force: true });
      freed.push(uid);
    }
  }
  return freed;
}
