/**
 * The children of a fork, started once the parent runs again. The fork point is a RAM file on
 * tmpfs and a ~60 KB device state (x-ignore-shared form), split from the parent's stream as it
 * arrived (ram-split.ts): every child maps that RAM file private (copy-on-write), so the children
 * share their clean pages and each restore reads 60 KB instead of the whole RAM.
 *
 * A child's restore is two halves (vm.ts): its QEMU started in its jail, waiting for a state
 * (`launchChildren`), which needs only the disk base and the RAM file's name; and the load of the
 * state, `cont`, the guest's answer and its identity (`startChildren`), which need the fork point
 * whole. The first half of every child runs while the parent's RAM still streams (fork.ts), so
 * the stream and the QEMU starts overlap instead of adding up.
 */

import { join } from "node:path";
import { awaitedLater } from "../../../contracts/best-effort.ts";
import type { VmProcess } from "../../qemu/launch.ts";
import type { ChainStore } from "../../storage/chain.ts";
import { createOverlayOn, flattenOnto, MAX_CHAIN_DEPTH } from "../../storage/qcow2.ts";
import { newVmId } from "../../vm/ids.ts";
import { vmsRoot } from "../../vm/workdir.ts";
import { asSnapshotError, fail, ok, type Result } from "../errors.ts";
import { finishRestore, launchRestoreTarget, type RestoreTimings, SandboxVm } from "../vm.ts";
import { checkedChain } from "./chain.ts";

/** What every child starts from: the fork's names and files, and the children's ids. */
export interface ChildrenBase {
  parent: SandboxVm;
  forkId: string;
  count: number;
  ids?: string[];
  /** The fork point: the parent's frozen overlay, its RAM file (written while the stream lasts). */
  frozen: string;
  memPath: string;
  disks: string;
  chain: ChainStore;
  /** Holds the fork point's files until every child holds its own. */
  forkHolder: string;
  log?: (m: string) => void;
}

export interface ChildrenPlan extends ChildrenBase {
  /** The fork point's device state, complete. */
  statePath: string;
  readyTimeoutMs?: number;
  /** The children's QEMUs, started while the stream lasted (launchChildren); started here otherwise. */
  launched?: LaunchedChildren;
}

/** One child's first half: its QEMU waiting for the state (or the reason it did not start). */
interface LaunchedChild {
  vm: SandboxVm;
  launch: Promise<{ proc: VmProcess; t0: number; tLaunch: number }>;
}

export interface LaunchedChildren {
  /** The disk base every child's overlay lies on. */
  childBase: string;
  /**
   * The base's chain held to the records (and, past the bound, flattened): its time in ms once
   * it passed. No child's state loads before it did.
   */
  checked: Promise<number>;
  children: LaunchedChild[];
}

export interface StartedChildren {
  children: SandboxVm[];
  timings: RestoreTimings[];
  /** The children's disk base checked against the records (and flattened past the bound), beside their launches. */
  childBaseMs: number;
  /** performance.now() when every child answered. */
  doneAt: number;
}

/**
 * The children's first halves: each one's overlay on the disk base and its QEMU started in its
 * jail, all at once. Returns without waiting for the QEMUs; a launch that fails is reported by
 * startChildren. On an error here every child begun is destroyed.
 */
export async function launchChildren(p: ChildrenBase): Promise<LaunchedChildren> {
  const { parent, forkId, frozen, memPath, disks, chain, forkHolder } = p;
  const s = parent.shape;
  const tBase = performance.now();
  const children: LaunchedChild[] = [];
  try {
    // The children's disk base: the frozen overlay, or a flat copy of it past the bound.
    // The frozen overlay's header was its jail's to write until a moment ago: held to the records.
    // The check runs beside the launches (each took ~30-80 ms with the stream on 2 cores): a
    // child's jail binds only the files the records name, whatever a header says, and no child
    // loads its state or runs before the check passed (startChildren).
    let childBase = frozen;
    let checked: Promise<number>;
    if (chain.depth(frozen) >= MAX_CHAIN_DEPTH) {
      const below = await checkedChain(chain, frozen, s.baseDisk);
      childBase = join(disks, `${forkId}-flat.qcow2`);
      await flattenOnto(frozen, below, childBase, s.diskBytes);
      await chain.add(childBase, { kind: "overlay", holder: forkHolder, depth: 1 });
      checked = Promise.resolve(performance.now() - tBase);
    } else {
      checked = checkedChain(chain, frozen, s.baseDisk).then(() => performance.now() - tBase);
      awaitedLater(checked); // by startChildren, before any child loads
    }
    for (let i = 0; i < p.count; i++) {
      const id = p.ids?.[i] ?? newVmId();
      const disk = join(disks, `${id}-0.qcow2`);
      const vm = new SandboxVm(id, join(vmsRoot(s.dataDir), id), s, disk, memPath, p.log);
      const launch = (async () => {
        await chain.hold(vm.holder, [childBase]);
        await createOverlayOn(childBase, disk, s.diskBytes);
        await chain.add(disk, { kind: "overlay", deps: [childBase], holder: vm.holder });
        const t0 = performance.now();
        const proc = await launchRestoreTarget(vm, { path: memPath, share: false }, true);
        return { proc, t0, tLaunch: performance.now() };
      })();
      // Awaited by startChildren; a rejection before then is not unhandled.
      awaitedLater(launch);
      children.push({ vm, launch });
    }
    return { childBase, checked, children };
  } catch (err) {
    await destroyLaunched(children);
    throw err;
  }
}

/** Kills every child's QEMU (once its launch settled) and frees its files. */
export async function destroyLaunched(children: LaunchedChild[]): Promise<void> {
  for (const c of children) {
    // A launch that failed killed its own QEMU (launchRestoreTarget); its files go with destroy.
    const r = await c.launch.catch(() => undefined);
    await r?.proc.kill();
    await c.vm.destroy();
  }
}

/**
 * The children's second halves, once the fork point is whole: each child holds the RAM file,
 * loads the state, runs and gets its identity. On a failure every child is destroyed. Releases
 * the fork's hold either way.
 */
export async function startChildren(p: ChildrenPlan): Promise<Result<StartedChildren>> {
  const { parent, memPath, statePath, chain, forkHolder } = p;
  let launched = p.launched;
  try {
    launched ??= await launchChildren(p);
    const childBaseMs = await launched.checked;
    const results = await Promise.allSettled(
      launched.children.map(async ({ vm, launch }) => {
        const { proc, t0, tLaunch } = await launch;
        await chain.hold(vm.holder, [memPath]);
        const timings = await finishRestore(
          {
            vm,
            mem: { path: memPath, share: false },
            statePath,
            ignoreShared: true,
            ...(p.readyTimeoutMs ? { readyTimeoutMs: p.readyTimeoutMs } : {}),
          },
          proc,
          t0,
          tLaunch,
        );
        vm.enter("running");
        return timings;
      }),
    );
    const failed = results.find((r) => r.status === "rejected");
    if (failed) throw (failed as PromiseRejectedResult).reason;
    const doneAt = performance.now();
    await chain.release(forkHolder);
    return ok({
      children: launched.children.map((c) => c.vm),
      timings: results.map((r) => (r as PromiseFulfilledResult<RestoreTimings>).value),
      childBaseMs,
      doneAt,
    });
  } catch (err) {
    if (launched) await destroyLaunched(launched.children);
    await chain.release(forkHolder);
    return fail(asSnapshotError(err, "fork_failed", `starting the children of ${parent.id} failed`));
  }
}
