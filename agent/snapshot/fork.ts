/**
 * Fork of a RUNNING VM into N children; the parent keeps running with its files and processes,
 * the children start from the parent's exact memory (running processes included) and disk.
 *
 * Three methods copy the parent's memory (fork-method.ts says when each is used; fork/copy.ts
 * describes each): a background snapshot (the default), stop-copy, and a live precopy.
 *
 * The copy arrives as a fork point (ram-split.ts): a RAM file every child maps private
 * (copy-on-write) and a small device state each child loads (fork/children.ts).
 *
 * Chains: every fork adds one level to the parent's chain and the children's. Past
 * MAX_CHAIN_DEPTH the children's base is flattened onto the image base (flattenOnto) and the
 * parent's own chain is collapsed live with `block-stream` (see storage/qcow2.ts for the bound).
 */

import { randomBytes } from "node:crypto";
import { chmod, mkdir, stat } from "node:fs/promises";
import { basename, join } from "node:path";
import { bestEffort, ifExists } from "../../contracts/best-effort.ts";
import { type FreeBytes, needFreeSpace } from "../../contracts/disk-space.ts";
import { isHostnameLabel, type VmProcess } from "../qemu/launch.ts";
import { type ChainStore, openChainStore } from "../storage/chain.ts";
import { MAX_CHAIN_DEPTH } from "../storage/qcow2.ts";
import { DEFAULT_VM_HOST } from "../vm/host-settings.ts";
import { asSnapshotError, fail, ok, type Result, SnapshotError } from "./errors.ts";
import {
  adoptNewTop,
  checkedChain,
  collapseParentChain,
  removeStagedLinks,
  stageNewOverlay,
} from "./fork/chain.ts";
import {
  type ChildrenBase,
  destroyLaunched,
  type LaunchedChildren,
  launchChildren,
  startChildren,
} from "./fork/children.ts";
import { copyParentMemory, type ForkRun, watchStall } from "./fork/copy.ts";
import { rollBackFork } from "./fork/rollback.ts";
import { DEFAULT_FORK_METHOD, type ForkMethod } from "./fork-method.ts";
import { migrationByteCap } from "./stream.ts";
import { type RestoreTimings, type SandboxVm, storageDir } from "./vm.ts";

/**
 * Children of one engine fork. The API and the agent's own API cap a call at 64 (the largest
 * tier's count, contracts/api/limits.ts; more is another call on the same parent); the engine
 * itself takes up to 128, so that one fork of 100 children (forkd's figure) can be measured
 * (`bench --fork-children 100`).
 */
export const MAX_FORK_CHILDREN = 128;

export interface ForkOptions {
  count: number;
  /** The children's ids (RFC 1123 labels, `count` of them); `newVmId()` each by default. */
  ids?: string[];
  /**
   * How the parent's memory is copied (fork-method.ts): a background snapshot by default. The
   * driver passes what readyForkMethod settled at the agent's start.
   */
  method?: ForkMethod;
  readyTimeoutMs?: number;
  log?: (m: string) => void;
  /** Measures free space before the fork writes to tmpfs (statfs by default; tests pass one). */
  freeBytes?: FreeBytes;
}

/**
 * Bytes a fork writes to tmpfs (the parent's shm root) before any child runs, at most: the fork
 * point's RAM file (at most the guest's RAM: its zero pages stay holes, and a live precopy's
 * resent pages overwrite their first copy) and its device state (a few KB of devices and the
 * firmware blocks: `migrationByteCap` of the RAM covers both); with a background snapshot, the
 * holes of the parent's RAM file (`ramFileHoleBytes`), which reading them in (populate.ts)
 * allocates on tmpfs even through a private mapping. The children map the fork point's RAM file
 * private: the pages each one writes are anonymous memory, not tmpfs, so the number of children
 * does not multiply it (the host's memory check admits each child's RAM).
 */
export function forkShmBytes(memMib: number, method: ForkMethod, ramFileHoleBytes = 0): number {
  return migrationByteCap(memMib) + (method === "snapshot" ? ramFileHoleBytes : 0);
}

/** Bytes of `path` not backed by blocks (its holes); 0 when it cannot be read. */
async function holeBytes(path: string): Promise<number> {
  const st = await ifExists(stat(path));
  return st ? Math.max(0, st.size - st.blocks * 512) : 0;
}

export interface ForkTimings {
  /** Guest stopped time, STOP to RESUME event. */
  parentStallMs: number;
  /** precopy: migrate to the pre-switchover pause; snapshot: the RAM stream after RESUME (guest running meanwhile in both). */
  precopyMs: number;
  /** snapshot: reading in the RAM mapping's unmapped pages before the stop (guest running). */
  populateMs: number;
  /** From the fork's start to the copy's, populate aside: the tmpfs and chain checks, the new overlay. */
  prepareMs: number;
  /** The method this fork used (a snapshot falls back to stop-copy where QEMU refuses it). */
  method: ForkMethod;
  /** Bytes of the migration stream (the fork point's RAM pages and device state). */
  stateBytes: number;
  /** The children's disk base checked against the records (a flat copy past the chain bound), beside their launches. */
  childBaseMs: number;
  /** From fork start until every child answered with its identity set. */
  childrenReadyMs: number;
  /** From the parent's RESUME until every child answered. */
  childrenAfterResumeMs: number;
  children: RestoreTimings[];
  totalMs: number;
}

export interface Forked {
  children: SandboxVm[];
  timings: ForkTimings;
}

export async function forkVm(parent: SandboxVm, o: ForkOptions): Promise<Result<Forked>> {
  const log = o.log ?? (() => {});
  if (!Number.isInteger(o.count) || o.count < 1 || o.count > MAX_FORK_CHILDREN)
    return fail(new SnapshotError("bad_request", `count must be 1..${MAX_FORK_CHILDREN}, got ${o.count}`));
  if (o.ids && (o.ids.length !== o.count || new Set(o.ids).size !== o.count || !o.ids.every(isHostnameLabel)))
    return fail(new SnapshotError("bad_request", `ids must be ${o.count} distinct RFC 1123 labels`));
  const t0 = performance.now();
  const disks = storageDir(parent.shape.dataDir);
  // The children's QEMUs start as soon as the parent runs again, while its RAM still streams:
  // a launch needs the disk base and the RAM file's name, not its content (children.ts).
  const base = (run: ForkRun, frozen: string, chain: ChainStore): ChildrenBase => ({
    parent,
    forkId: run.forkId,
    count: o.count,
    ...(o.ids ? { ids: o.ids } : {}),
    frozen,
    memPath: run.memPath,
    disks,
    chain,
    forkHolder: forkHolderOf(run.forkId),
    ...(o.log ? { log: o.log } : {}),
  });
  let launching: { chain: ChainStore; forkId: string; launched: Promise<LaunchedChildren> } | undefined;
  const captured = await captureParent(
    parent,
    o.method ?? DEFAULT_FORK_METHOD,
    log,
    o.freeBytes,
    (run, frozen, chain) => {
      const launched = launchChildren(base(run, frozen, chain));
      launched.catch(() => {}); // awaited below, either way
      launching = { chain, forkId: run.forkId, launched };
    },
  );
  if (!captured.ok) {
    // The copy failed after the children's QEMUs started: they go, and what the fork held.
    if (launching) {
      // A launch phase that failed left nothing (launchChildren destroys what it began).
      const l = await launching.launched.catch(() => undefined);
      if (l) await destroyLaunched(l.children);
      await launching.chain.release(forkHolderOf(launching.forkId));
    }
    return captured;
  }
  const { run, frozen, chain, parentStallMs, tResumed } = captured.value;
  // A launch phase that failed as a whole (the disk base) is tried again, and reported, below.
  const launched = await launching?.launched.catch(() => undefined);

  const started = await startChildren({
    ...base(run, frozen, chain),
    statePath: run.statePath,
    ...(launched ? { launched } : {}),
    ...(o.readyTimeoutMs ? { readyTimeoutMs: o.readyTimeoutMs } : {}),
  });
  if (!started.ok) return started;
  const { children, timings, childBaseMs, doneAt } = started.value;
  return ok({
    children,
    timings: {
      parentStallMs,
      precopyMs: run.precopyMs,
      populateMs: run.populateMs,
      prepareMs: run.tCopy - t0 - run.populateMs,
      method: run.method,
      stateBytes: run.stateBytes,
      childBaseMs,
      childrenReadyMs: doneAt - t0,
      childrenAfterResumeMs: doneAt - tResumed,
      children: timings,
      totalMs: doneAt - t0,
    },
  });
}

/** The chain store's holder of a fork's own files until its children hold theirs. */
export const forkHolderOf = (forkId: string) => `fork:${forkId}`;

/** What a fork (or a kept snapshot, keep.ts) has once the parent runs again. */
export interface CapturedParent {
  run: ForkRun;
  /** The parent's former top overlay, read-only now: the base of whatever starts from the copy. */
  frozen: string;
  chain: ChainStore;
  /** Holds the fork point's files and `frozen` until the caller's own holders do; the caller releases it. */
  forkHolder: string;
  parentStallMs: number;
  tResumed: number;
}

/**
 * The first half of a fork: the parent's memory streamed to `run.statePath` and its disk moved
 * onto a new top, the old one frozen; the parent runs on. Shared by fork and keep (keep.ts).
 */
export async function captureParent(
  parent: SandboxVm,
  method: ForkMethod,
  log: (m: string) => void,
  freeBytes?: FreeBytes,
  onResumed?: (run: ForkRun, frozen: string, chain: ChainStore) => void,
): Promise<Result<CapturedParent>> {
  const short = await shortOfShm(parent, method, freeBytes);
  if (short) return fail(short);
  const bad = parent.begin(["running"], "forking");
  if (bad) return fail(bad);
  const proc = parent.process;
  if (!proc) return fail(new SnapshotError("invalid_state", `VM ${parent.id} has no QEMU`));
  const chain = await openChainStore(parent.shape.dataDir);
  // Before anything is made on it: the parent's own chain, as its headers say, is its records'.
  // A header that disagrees refuses the fork; the parent runs on (its jail never had that file).
  const disagrees = await checkedChain(chain, parent.disk, parent.shape.baseDisk).then(
    () => undefined,
    (err: unknown) => asSnapshotError(err, "fork_failed", `forking VM ${parent.id} failed`),
  );
  if (disagrees) {
    parent.enter("running");
    return fail(disagrees);
  }
  const s = parent.shape;
  const run = newForkRun(parent, proc, method, log);
  const { forkId, newTop } = run;
  const disks = storageDir(s.dataDir);
  const frozen = parent.disk;
  if (onResumed) run.onResumed = () => onResumed(run, frozen, chain);
  const stall = watchStall(proc);
  try {
    await mkdir(s.shmRoot, { recursive: true, mode: 0o700 });
    await stageNewOverlay(run, disks);
    await copyParentMemory(run);
  } catch (err) {
    stall.off();
    return rollBackFork(run, asSnapshotError(err, "fork_failed", `forking VM ${parent.id} failed`));
  }
  const parentStallMs = await stall.settle();
  const tResumed = performance.now();
  await adoptNewTop(parent, newTop, run.newNode);
  // Off the stall: the guest runs again, and only the new top's link is still needed.
  await removeStagedLinks(run.proc.dir, run.staged);
  parent.enter("running");
  await bestEffort(log, `fork ${forkId}: making the frozen overlay read-only`, chmod(frozen, 0o444));
  log(
    `fork ${forkId} (${run.method}): parent stalled ${parentStallMs.toFixed(1)} ms, populate ${run.populateMs.toFixed(0)} ms, copy ${run.precopyMs.toFixed(0)} ms, state ${run.stateBytes} B`,
  );
  // The fork point's files are held by the fork itself until every child holds its own.
  const forkHolder = forkHolderOf(forkId);
  await chain.add(run.memPath, { kind: "ram", holder: forkHolder });
  await chain.add(run.statePath, { kind: "state", holder: forkHolder, deps: [run.memPath] });
  await chain.hold(forkHolder, [frozen]);
  // Keep the parent's own chain shallow. It runs meanwhile; the children wait (rare: once per
  // MAX_CHAIN_DEPTH forks of one VM).
  if (chain.depth(newTop) > MAX_CHAIN_DEPTH)
    await collapseParentChain(parent).catch((err) => log(`collapse: ${err}`));

  return ok({ run, frozen, chain, forkHolder, parentStallMs, tResumed });
}

/**
 * Asked before the parent is touched: a short tmpfs refuses the fork (507) and the parent runs
 * on, with nothing written. The reserve keeps tmpfs room for running VMs' RAM files.
 */
async function shortOfShm(
  parent: SandboxVm,
  method: ForkMethod,
  freeBytes: FreeBytes | undefined,
): Promise<SnapshotError | undefined> {
  try {
    await needFreeSpace(
      parent.shape.shmRoot,
      "the fork's memory files on tmpfs",
      forkShmBytes(parent.shape.memMib, method, method === "snapshot" ? await holeBytes(parent.memPath) : 0),
      (parent.shape.host ?? DEFAULT_VM_HOST).diskReserveBytes,
      freeBytes,
    );
    return undefined;
  } catch (err) {
    return asSnapshotError(err, "fork_failed", `forking VM ${parent.id} failed`);
  }
}

/** A fork of `parent` about to start: its id, its files' names, nothing copied yet. */
function newForkRun(
  parent: SandboxVm,
  proc: VmProcess,
  method: ForkMethod,
  log: (m: string) => void,
): ForkRun {
  const s = parent.shape;
  const forkId = `${parent.id}-f${randomBytes(3).toString("hex")}`;
  const newTop = join(storageDir(s.dataDir), `${parent.id}-${parent.generation + 1}.qcow2`);
  return {
    parent,
    proc,
    forkId,
    memPath: join(s.shmRoot, `${forkId}.mem`),
    statePath: join(s.shmRoot, `${forkId}.state`),
    newTop,
    newNode: `${parent.id}-n${parent.generation + 1}`,
    // In its QEMU's launch slot (vm/slots.ts): the directory its jail binds.
    staged: join(proc.dir, basename(newTop)),
    t0: performance.now(),
    tCopy: Number.NaN,
    log,
    method,
    switched: false,
    precopyMs: 0,
    populateMs: 0,
    stateBytes: 0,
  };
}
