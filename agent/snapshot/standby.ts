/**
 * Standby QEMUs for rollbacks in place (docs/snapshots.md "Restore in place"). A rollback's own
 * work is small (stop the old QEMU, load ~60 KB of device state, `cont`, the guest's first answer);
 * what made it slow was launching the new QEMU into its jail (85-155 ms on these hosts). So after
 * a VM's snapshot is taken, and after each rollback, a QEMU for the next rollback to that snapshot
 * is launched ahead of time in the VM's other launch slot (vm/slots.ts), `-incoming defer -S`:
 * its overlay on the snapshot's base made, its RAM the snapshot's memory image mapped private
 * (untouched: it holds no guest memory while it waits), its jail, uid and cgroup its own. The
 * rollback stops the VM's QEMU and hands the standby the device state (keep.ts restoreInPlace).
 *
 * One standby per VM, for the snapshot it was last snapshotted to or rolled back to; a rollback
 * to another snapshot launches one on the spot (keep.ts restoreInPlace), then takes over the same way. It is dropped with its VM,
 * before a suspend, and when a newer one replaces it. `standby.json` (vm/process.ts) records it,
 * so a later agent kills it; its overlay's chain holder (`standby:`) is transient.
 */
import { randomBytes } from "node:crypto";
import { rm } from "node:fs/promises";
import { join } from "node:path";
import { describeError } from "../../contracts/errors.ts";
import { removeQemuFiles } from "../qemu/launch.ts";
import { openChainStore } from "../storage/chain.ts";
import { createOverlayOn } from "../storage/qcow2.ts";
import { forgetStandby } from "../vm/process.ts";
import { launchDir, otherSlot } from "../vm/slots.ts";
import { SnapshotError } from "./errors.ts";
import { launchRestoreTarget, SandboxVm, type StandbyQemu, storageDir } from "./vm.ts";

/** What a standby restores: a kept snapshot's files (keep.ts `KeptRecord` has them). */
export interface StandbyTarget {
  ref: string;
  version: 1 | 2;
  base: string;
  memPath: string;
  statePath: string;
}

/** Launches a standby for rolling `vm` back to `record`; throws when it cannot (nothing is left). */
export async function launchStandby(vm: SandboxVm, record: StandbyTarget): Promise<StandbyQemu> {
  const running = vm.process;
  if (!running) throw new SnapshotError("invalid_state", `VM ${vm.id} has no QEMU to stand beside`);
  const s = vm.shape;
  const tag = randomBytes(4).toString("hex");
  const holder = `standby:${vm.id}:${tag}`;
  const disk = join(storageDir(s.dataDir), `${vm.id}-s${tag}.qcow2`);
  const slot = otherSlot(vm.dir, running.dir);
  const runDir = launchDir(vm.dir, slot);
  const chain = await openChainStore(s.dataDir);
  const cleanSlot = async () => {
    await forgetStandby(vm.dir);
    if (runDir !== vm.dir) await rm(runDir, { recursive: true, force: true });
    else await removeQemuFiles(runDir);
  };
  try {
    await chain.hold(holder, [record.base, record.memPath, record.statePath]);
    await createOverlayOn(record.base, disk, s.diskBytes);
    await chain.add(disk, { kind: "overlay", deps: [record.base], holder });
    // A shell of the VM for the launch: the same id (its hostname), directory and shape.
    const shell = new SandboxVm(vm.id, vm.dir, s, disk, record.memPath, vm.log);
    const process = await launchRestoreTarget(
      shell,
      { path: record.memPath, share: false },
      record.version === 2,
      undefined,
      { slot, standby: true },
    );
    let discarded: Promise<void> | undefined;
    return {
      ref: record.ref,
      process,
      disk,
      holder,
      readyAt: performance.now(),
      discard: () => {
        discarded ??= (async () => {
          await process.kill();
          await chain.release(holder);
          await cleanSlot();
        })();
        return discarded;
      },
    };
  } catch (err) {
    await chain.release(holder);
    await rm(disk, { force: true });
    await cleanSlot();
    throw err;
  }
}

/**
 * Arms a standby of `vm` for `record` in the background (replacing the one it has): the caller's
 * answer does not wait for it. A failure is logged and leaves none (the next rollback is cold).
 */
export function armStandby(vm: SandboxVm, record: StandbyTarget): void {
  const previous = vm.standby;
  const live = () => vm.state === "running" || vm.state === "paused" || vm.state === "forking";
  let next: Promise<StandbyQemu | undefined> | undefined;
  next = (async () => {
    // A standby that failed to launch left nothing to discard (launchStandby cleans up after itself).
    const old = await previous?.catch(() => undefined);
    await old?.discard();
    // None launched: the VM holds no standby (admission counts a VM's `standby` while it is set).
    const none = () => {
      if (vm.standby === next) vm.standby = undefined;
      return undefined;
    };
    if (!live()) return none();
    try {
      const standby = await launchStandby(vm, record);
      // Dropped meanwhile (a suspend, a destroy, a newer standby): this one is nobody's.
      if (vm.standby !== next || !live()) {
        await standby.discard();
        return none();
      }
      return standby;
    } catch (err) {
      vm.log(`vm ${vm.id}: no standby for rolling back to ${record.ref}: ${describeError(err)}`);
      return none();
    }
  })();
  vm.standby = next;
}

/**
 * The VM's standby if it is for `ref` and its QEMU still runs; any other is discarded. Undefined
 * when there is none to take (the rollback launches one on the spot).
 */
export async function takeStandby(vm: SandboxVm, ref: string): Promise<StandbyQemu | undefined> {
  const pending = vm.standby;
  vm.standby = undefined;
  // A standby that failed to launch left nothing to discard (launchStandby cleans up after itself).
  const standby = await pending?.catch(() => undefined);
  if (!standby) return undefined;
  if (standby.ref === ref && standby.process.isAlive()) return standby;
  await standby.discard();
  return undefined;
}

/** Discards `vm`'s standby if it is for `ref` (a dropped snapshot: its files must not outlive it). */
export async function dropStandbyFor(vm: SandboxVm, ref: string): Promise<void> {
  const pending = vm.standby;
  // A standby that failed to launch left nothing to discard (launchStandby cleans up after itself).
  const standby = await pending?.catch(() => undefined);
  if (standby?.ref !== ref || vm.standby !== pending) return;
  vm.standby = undefined;
  await standby.discard();
}
