/**
 * The children of a fork, started once the parent runs again. With one child, it restores
 * straight from fork.state (full RAM, private mapping). With more, the fork point is first
 * turned into a template (mode "shared"): ONE restore of fork.state into a new shared RAM file on
 * tmpfs, then a ~60 KB x-ignore-shared device state; every child maps that RAM file private
 * (copy-on-write), so the children share their clean pages and each restore reads 60 KB instead
 * of the whole RAM.
 */

import { mkdir, rm } from "node:fs/promises";
import { join } from "node:path";
import type { ChainStore } from "../../storage/chain.ts";
import { createOverlayOn, flattenOnto, MAX_CHAIN_DEPTH } from "../../storage/qcow2.ts";
import { newVmId } from "../../vm/ids.ts";
import { removeVmDir, vmsRoot } from "../../vm/workdir.ts";
import { asSnapshotError, fail, ok, type Result, SnapshotError } from "../errors.ts";
import { setCapabilities } from "../migrate.ts";
import { migrationByteCap, saveToFile } from "../stream.ts";
import { type RestoreTimings, restoreInto, SandboxVm } from "../vm.ts";
import { checkedChain } from "./chain.ts";
import { PRECOPY_TIMEOUT_MS } from "./copy.ts";

export interface ChildrenPlan {
  parent: SandboxVm;
  forkId: string;
  count: number;
  ids?: string[];
  mode: "direct" | "shared";
  /** The fork point: the parent's frozen overlay and its RAM stream. */
  frozen: string;
  statePath: string;
  disks: string;
  chain: ChainStore;
  /** Holds the fork point's files until every child holds its own. */
  forkHolder: string;
  readyTimeoutMs?: number;
  log?: (m: string) => void;
}

export interface StartedChildren {
  children: SandboxVm[];
  timings: RestoreTimings[];
  /** Shared mode: restore of the fork point + its x-ignore-shared save. */
  forkPointMs: number;
  /** performance.now() when every child answered. */
  doneAt: number;
}

/** Starts the children; on a failure every child started is destroyed. Releases the fork's hold. */
export async function startChildren(p: ChildrenPlan): Promise<Result<StartedChildren>> {
  const { parent, forkId, frozen, statePath, disks, chain, forkHolder } = p;
  const s = parent.shape;
  const children: SandboxVm[] = [];
  let forkPointMs = 0;
  try {
    // The children's disk base: the frozen overlay, or a flat copy of it past the bound.
    // The frozen overlay's header was its jail's to write until a moment ago: held to the records.
    const below = await checkedChain(chain, frozen, s.baseDisk);
    let childBase = frozen;
    if (chain.depth(frozen) >= MAX_CHAIN_DEPTH) {
      childBase = join(disks, `${forkId}-flat.qcow2`);
      await flattenOnto(frozen, below, childBase, s.diskBytes);
      await chain.add(childBase, { kind: "overlay", holder: forkHolder, depth: 1 });
    }

    let memPath = parent.memPath;
    let childState = statePath;
    let ignoreShared = false;
    if (p.mode === "shared") {
      const tp = performance.now();
      const point = await makeForkPoint(parent, forkId, statePath, childBase);
      forkPointMs = performance.now() - tp;
      memPath = point.memPath;
      childState = point.statePath;
      ignoreShared = true;
      await chain.add(point.memPath, { kind: "ram", holder: forkHolder });
      await chain.add(point.statePath, { kind: "state", holder: forkHolder, deps: [point.memPath] });
      // The full-RAM stream is no longer needed once the fork point holds it.
      await chain.release(forkHolder, [statePath]);
    }
    const results = await Promise.allSettled(
      Array.from({ length: p.count }, async (_, i) => {
        const id = p.ids?.[i] ?? newVmId();
        const disk = join(disks, `${id}-0.qcow2`);
        const child = new SandboxVm(id, join(vmsRoot(s.dataDir), id), s, disk, memPath, p.log);
        children.push(child);
        await chain.hold(child.holder, [childBase, memPath]);
        await createOverlayOn(childBase, disk, s.diskBytes);
        await chain.add(disk, { kind: "overlay", deps: [childBase], holder: child.holder });
        const timings = await restoreInto({
          vm: child,
          mem: { path: memPath, share: false },
          statePath: childState,
          ignoreShared,
          ...(p.readyTimeoutMs ? { readyTimeoutMs: p.readyTimeoutMs } : {}),
        });
        child.enter("running");
        return timings;
      }),
    );
    const failed = results.find((r) => r.status === "rejected");
    if (failed) throw (failed as PromiseRejectedResult).reason;
    const doneAt = performance.now();
    await chain.release(forkHolder);
    return ok({
      children,
      timings: results.map((r) => (r as PromiseFulfilledResult<RestoreTimings>).value),
      forkPointMs,
      doneAt,
    });
  } catch (err) {
    for (const c of children) await c.destroy();
    await chain.release(forkHolder);
    return fail(asSnapshotError(err, "fork_failed", `starting the children of ${parent.id} failed`));
  }
}

/**
 * Shared mode: restore the full stream once into a new SHARED RAM file (tmpfs), never run it,
 * and save its device state with x-ignore-shared: a template of the fork point.
 */
export async function makeForkPoint(
  parent: SandboxVm,
  forkId: string,
  fullState: string,
  childBase: string,
): Promise<{ memPath: string; statePath: string }> {
  const s = parent.shape;
  const memPath = join(s.shmRoot, `${forkId}.mem`);
  const statePath = join(s.shmRoot, `${forkId}.point.state`);
  const pointId = `${forkId}-point`.slice(0, 63);
  const disk = join(vmsRoot(s.dataDir), pointId, "disk.qcow2");
  const point = new SandboxVm(pointId, join(vmsRoot(s.dataDir), pointId), s, disk, memPath);
  try {
    await mkdir(point.dir, { recursive: true, mode: 0o700 });
    // Never written (the point never runs), but the device set must match the parent's.
    await createOverlayOn(childBase, disk, s.diskBytes);
    await restoreInto({
      vm: point,
      mem: { path: memPath, share: true },
      statePath: fullState,
      ignoreShared: false,
      stayPaused: true,
      base: childBase,
    });
    const p = point.process;
    if (!p) throw new SnapshotError("fork_failed", "fork point has no QEMU");
    await setCapabilities(p, { events: true, "x-ignore-shared": true });
    await saveToFile(p, {
      path: statePath,
      maxBytes: migrationByteCap(s.memMib),
      timeoutMs: PRECOPY_TIMEOUT_MS,
    });
    return { memPath, statePath };
  } catch (err) {
    await rm(memPath, { force: true });
    await rm(statePath, { force: true });
    throw err;
  } finally {
    await point.process?.kill();
    await removeVmDir(point.dir);
  }
}
