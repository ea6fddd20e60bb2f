/**
 * QEMU process ownership: the one place that decides whether a pid is the QEMU of a VM directory,
 * reads which pid that is, kills it and waits until it is gone, and takes over a QEMU that an
 * earlier agent process started.
 *
 * A pid alone is not an identity: `owner.json` and `qemu.pid` outlive their QEMU (a crash, a kill
 * -9 of the agent, a host reboot) and the kernel hands pids out again. So nothing here signals a
 * pid before `/proc/<pid>/cmdline` shows a `qemu-system-*` program with an argument naming a path
 * inside the VM's directory (`isQemuFor`).
 *
 * Kills are SIGKILL, never SIGTERM first: a sandbox's QEMU holds nothing worth a clean shutdown
 * (its overlay and sockets go with its directory; a suspend has saved its state through QMP
 * before), and a QEMU that is wedged would ignore the polite signal anyway.
 *
 * Imports: the launch's file names and `VmProcess` shape (agent/qemu/launch.ts) and the QMP
 * client; nothing from the sandbox layer.
 */

import { readFileSync } from "node:fs";
import { readdir, readFile } from "node:fs/promises";
import { basename } from "node:path";
import { z } from "zod";
import { SandboxdError } from "../../contracts/errors.ts";
import { releaseJail } from "../qemu/jail-setup.ts";
import { type VmExit, type VmProcess, vmPaths, vmProcess } from "../qemu/launch.ts";
import { QmpClient } from "../qemu/qmp/client.ts";
import { readVmRecordFile, writeVmRecordFile } from "./records-dir.ts";
import { type LaunchSlot, launchDir, NEXT_SLOT } from "./slots.ts";

/** How long a SIGKILLed QEMU may take to disappear: it exits within milliseconds. */
const KILL_WAIT_MS = 5_000;
/** QMP connect budget when adopting: a live QEMU greets in ~30 ms; 5 s means it is wedged. */
const ADOPT_QMP_TIMEOUT_MS = 5_000;
/**
 * After an adopted QEMU's QMP socket closed: how long its pid may still show before the hang-up
 * counts as ours rather than its death (a SIGKILLed QEMU is gone within milliseconds of it).
 */
const ADOPTED_EXIT_WAIT_MS = 2_000;
const POLL_MS = 10;

// ---- owner.json --------------------------------------------------------------------------------

/**
 * `owner.json` among the VM's records (records-dir.ts, out of its jail's reach): the agent process
 * that owns the VM and, once it runs, its QEMU's pid, so a later agent can tell a live owner's VMs
 * from a dead one's and find the QEMU to kill. An `owner.json` in the VM directory itself (where
 * an older agent wrote it) is not read: the jail could have written it (a pid 1 owner keeps the
 * directory from ever being reaped).
 */
const VmOwner = z.object({
  ownerPid: z.int().positive(),
  qemuPid: z.int().positive().optional(),
  /** The uid its jail runs QEMU as (agent/qemu/uids.ts): freed when the VM ends. */
  jailUid: z.int().positive().optional(),
  /** The launch slot its QEMU runs in (slots.ts); absent: the VM directory itself. */
  slot: z.literal(NEXT_SLOT).optional(),
  /** Informational (for an operator reading the file). */
  createdAt: z.string().optional(),
});
export type VmOwner = z.infer<typeof VmOwner>;

const OWNER_FILE = "owner.json";
/**
 * `standby.json` beside it: a second QEMU of the VM waiting in its other slot for a rollback
 * (agent/snapshot/standby.ts), never the VM's own until it takes over. A later agent kills it.
 */
const STANDBY_FILE = "standby.json";

/** The owner record of `dir`; undefined when missing, torn or not one of ours. */
export function readOwner(dir: string): Promise<VmOwner | undefined> {
  return readOwnerFile(dir, OWNER_FILE);
}

async function readOwnerFile(dir: string, file: string): Promise<VmOwner | undefined> {
  try {
    const text = await readVmRecordFile(dir, file);
    if (text === undefined) return undefined;
    const r = VmOwner.safeParse(JSON.parse(text));
    return r.success ? r.data : undefined;
  } catch {
    return undefined;
  }
}

/**
 * Records this agent process as the owner of `dir` (and of `qemuPid` once QEMU runs, with the
 * uid its jail runs it as; a claim without one keeps the uid already recorded for that QEMU).
 */
export async function claimVm(
  dir: string,
  qemuPid?: number,
  jailUid?: number,
  slot?: LaunchSlot,
): Promise<void> {
  const owner: VmOwner = { ownerPid: process.pid, createdAt: new Date().toISOString() };
  if (qemuPid !== undefined) owner.qemuPid = qemuPid;
  // A claim of the QEMU already recorded (an adoption) keeps its uid and slot.
  const prev = qemuPid === undefined ? undefined : await readOwner(dir);
  const same = prev !== undefined && prev.qemuPid === qemuPid;
  const uid = jailUid ?? (qemuPid === undefined ? undefined : prev?.jailUid);
  if (uid !== undefined) owner.jailUid = uid;
  const s = slot ?? (same ? prev?.slot : undefined);
  if (s !== undefined) owner.slot = s;
  await writeVmRecordFile(dir, OWNER_FILE, JSON.stringify(owner));
}

/** Records the standby QEMU `qemuPid` (its jail's uid, its slot) of the VM in `dir`. */
export async function recordStandby(
  dir: string,
  qemuPid: number,
  jailUid: number | undefined,
  slot: LaunchSlot,
) {
  const rec: VmOwner = { ownerPid: process.pid, qemuPid, createdAt: new Date().toISOString() };
  if (jailUid !== undefined) rec.jailUid = jailUid;
  if (slot !== undefined) rec.slot = slot;
  await writeVmRecordFile(dir, STANDBY_FILE, JSON.stringify(rec));
}

/** Forgets the standby record (its QEMU took over as the VM's own, or is gone). */
export async function forgetStandby(dir: string): Promise<void> {
  await writeVmRecordFile(dir, STANDBY_FILE, "{}");
}

/**
 * Kills the standby QEMU recorded for `dir` if it still runs (an earlier agent's, never taken
 * over), frees its jail and forgets it. Its files are its launch slot's and its overlay's (the
 * chain store's `standby:` holder, released by the agent's start).
 */
export async function killRecordedStandby(
  dir: string,
  o: { sweep?: boolean; waitMs?: number } = {},
): Promise<void> {
  const waitMs = o.waitMs ?? KILL_WAIT_MS;
  const rec = await readOwnerFile(dir, STANDBY_FILE);
  const owner = await readOwner(dir);
  // Never the VM's own QEMU (a standby that took over whose record a crash left behind).
  if (rec?.qemuPid !== undefined && owner?.qemuPid !== rec.qemuPid) {
    await killQemu(rec.qemuPid, dir, waitMs);
    if (pidGone(rec.qemuPid)) await releaseJail(launchDir(dir, rec.slot), rec.jailUid);
  }
  // `sweep` (an adoption, once per VM at an agent's start; a /proc scan, so not on every
  // destroy): also one launched but not yet recorded when its agent went (its jail's cgroup and
  // uid lock are swept at the agent's start), any other QEMU of this directory.
  if (o.sweep && owner?.qemuPid !== undefined) {
    for (const pid of await qemuPidsNaming([dir]))
      if (pid !== owner.qemuPid) await killQemu(pid, dir, waitMs);
  }
  if (rec !== undefined) await forgetStandby(dir);
}

/**
 * True when `owner` is another agent process that is still alive. Two agents on one state dir
 * is a misconfiguration; killing the other's VMs would only make it worse, so they are left.
 */
export function ownedByAnotherLiveAgent(owner: VmOwner | undefined): boolean {
  return owner !== undefined && owner.ownerPid !== process.pid && pidAlive(owner.ownerPid);
}

// ---- pids --------------------------------------------------------------------------------------

/** A pid file's pid (QEMU's `-pidfile`); undefined when missing or not a pid. */
async function readPidFile(path: string): Promise<number | undefined> {
  try {
    const text = (await readFile(path, "utf8")).trim();
    const n = Number(text);
    return /^\d+$/.test(text) && Number.isSafeInteger(n) && n > 0 ? n : undefined;
  } catch {
    return undefined;
  }
}

/**
 * The host pid of `dir`'s QEMU as recorded: owner.json's, else the one its jail wrote. (QEMU's
 * own pid file holds its pid inside its pid namespace: 1.)
 */
export async function recordedQemuPid(dir: string): Promise<number | undefined> {
  const owner = await readOwner(dir);
  return owner?.qemuPid ?? (await readPidFile(vmPaths(launchDir(dir, owner?.slot)).hostPidFile));
}

/** True while `pid` exists (a zombie included; EPERM means it exists but is not ours to signal). */
export function pidAlive(pid: number): boolean {
  if (!isPid(pid)) return false;
  try {
    process.kill(pid, 0);
    return true;
  } catch (err) {
    return (err as NodeJS.ErrnoException).code === "EPERM";
  }
}

/**
 * True when `pid` no longer runs: gone, or a zombie (exited, waiting for its parent to collect
 * the status; it holds no memory or files any more, and only its parent can remove it).
 */
export function pidGone(pid: number): boolean {
  if (!pidAlive(pid)) return true;
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
    // The state letter follows the command name, which is in parentheses and may hold spaces.
    return stat.slice(stat.lastIndexOf(")") + 2).startsWith("Z");
  } catch {
    return true;
  }
}

/** Polls until `pid` is gone (or a zombie); false when it still runs after `timeoutMs`. */
export async function waitGone(pid: number, timeoutMs: number): Promise<boolean> {
  const deadline = performance.now() + timeoutMs;
  while (!pidGone(pid)) {
    if (performance.now() >= deadline) return false;
    await Bun.sleep(POLL_MS);
  }
  return true;
}

function isPid(pid: number): boolean {
  // 0 and negative numbers address process groups in kill(2): never let one through.
  return Number.isSafeInteger(pid) && pid > 0;
}

// ---- identity ----------------------------------------------------------------------------------

/** The argv of `pid` (empty for a gone pid, and for a zombie, whose cmdline is empty). */
async function argvOf(pid: number): Promise<string[]> {
  if (!isPid(pid)) return [];
  try {
    const argv = (await readFile(`/proc/${pid}/cmdline`, "utf8")).split("\0");
    if (argv.at(-1) === "") argv.pop();
    return argv;
  } catch {
    return [];
  }
}

/** True for a QEMU system emulator's argv: its program is `qemu-system-<target>`. */
export function isQemuArgv(argv: readonly string[]): boolean {
  const program = argv[0];
  return program !== undefined && basename(program).startsWith("qemu-system");
}

/**
 * True when an argument names a path inside `dir`: the argument starts with `<dir>/`, or a QEMU
 * option inside it does (`path=<dir>/…`, `file:<dir>/…`, `unix:<dir>/…,server=on`: right after
 * '=', ':' or ','). Matching `<dir>/` at such a boundary, not `dir` anywhere, keeps `/x/sbx-1`
 * from matching a QEMU of `/x/sbx-12` or of `/y/x/sbx-1`.
 */
export function argvNamesDir(argv: readonly string[], dir: string): boolean {
  const prefix = `${dir.replace(/\/+$/, "")}/`;
  return argv.slice(1).some((arg) => {
    for (let i = arg.indexOf(prefix); i >= 0; i = arg.indexOf(prefix, i + 1)) {
      if (i === 0 || "=:,".includes(arg.charAt(i - 1))) return true;
    }
    return false;
  });
}

/** True when `pid` runs a QEMU started for `dir` (guards every kill against a recycled pid). */
export function isQemuFor(pid: number, dir: string): Promise<boolean> {
  return isQemuNaming(pid, [dir]);
}

async function isQemuNaming(pid: number, dirs: readonly string[]): Promise<boolean> {
  const argv = await argvOf(pid);
  return isQemuArgv(argv) && dirs.some((d) => argvNamesDir(argv, d));
}

/** Pids of the running QEMUs whose arguments name a path inside one of `dirs`. */
export async function qemuPidsNaming(dirs: readonly string[]): Promise<number[]> {
  const out: number[] = [];
  for (const name of await readdir("/proc")) {
    if (/^\d+$/.test(name) && (await isQemuNaming(Number(name), dirs))) out.push(Number(name));
  }
  return out;
}

// ---- kill --------------------------------------------------------------------------------------

/**
 * SIGKILLs `pid` if it is the QEMU of `dir`, then waits until it is gone (at most `waitMs`).
 * Returns whether it was that QEMU and got the signal; a pid that is gone or someone else's is
 * left alone.
 */
export function killQemu(pid: number, dir: string, waitMs = KILL_WAIT_MS): Promise<boolean> {
  return killIfQemuNaming(pid, [dir], waitMs);
}

async function killIfQemuNaming(pid: number, dirs: readonly string[], waitMs: number): Promise<boolean> {
  if (!(await isQemuNaming(pid, dirs))) return false;
  try {
    process.kill(pid, "SIGKILL");
  } catch {
    return false; // exited between the check and the signal
  }
  await waitGone(pid, waitMs);
  return true;
}

/**
 * Kills the QEMU recorded for `dir` (owner.json, else the jail's pid file) if it still runs,
 * waits, and frees what its jail held (cgroup, uid) once it is gone.
 */
export async function killRecordedQemu(dir: string, waitMs = KILL_WAIT_MS): Promise<boolean> {
  const owner = await readOwner(dir);
  const pid = await recordedQemuPid(dir);
  await killRecordedStandby(dir, { waitMs });
  const killed = pid === undefined ? false : await killQemu(pid, dir, waitMs);
  if (pid === undefined || pidGone(pid)) await releaseJail(launchDir(dir, owner?.slot), owner?.jailUid);
  return killed;
}

/**
 * Kills every QEMU whose arguments name a path inside one of `dirs` and waits until they are
 * gone: the cleanup of a scratch area, whose QEMUs a step still in flight may have started
 * before anything tracked them. Returns the pids killed.
 */
export async function killQemusNaming(dirs: readonly string[], waitMs = KILL_WAIT_MS): Promise<number[]> {
  const pids = await qemuPidsNaming(dirs);
  const killed = await Promise.all(pids.map((pid) => killIfQemuNaming(pid, dirs, waitMs)));
  return pids.filter((_, i) => killed[i]);
}

// ---- adopt -------------------------------------------------------------------------------------

/**
 * Takes over the QEMU of `dir` that an earlier agent process started (launched with
 * `dieWithParent: false`, it outlived that process). Throws `vm_lost` when `pid` is not that QEMU
 * or its QMP socket does not answer.
 *
 * No exit event reaches a process that is not QEMU's parent, so `exited` watches the QMP socket:
 * QEMU dying closes it, and the pid check then tells its death from a hang-up of ours. `kill`
 * SIGKILLs it (if it still is that QEMU), waits, and removes its sockets and pid file.
 */
export async function adoptQemu(pid: number, dir: string): Promise<VmProcess> {
  if (!(await isQemuFor(pid, dir))) throw new SandboxdError("vm_lost", `QEMU pid ${pid} is not running`);
  const owner = await readOwner(dir);
  const jailUid = owner?.jailUid;
  // Its sockets and jail are its launch slot's (slots.ts).
  const runDir = launchDir(dir, owner?.slot);
  const paths = vmPaths(runDir);
  let qmp: QmpClient;
  try {
    qmp = await QmpClient.connect(paths.qmpSocket, { timeoutMs: ADOPT_QMP_TIMEOUT_MS });
  } catch (err) {
    throw new SandboxdError("vm_lost", "QMP socket does not answer", { cause: err });
  }
  let gone = false;
  const exited = (async (): Promise<VmExit> => {
    await qmp.closed;
    await waitGone(pid, ADOPTED_EXIT_WAIT_MS);
    gone = true;
    return { code: null, signal: null };
  })();
  return vmProcess(
    pid,
    runDir,
    qmp,
    exited,
    {
      stop: async () => {
        await killQemu(pid, dir);
        gone = true;
        if (pidGone(pid)) await releaseJail(runDir, jailUid);
      },
      isAlive: () => !gone && !pidGone(pid),
      stderrTail: () => "",
    },
    jailUid,
  );
}
