/**
 * The parent's disk chain across a fork: its new overlay (made before the stop, adopted once
 * QEMU took it), the hard links earlier forks left, and the live collapse past MAX_CHAIN_DEPTH.
 */

import { chown, link, lstat, mkdir, readdir, rm } from "node:fs/promises";
import { join } from "node:path";
import { awaitedLater, ifExists } from "../../../contracts/best-effort.ts";
import { backingChain } from "../../qemu/jail-setup.ts";
import type { ChainStore } from "../../storage/chain.ts";
import { openChainStore } from "../../storage/chain.ts";
import { createOverlayOn } from "../../storage/qcow2.ts";
import { SnapshotError } from "../errors.ts";
import { qmp } from "../migrate.ts";
import { recordedChain, type SandboxVm } from "../vm.ts";
import type { ForkRun } from "./copy.ts";

/** Live chain collapse of the parent (block-stream), a few hundred MB at most. */
const STREAM_TIMEOUT_MS = 120_000;

/**
 * Makes the parent's new overlay on its current top, before anything stops. The parent's jail
 * sees only its own files: the new overlay is made in the storage directory, owned by the
 * parent's uid, hard-linked into the parent's directory (link(2) fails on a name its QEMU
 * planted, never follows it) and taken over by QEMU as an `existing` image there (same file
 * system: the data dir). The link stays while it is the parent's top: QEMU reopens a node by its
 * file name when it becomes a backing file (read-only) at the next fork, and with the name gone
 * it would keep writing it; that fork removes it.
 */
export async function stageNewOverlay(run: ForkRun, disks: string): Promise<void> {
  const { parent, proc, newTop, staged } = run;
  const frozen = parent.disk;
  await mkdir(disks, { recursive: true, mode: 0o700 });
  // The VM's size, not the frozen overlay's header (its jail's to rewrite): `-u` opens nothing.
  await createOverlayOn(frozen, newTop, parent.shape.diskBytes);
  if (proc.jailUid !== undefined) await chown(newTop, proc.jailUid, proc.jailUid);
  await rm(staged, { force: true });
  await link(newTop, staged);
}

/** Removes the hard links earlier forks left in `dir` (see stageNewOverlay), all but `keep`. */
export async function removeStagedLinks(dir: string, keep?: string): Promise<void> {
  for (const name of await readdir(dir)) {
    const p = join(dir, name);
    if (p === keep) continue;
    const st = await ifExists(lstat(p));
    if (st?.isFile() && st.nlink > 1) await rm(p, { force: true });
  }
}

/** Records the parent's move onto its new overlay (the old one stays, as its backing file). */
export async function adoptNewTop(parent: SandboxVm, newTop: string, newNode: string): Promise<void> {
  const chain = await openChainStore(parent.shape.dataDir);
  const old = parent.disk;
  await chain.add(newTop, { kind: "overlay", deps: [old], holder: parent.holder });
  parent.disk = newTop;
  parent.topNode = newNode;
  parent.generation++;
  await chain.release(parent.holder, [old]);
}

/**
 * Collapses the running parent's chain onto the image base with `block-stream` (data of every
 * overlay between is copied into the top), then drops the overlays it no longer needs.
 */
export async function collapseParentChain(parent: SandboxVm): Promise<void> {
  const proc = parent.process;
  if (!proc) return;
  const jobId = `stream-${parent.generation}`;
  const done = proc.qmp.waitEvent("BLOCK_JOB_COMPLETED", {
    timeoutMs: STREAM_TIMEOUT_MS,
    filter: (ev) => (ev.data as { device?: string } | undefined)?.device === jobId,
  });
  awaitedLater(done);
  await qmp(proc, "block-stream", { "job-id": jobId, device: parent.topNode, base: parent.shape.baseDisk });
  const ev = await done;
  const err = (ev.data as { error?: string } | undefined)?.error;
  if (err) throw new SnapshotError("fork_failed", `block-stream failed: ${err}`);
  const chain = await openChainStore(parent.shape.dataDir);
  await chain.setDeps(parent.disk, [], 1);
}

/**
 * Holds the headers of `disk`'s backing chain to the chain store's record of it (recordedChain)
 * before a fork builds on it: the same files in the same order, down to the base disk. A header
 * that names anything else (its jail's QEMU could have rewritten it) refuses the fork with that
 * name; the name is never opened (backingChain stops at it). Returns the recorded chain.
 */
export async function checkedChain(chain: ChainStore, disk: string, baseDisk: string): Promise<string[]> {
  const recorded = recordedChain(chain, disk, baseDisk);
  if (recorded === undefined)
    throw new SnapshotError("fork_failed", `${disk} is not in the agent's chain store`);
  // The base disk's own backing files are the image store's, named by its header (never a jail's).
  const baseOwn = (await backingChain(baseDisk)).files;
  const headers = await backingChain(disk, new Set([...recorded, ...baseOwn]));
  const named = headers.foreign ?? headers.files.find((f, i) => i < recorded.length && f !== recorded[i]);
  const short = headers.foreign === undefined && headers.files.length < recorded.length;
  if (named !== undefined || short)
    throw new SnapshotError(
      "fork_failed",
      `${disk}'s image headers name ${named ?? "a shorter chain"}, which its records do not (${recorded.join(" <- ")}): refusing to fork it`,
    );
  return recorded;
}
