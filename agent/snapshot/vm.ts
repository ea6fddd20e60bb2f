/**
 * A VM of the snapshot engine (spawned from a template, forked, resumed) and the one restore path
 * they all share: new QEMU with the same device ids, `-incoming defer -S`, load the state, `cont`,
 * reconnect the guest agent, then give the guest its own identity (entropy, clock, hostname)
 * before anyone else may talk to it.
 *
 * Explicit states (states.ts): every operation first asks `begin(from, to)`, so a suspend racing
 * a fork gets `invalid_state` instead of two migrations on one QEMU.
 */
import { randomBytes, randomUUID } from "node:crypto";
import { mkdir } from "node:fs/promises";
import { join } from "node:path";
import { awaitedLater } from "../../contracts/best-effort.ts";
import { describeError, SandboxdError } from "../../contracts/errors.ts";
import type { GuestArtifacts } from "../guest/artifacts.ts";
import {
  type ExecOptions,
  type ExecResult,
  GuestClient,
  GuestError,
  type GuestTunnel,
} from "../guest/client.ts";
import { backingChain } from "../qemu/jail-setup.ts";
import type { Accel } from "../qemu/launch.ts";
import { DEVICE_IDS, launchVm, type MemBackend, type VmProcess } from "../qemu/launch.ts";
import { type ChainStore, openChainStore } from "../storage/chain.ts";
import type { VmHostSettings } from "../vm/host-settings.ts";
import { claimVm, recordStandby } from "../vm/process.ts";
import { type LaunchSlot, launchDir } from "../vm/slots.ts";
import { createVmDir, removeVmDir } from "../vm/workdir.ts";
import { asSnapshotError, SnapshotError } from "./errors.ts";
import { qmp, qmpFailure, setCapabilities } from "./migrate.ts";
import { canVmTransition, checkVmTransition, type EngineVmState } from "./states.ts";
import { loadFromFile } from "./stream.ts";

/**
 * Budget from `cont` to the guest's first HELLO answer after a restore. Under TCG the first
 * round trip costs ~150 ms (TCG re-translates the guest's code; ~1 ms on KVM); eight children
 * restoring at once on two cores share that CPU, so 30 s only catches a guest that is gone.
 */
export const RESTORE_READY_TIMEOUT_MS = 30_000;
/**
 * One HELLO attempt. After a restore the guest's port is open, so a HELLO is never dropped, only
 * late: attempts are long (reconnecting makes the guest see a disconnect and costs more).
 */
const HELLO_ATTEMPT_MS = 5_000;
/** Restoring a state file: ~8 ms for a template's device state, ~0.3 s for a full 256 MiB image. */
export const RESTORE_MIGRATION_TIMEOUT_MS = 60_000;

/** Bytes of host randomness mixed into each restored guest (its CRNG state is a copy otherwise). */
const ENTROPY_BYTES = 64;

export interface VmShape {
  dataDir: string;
  /** Where RAM and fork state files live (tmpfs). */
  shmRoot: string;
  artifacts: GuestArtifacts;
  accel: Accel;
  memMib: number;
  vcpus: number;
  /** The image's base disk (not ours: never deleted); the bottom of every chain. */
  baseDisk: string;
  /** Virtual size of the disk, bytes. */
  diskBytes: number;
  /**
   * Launch option (agent/qemu/launch.ts): false for VMs that must outlive the agent process (the
   * agent's sandboxes, re-adopted after a restart). Default true.
   */
  dieWithParent?: boolean;
  /**
   * The operator's jail and disk-reserve settings (agent/vm/host-settings.ts), default
   * DEFAULT_VM_HOST. Not saved with the VM: the agent that adopts it passes its own.
   */
  host?: VmHostSettings;
}

export class SandboxVm {
  state: EngineVmState = "starting";
  /** Current top overlay (ours, registered in the chain store, held by `holder`). */
  disk: string;
  /** QEMU node name of the top of the disk chain (changes with every fork of this VM). */
  topNode = "disk0";
  /** The RAM file mapped private (copy-on-write) by this VM's QEMU. */
  memPath: string;
  process: VmProcess | undefined;
  guest: GuestClient | undefined;
  /**
   * Takes the tunnels the guest opens (egress, docs/guest-protocol.md "Egress"), through every
   * guest connection this VM gets (a restore, resume or fork reconnects). Unset: closed at once.
   */
  onGuestTunnel: ((t: GuestTunnel) => void) | undefined;
  /** Full RAM image while suspended. */
  suspendState: string | undefined;
  /** How many overlays this VM made for itself (names of its next overlay). */
  generation = 0;
  /**
   * A QEMU waiting in this VM's other launch slot to roll it back to a kept snapshot in place
   * (standby.ts); dropped with the VM, before a suspend, and when a newer one replaces it.
   */
  standby: Promise<StandbyQemu | undefined> | undefined;
  private destroying: Promise<void> | undefined;

  constructor(
    readonly id: string,
    readonly dir: string,
    readonly shape: VmShape,
    disk: string,
    memPath: string,
    readonly log: (m: string) => void = () => {},
  ) {
    this.disk = disk;
    this.memPath = memPath;
  }

  get holder(): string {
    return `vm:${this.id}`;
  }

  /** Moves to `to` if the current state is one of `from` and the table allows it. */
  begin(from: readonly EngineVmState[], to: EngineVmState): SnapshotError | undefined {
    const refused = checkVmTransition(this.id, this.state, to, from);
    if (!refused) this.state = to;
    return refused;
  }

  /** Sets a state the operation in progress leads to (checked against the table). */
  enter(to: EngineVmState): void {
    if (this.state === to) return;
    if (!canVmTransition(this.state, to))
      throw new SandboxdError("internal", `no transition ${this.state} -> ${to}`);
    this.state = to;
  }

  /** Attaches a running QEMU + guest; an unexpected QEMU exit makes the VM dead and frees it. */
  attach(process: VmProcess, guest: GuestClient): void {
    this.process = process;
    this.guest = guest;
    guest.onIncomingTunnel((t) => (this.onGuestTunnel ? this.onGuestTunnel(t) : t.close()));
    process.exited.then((exit) => {
      if (this.process !== process) return; // an intended stop (suspend) already detached it
      if (this.state === "dead") return;
      this.log(`vm ${this.id}: QEMU exited unexpectedly (${exit.signal ?? `code ${exit.code}`})`);
      // Nobody awaits this destroy: a failure (ENOSPC while releasing the chain, an EBUSY
      // directory) is logged here, and the next destroy() of this VM tries again.
      this.destroy().catch((err) =>
        this.log(`vm ${this.id}: freeing it after its QEMU exited failed: ${describeError(err)}`),
      );
    });
  }

  /** Forgets the QEMU (after an intended exit: suspend), closing the guest connection. */
  async detach(): Promise<void> {
    const p = this.process;
    this.process = undefined;
    this.guest?.close();
    this.guest = undefined;
    await p?.kill();
  }

  /** Runs a command; a QEMU that dies meanwhile gives `vm_died` at once (never a hang). */
  async exec(o: ExecOptions): Promise<ExecResult> {
    const guest = this.guest;
    const proc = this.process;
    if (!guest || !proc || (this.state !== "running" && this.state !== "forking"))
      throw new SnapshotError("invalid_state", `VM ${this.id} is ${this.state}; exec needs a running VM`);
    try {
      return await guest.exec(o);
    } catch (err) {
      if (err instanceof GuestError && err.code === "guest_disconnected") {
        // Up to 1 s for the exit that follows a hang-up. Polled, not raced against `exited`: a
        // race leaves a reaction on `exited` for as long as QEMU lives, one per failed exec.
        for (let i = 0; i < 20 && proc.isAlive(); i++) await Bun.sleep(50);
        const exit = proc.isAlive() ? undefined : await proc.exited;
        if (exit || !proc.isAlive())
          throw new SnapshotError(
            "vm_died",
            `VM ${this.id}: QEMU exited during exec (${exit ? (exit.signal ?? `code ${exit.code}`) : "gone"})`,
            { cause: err, details: { exit } },
          );
      }
      throw err;
    }
  }

  /** Discards the standby QEMU, if any (it was never this VM's own). */
  async dropStandby(): Promise<void> {
    const s = this.standby;
    this.standby = undefined;
    // A standby that failed to launch left nothing to discard (standby.ts cleans up after itself).
    const standby = await s?.catch(() => undefined);
    await standby?.discard();
  }

  /** Kills QEMU, drops this VM's holds on shared files (freeing the unused ones), removes its dir. */
  destroy(): Promise<void> {
    this.destroying ??= (async () => {
      this.state = "dead";
      await this.dropStandby();
      this.guest?.close();
      await this.process?.kill();
      const chain = await openChainStore(this.shape.dataDir);
      await chain.release(this.holder);
      await removeVmDir(this.dir);
    })();
    const attempt = this.destroying;
    // A failed attempt is not remembered: the caller (or the agent's next sweep) may retry once
    // the cause (a full disk) is gone.
    attempt.catch(() => {
      if (this.destroying === attempt) this.destroying = undefined;
    });
    return attempt;
  }
}

/** A QEMU launched for a later rollback of a VM (standby.ts), what `restoreInPlace` takes over. */
export interface StandbyQemu {
  /** The kept snapshot it restores. */
  ref: string;
  process: VmProcess;
  /** Its overlay on the snapshot's base (held by `holder` until it takes over). */
  disk: string;
  holder: string;
  /** performance.now() when it was ready. */
  readyAt: number;
  /** Kills it and frees its overlay, jail and slot (idempotent). */
  discard(): Promise<void>;
}

export interface RestoreArgs {
  vm: SandboxVm;
  /** The RAM mapping: the state file's RAM file, private (share=false) for every child. */
  mem: MemBackend;
  statePath: string;
  /** The state was saved with x-ignore-shared (a template / shared fork point): RAM is in `mem`. */
  ignoreShared: boolean;
  /** Keep the guest stopped after the restore (no guest connect, no identity): a fork point. */
  stayPaused?: boolean;
  /**
   * For a disk the chain store does not hold (a fork point's, made a moment ago on the fork's
   * base): its backing file, which the store holds. Its chain is taken from there.
   */
  base?: string;
  /**
   * The same machine coming back (resume of a suspended VM): it keeps its boot id. Spawns and
   * fork children are new machines and get a fresh one.
   */
  sameMachine?: boolean;
  readyTimeoutMs?: number;
}

export interface RestoreTimings {
  /** QEMU spawn to `cont` answered. */
  forkMs: number;
  /** QEMU spawn to the first HELLO answered and the identity set. */
  readyMs: number;
  /** Parts: spawn->QMP, migrate-incoming, cont->HELLO, identity. */
  launchMs: number;
  incomingMs: number;
  helloMs: number;
  identityMs: number;
}

/**
 * Restores `vm` from a state file into a new QEMU in `vm.dir` (created if missing) and attaches
 * it. On failure the QEMU is killed and the error returned as a SnapshotError (the caller frees
 * the VM's files).
 */
export async function restoreInto(a: RestoreArgs): Promise<RestoreTimings> {
  const t0 = performance.now();
  const proc = await launchRestoreTarget(a.vm, a.mem, a.ignoreShared, a.base);
  return finishRestore(a, proc, t0, performance.now());
}

/** Deepest chain walked in the store: far past MAX_CHAIN_DEPTH, a bound on a looping table. */
const MAX_RECORDED_CHAIN = 64;

/**
 * The backing chain of `disk` as the agent's chain store has it, nearest first: the overlays
 * each lists as its dependency, then the image's base disk `baseDisk` (an overlay that lists none
 * - a template's disk, a flattened or collapsed one - lies on it directly). Undefined for a disk
 * the store does not hold. Never read from the overlays' headers: a jail that had an overlay
 * could have rewritten its header.
 */
export function recordedChain(chain: ChainStore, disk: string, baseDisk: string): string[] | undefined {
  if (chain.get(disk) === undefined) return undefined;
  const out: string[] = [];
  for (let f = chain.get(disk)?.deps[0]; f !== undefined; f = chain.get(f)?.deps[0]) {
    if (out.includes(f) || out.length >= MAX_RECORDED_CHAIN)
      throw new SnapshotError("spawn_failed", `the chain store's chain of ${disk} loops at ${f}`);
    out.push(f);
  }
  out.push(baseDisk);
  return out;
}

/**
 * What the disk of `vm` may be backed by, from the agent's records, not from the overlays'
 * headers: its recorded chain (recordedChain; for a disk the store does not hold, `base` and
 * base's recorded chain) and the files the base disk's own header names (the image store's,
 * never a jail's). A disk with neither is refused: its chain could come only from a header.
 */
async function recordedBacking(vm: SandboxVm, base?: string): Promise<Set<string>> {
  const chain = await openChainStore(vm.shape.dataDir);
  const below =
    recordedChain(chain, vm.disk, vm.shape.baseDisk) ??
    (base === undefined ? undefined : recordedChain(chain, base, vm.shape.baseDisk));
  if (below === undefined)
    throw new SnapshotError("spawn_failed", `${vm.disk} has no chain in the agent's chain store`);
  const top = chain.get(vm.disk) === undefined && base !== undefined ? [base] : [];
  return new Set([...top, ...below, ...(await backingChain(vm.shape.baseDisk)).files]);
}

/**
 * The first half of a restore, which depends on nothing but the VM's shape, disk and RAM file: its
 * directory, QEMU started in its jail with `-incoming defer -S`, QMP connected, the console drain
 * ready, the owner record written and the migration capabilities set. A spawn from a
 * pre-launched QEMU (prelaunch.ts) did this ahead of time. On failure the QEMU is killed.
 */
export async function launchRestoreTarget(
  vm: SandboxVm,
  mem: MemBackend,
  ignoreShared: boolean,
  base?: string,
  o: { slot?: LaunchSlot; standby?: boolean } = {},
): Promise<VmProcess> {
  const s = vm.shape;
  // A standby leaves the VM's own records alone: it is not the VM's QEMU until it takes over.
  if (!o.standby) await createVmDir(s.dataDir, vm.id);
  const runDir = launchDir(vm.dir, o.slot);
  if (runDir !== vm.dir) await mkdir(runDir, { recursive: true, mode: 0o700 });
  let proc: VmProcess | undefined;
  try {
    const backing = await recordedBacking(vm, base);
    proc = await launchVm({
      backing,
      dir: runDir,
      artifacts: s.artifacts,
      disk: vm.disk,
      memMib: s.memMib,
      vcpus: s.vcpus,
      accel: s.accel,
      hostname: vm.id,
      memBackend: mem,
      incoming: true,
      paused: true,
      ...(s.dieWithParent === undefined ? {} : { dieWithParent: s.dieWithParent }),
      ...(s.host ? { jail: s.host.jail } : {}),
    });
    // A fresh QEMU names the top of the disk chain with the fixed id, whatever node a fork had
    // moved the previous QEMU of this VM onto (a resumed parent forks from `disk0` again).
    vm.topNode = DEVICE_IDS.diskNode;
    if (o.standby) await recordStandby(vm.dir, proc.pid, proc.jailUid, o.slot);
    else await claimVm(vm.dir, proc.pid, proc.jailUid, o.slot);
    await setCapabilities(proc, { events: true, "x-ignore-shared": ignoreShared });
    return proc;
  } catch (err) {
    await proc?.kill();
    throw asSnapshotError(err, "spawn_failed", `restoring VM ${vm.id} failed`);
  }
}

/**
 * The second half: loads the state into `p` (a QEMU from launchRestoreTarget), connects the guest,
 * `cont`, gives it its identity and attaches it. `t0` is where the timings start, `tLaunch` when
 * the QEMU was ready. On failure the QEMU is killed.
 */
export async function finishRestore(
  a: RestoreArgs,
  p: VmProcess,
  t0: number,
  tLaunch: number,
): Promise<RestoreTimings> {
  const { vm } = a;
  let guest: GuestClient | undefined;
  try {
    await loadFromFile(p, a.statePath, RESTORE_MIGRATION_TIMEOUT_MS);
    const tIncoming = performance.now();
    if (a.stayPaused) {
      vm.process = p;
      const t = performance.now() - t0;
      return {
        forkMs: t,
        readyMs: t,
        launchMs: tLaunch - t0,
        incomingMs: tIncoming - tLaunch,
        helloMs: 0,
        identityMs: 0,
      };
    }
    // Connect to the agent port BEFORE cont: the guest was saved with a host connected, and when
    // virtio-serial's post-load check finds the host still connected it sends the guest no
    // close/open events, so the guest agent reads our HELLO at once (no 50 ms reconnect poll).
    const deadline = performance.now() + (a.readyTimeoutMs ?? RESTORE_READY_TIMEOUT_MS);
    const guestP = connectRestoredGuest(p, deadline);
    awaitedLater(guestP);
    await qmp(p, "cont");
    const tCont = performance.now();
    guest = await guestP;
    const tHello = performance.now();
    // Before anyone may use it: the guest's CRNG, clock and hostname are the snapshot's, shared
    // by every sibling. Reseed (ENTROPY does RNDADDENTROPY + RNDRESEEDCRNG), set the wall clock
    // (it stood still while saved), and name the VM (hostname must be an RFC 1123 label) with a
    // boot id of its own unless it is the same machine resuming.
    await Promise.all([
      guest.entropy(randomBytes(ENTROPY_BYTES)),
      guest.setClock(new Date()),
      guest.setHostname(vm.id, a.sameMachine ? {} : { bootId: randomUUID() }),
    ]);
    const tReady = performance.now();
    vm.attach(p, guest);
    return {
      forkMs: tCont - t0,
      readyMs: tReady - t0,
      launchMs: tLaunch - t0,
      incomingMs: tIncoming - tLaunch,
      helloMs: tHello - tCont,
      identityMs: tReady - tHello,
    };
  } catch (err) {
    guest?.close();
    let e: SnapshotError;
    if (err instanceof SnapshotError) e = err;
    else if (err instanceof GuestError && !p.isAlive()) e = await qmpFailure(p, "restore", err);
    else e = asSnapshotError(err, "spawn_failed", `restoring VM ${vm.id} failed`);
    await p.kill();
    vm.process = undefined;
    throw e;
  }
}

async function connectRestoredGuest(p: VmProcess, deadline: number): Promise<GuestClient> {
  let lastErr: unknown;
  for (;;) {
    if (!p.isAlive()) throw await qmpFailure(p, "guest reconnect", lastErr);
    const remaining = deadline - performance.now();
    if (remaining <= 0)
      throw new SnapshotError("bringup_timeout", "restored guest did not answer HELLO in time", {
        cause: lastErr,
      });
    try {
      return await GuestClient.connect(p.agentSocket, {
        helloTimeoutMs: Math.min(remaining, HELLO_ATTEMPT_MS),
      });
    } catch (err) {
      lastErr = err;
      await Bun.sleep(20);
    }
  }
}

export function storageDir(dataDir: string): string {
  return join(dataDir, "storage", "disks");
}
