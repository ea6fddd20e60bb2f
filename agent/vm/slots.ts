/**
 * A VM directory's two launch slots: where its QEMU runs (the sockets, pid files, jail root and
 * console of agent/qemu/launch.ts; the cgroup and uid lock are named after it too). A VM's QEMU
 * runs in the directory itself or in its `next/` subdirectory, so that a second QEMU of the same
 * VM can start beside the running one: a rollback's standby (agent/snapshot/standby.ts) waits
 * there, restored-to-be, while the VM runs on, and takes over in place.
 *
 * Isolation holds between the two: each slot's directory is root's with the group of its own
 * jail's uid and no access for others (VM_DIR_MODE), and each jail binds only its own slot; the
 * root slot's jail sees the `next/` entry but cannot enter it.
 */
import { join } from "node:path";

export const NEXT_SLOT = "next";
/** Undefined: the VM directory itself. */
export type LaunchSlot = typeof NEXT_SLOT | undefined;

export function launchDir(vmDir: string, slot: LaunchSlot): string {
  return slot === undefined ? vmDir : join(vmDir, slot);
}

/** The slot a QEMU running in `runDir` does not use. */
export function otherSlot(vmDir: string, runDir: string): LaunchSlot {
  return runDir === vmDir ? NEXT_SLOT : undefined;
}

/** The slot of a QEMU running in `runDir` (a VM directory or its `next/`). */
export function slotOf(vmDir: string, runDir: string): LaunchSlot {
  return runDir === vmDir ? undefined : NEXT_SLOT;
}
