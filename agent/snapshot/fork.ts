/**
 * Fork of a RUNNING VM into N children; the parent keeps running with its files and processes,
 * the children start from the parent's exact memory (running processes included) and disk.
 *
 * Three methods copy the parent's memory (fork-method.ts says when each is used; fork/copy.ts
 * describes each): a background snapshot (the default), stop-copy, and a live precopy.
 *
 * Children (fork/children.ts): one restores straight from fork.state; more share a fork point.
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
import { startChildren } from "./fork/children.ts";
import { copyParentMemory, type ForkRun, watchStall } from "./fork/copy.ts";
import { rollBackFork } from "./fork/rollback.ts";
import { DEFAULT_FORK_METHOD, type ForkMethod } from "./fork-method.ts";
import { migrationByteCap } from "./stream.ts";
import { type RestoreTimings, type SandboxVm, storageDir } from "./vm.ts";

export const MAX_FORK_CHILDREN = 64;

export type ForkMode = "auto" | "direct" | "shared";

export interface ForkOptions {
  count: number;
  /** The children's ids (RFC 1123 labels, `count` of them); `newVmId()` each by default. */
  ids?: string[];
  /** "auto": direct for one child, shared for more (measured: see the report). */
  mode?: ForkMode;
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
 * Bytes a fork writes to tmpfs (the parent's shm root) before any child runs, at most: the
 * stream of the parent's RAM (`<fork>.state`, one pass, two with a live precopy); with a
 * background snapshot, the holes of the parent's RAM file (`ramFileHoleBytes`), which reading
 * them in (populate.ts) allocates on tmpfs even through a private mapping; and in shared
 * mode, while that stream still exists, the fork point's RAM file (guest RAM) and its device
 * state (a few KB; `migrationByteCap` of the RAM covers both). The children map that RAM file
 * (or the parent's) private: the pages each one writes are anonymous memory, not tmpfs, so the
 * number of children does not multiply it (the host's memory check admits each child's RAM).
 */
export function forkShmBytes(
  memMib: number,
  mode: "direct" | "shared",
  method: ForkMethod,
  ramFileHoleBytes = 0,
): number {
  const stream = migrationByteCap(memMib, method === "precopy" ? 2 : 1);
  const populated = method === "snapshot" ? ramFileHoleBytes : 0;
  return (mode === "shared" ? stream + migrationByteCap(memMib) : stream) + populated;
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
  /** The method this fork used (a snapshot falls back to stop-copy where QEMU refuses it). */
  method: ForkMethod;
  /** Bytes of fork.state. */
  stateBytes: number;
  /** Shared mode: restore of the fork point + its x-ignore-shared save. */
  forkPointMs: number;
  /** From fork start until every child answered with its identity set. */
  childrenReadyMs: number;
  /** From the parent's RESUME until every child answered. */
  childrenAfterResumeMs: number;
  children: RestoreTimings[];
  totalMs: number;
  mode: "direct" | "shared";
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
  const mode = o.mode === "direct" || o.mode === "shared" ? o.mode : o.count > 1 ? "shared" : "direct";
  const captured = await captureParent(parent, mode, o.method ?? DEFAULT_FORK_METHOD, log, o.freeBytes);
  if (!captured.ok) return captured;
  const { run, frozen, chain, forkHolder, parentStallMs, tResumed } = captured.value;
  const { forkId } = run;
  const disks = storageDir(parent.shape.dataDir);

  const started = await startChildren({
    parent,
    forkId,
    count: o.count,
    ...(o.ids ? { ids: o.ids } : {}),
    mode,
    frozen,
    statePath: run.statePath,
    disks,
    chain,
    forkHolder,
    ...(o.readyTimeoutMs ? { readyTimeoutMs: o.readyTimeoutMs } : {}),
    ...(o.log ? { log: o.log } : {}),
  });
  if (!started.ok) return started;
  const { children, timings, forkPointMs, doneAt } = started.value;
  return ok({
    children,
    timings: {
      parentStallMs,
      precopyMs: run.precopyMs,
      populateMs: run.populateMs,
      method: run.method,
      stateBytes: run.stateBytes,
      forkPointMs,
      childrenReadyMs: doneAt - run.t0,
      childrenAfterResumeMs: doneAt - tResumed,
      children: timings,
      totalMs: doneAt - run.t0,
      mode,
    },
  });
}

/** What a fork (or a kept snapshot, keep.ts) has once the parent runs again. */
export interface CapturedParent {
  run: ForkRun;
  /** The parent's former top overlay, read-only now: the base of whatever starts from the copy. */
  frozen: string;
  chain: ChainStore;
  /** Holds fork.state and `frozen` until the caller's own holders do; the caller releases it. */
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
  mode: "direct" | "shared",
  method: ForkMethod,
  log: (m: string) => void,
  freeBytes?: FreeBytes,
): Promise<Result<CapturedParent>> {
  const short = await shortOfShm(parent, mode, method, freeBytes);
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
  const forkHolder = `fork:${forkId}`;
  await chain.add(run.statePath, { kind: "state", holder: forkHolder, deps: [parent.memPath] });
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
  mode: "direct" | "shared",
  method: ForkMethod,
  freeBytes: FreeBytes | undefined,
): Promise<SnapshotError | undefined> {
  try {
    await needFreeSpace(
      parent.shape.shmRoot,
      "the fork's memory files on tmpfs",
      forkShmBytes(
        parent.shape.memMib,
        mode,
        method,
        method === "snapshot" ? await holeBytes(parent.memPath) : 0,
      ),
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
    statePath: join(s.shmRoot, `${forkId}.state`),
    newTop,
    newNode: `${parent.id}-n${parent.generation + 1}`,
    // In its QEMU's launch slot (vm/slots.ts): the directory its jail binds.
    staged: join(proc.dir, basename(newTop)),
    t0: performance.now(),
    log,
    method,
    switched: false,
    precopyMs: 0,
    populateMs: 0,
    stateBytes: 0,
  };
}
