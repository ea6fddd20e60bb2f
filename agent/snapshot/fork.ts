/**
 * Fork of a RUNNING VM into N children; the parent keeps running with its files and processes,
 * the children start from the parent's exact memory (running processes included) and disk.
 *
 * Three methods copy the parent's memory (fork-method.ts says when each is used):
 *
 * `snapshot` (the default), a QEMU background snapshot:
 *
 *   1. Before any stop, the pages of the guest's RAM mapping that are not mapped yet are read in
 *      from the host (populate.ts): QEMU must map every page to write-protect it, and would do it
 *      inside the stall.
 *   2. `stop` (the STOP event starts the stall), `blockdev-snapshot-sync` moves the parent onto
 *      its new overlay (the disk of the fork point, the same instant as the memory), then
 *      `migrate` with the `background-snapshot` capability: QEMU saves the device state,
 *      write-protects the RAM (userfaultfd) and starts the guest itself (RESUME ends the stall).
 *   3. The RAM streams to fork.state while the guest runs: a page the guest writes is copied out
 *      first, so the stream is the RAM at the stop. No `cont` is needed: the disks stay active.
 *
 * `stop-copy`: stop, snapshot the disk, migrate the whole RAM, cont (the stall is the whole copy).
 *
 * `precopy`, a live precopy with dirty tracking:
 *
 *   1. `pause-before-switchover` on, bandwidth unlimited, `migrate` into a socket the agent copies
 *      to fork.state (stream.ts): RAM streams to tmpfs WHILE the guest runs (dirty pages are sent
 *      again).
 *   2. QEMU stops the guest for the switchover and pauses in `pre-switchover`. The STOP event
 *      starts the stall. Now `blockdev-snapshot-sync` moves the parent onto a NEW overlay: its
 *      old overlay becomes the frozen disk of the fork point (the backing file of every child).
 *   3. `migrate-continue`: the last dirty pages and the device state are written, the migration
 *      completes (and QEMU inactivates the block nodes).
 *   4. `cont`: QEMU re-activates the block nodes (qmp_cont's bdrv_activate_all) and the guest
 *      runs again. RESUME ends the stall. Stall = RESUME - STOP, both QEMU event timestamps.
 *
 * Children: with one child, it restores straight from fork.state (full RAM, private mapping).
 * With more, the fork point is first turned into a template (mode "shared"): ONE restore of
 * fork.state into a new shared RAM file on tmpfs, then a ~60 KB x-ignore-shared device state;
 * every child maps that RAM file private (copy-on-write), so the children share their clean
 * pages and each restore reads 60 KB instead of the whole RAM.
 *
 * Chains: every fork adds one level to the parent's chain and the children's. Past
 * MAX_CHAIN_DEPTH the children's base is flattened onto the image base (flattenOnto) and the
 * parent's own chain is collapsed live with `block-stream` (see storage/qcow2.ts for the bound).
 */

import { randomBytes } from "node:crypto";
import { chmod, chown, link, lstat, mkdir, readdir, rm, stat } from "node:fs/promises";
import { basename, join } from "node:path";
import { type FreeBytes, needFreeSpace } from "../../contracts/disk-space.ts";
import { isHostnameLabel } from "../qemu/launch.ts";
import type { QmpEvent } from "../qemu/qmp/framing.ts";
import { openChainStore } from "../storage/chain.ts";
import { createOverlayOn, flattenOnto, MAX_CHAIN_DEPTH, virtualSize } from "../storage/qcow2.ts";
import { newVmId } from "../vm/ids.ts";
import { vmsRoot } from "../vm/workdir.ts";
import { asSnapshotError, fail, ok, type Result, SnapshotError } from "./errors.ts";
import { DEFAULT_FORK_METHOD, type ForkMethod } from "./fork-method.ts";
import {
  eventTimeMs,
  LOCAL_MIGRATION_MAX_BANDWIDTH,
  qmp,
  setCapabilities,
  setMigrationParameters,
} from "./migrate.ts";
import { blockedInUserfault, populateMapping } from "./populate.ts";
import { migrationByteCap, type SaveStream, saveToFile, startSave } from "./stream.ts";
import { type RestoreTimings, restoreInto, SandboxVm, storageDir } from "./vm.ts";

export const MAX_FORK_CHILDREN = 64;

/**
 * Largest stall QEMU plans for when it decides to switch over (remaining dirty bytes / measured
 * bandwidth). 50 ms: a guest under TCG dirties few MB/s, so the first pass already fits.
 */
const PRECOPY_DOWNTIME_LIMIT_MS = 50;
/** Whole precopy of a 256 MiB guest: ~0.3-0.6 s under TCG; a minute means something is stuck. */
const PRECOPY_TIMEOUT_MS = 60_000;
/** Live chain collapse of the parent (block-stream), a few hundred MB at most. */
const STREAM_TIMEOUT_MS = 120_000;

/** query-status polls (1 ms apart) for the finish-migrate -> postmigrate step: ~1 ms in practice. */
const FINALIZE_POLLS = 2000;

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
  const st = await stat(path).catch(() => undefined);
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
  let method = o.method ?? DEFAULT_FORK_METHOD;
  try {
    // Asked before the parent is touched: a short tmpfs refuses the fork (507) and the parent
    // runs on, with nothing written. The reserve keeps tmpfs room for running VMs' RAM files.
    await needFreeSpace(
      parent.shape.shmRoot,
      "the fork's memory files on tmpfs",
      forkShmBytes(
        parent.shape.memMib,
        mode,
        method,
        method === "snapshot" ? await holeBytes(parent.memPath) : 0,
      ),
      o.freeBytes,
    );
  } catch (err) {
    return fail(asSnapshotError(err, "fork_failed", `forking VM ${parent.id} failed`));
  }
  const bad = parent.begin(["running"], "forking");
  if (bad) return fail(bad);
  const proc = parent.process;
  if (!proc) return fail(new SnapshotError("invalid_state", `VM ${parent.id} has no QEMU`));
  const s = parent.shape;
  const chain = await openChainStore(s.dataDir);
  const forkId = `${parent.id}-f${randomBytes(3).toString("hex")}`;
  const statePath = join(s.shmRoot, `${forkId}.state`);
  const disks = storageDir(s.dataDir);
  const frozen = parent.disk;
  const newTop = join(disks, `${parent.id}-${parent.generation + 1}.qcow2`);
  const newNode = `${parent.id}-n${parent.generation + 1}`;
  const t0 = performance.now();
  let stopTs: number | undefined;
  let resumeTs: number | undefined;
  const offStop = proc.qmp.on("STOP", (ev: QmpEvent) => {
    stopTs ??= eventTimeMs(ev);
  });
  const offResume = proc.qmp.on("RESUME", (ev: QmpEvent) => {
    if (stopTs !== undefined) resumeTs ??= eventTimeMs(ev);
  });
  let switched = false;
  let precopyMs = 0;
  let populateMs = 0;
  // The parent's jail sees only its own files: the new overlay is made in the storage directory,
  // owned by the parent's uid, hard-linked into the parent's directory (link(2) fails on a name
  // its QEMU planted, never follows it) and taken over by QEMU as an `existing` image there
  // (same file system: the data dir). The link stays while it is the parent's top: QEMU reopens
  // a node by its file name when it becomes a backing file (read-only) at the next fork, and
  // with the name gone it would keep writing it; that fork removes it.
  const staged = join(parent.dir, basename(newTop));
  let stateBytes = 0;
  let save: SaveStream | undefined;
  /** Moves the stopped parent onto its new overlay; the old one becomes the fork point's disk. */
  const switchDisk = async () => {
    await qmp(proc, "blockdev-snapshot-sync", {
      "node-name": parent.topNode,
      "snapshot-file": staged,
      "snapshot-node-name": newNode,
      format: "qcow2",
      mode: "existing",
    });
    switched = true;
  };
  try {
    await mkdir(s.shmRoot, { recursive: true, mode: 0o700 });
    await mkdir(disks, { recursive: true, mode: 0o700 });
    await createOverlayOn(frozen, newTop, await virtualSize(frozen));
    if (proc.jailUid !== undefined) await chown(newTop, proc.jailUid, proc.jailUid);
    await rm(staged, { force: true });
    await link(newTop, staged);
    if (method === "snapshot") {
      // -- 1. read in the unmapped pages while the guest runs (only a speed-up: QEMU maps the
      // rest itself, inside the stall)
      const tp = performance.now();
      await populateMapping(proc.pid, parent.memPath).catch((err) => log(`fork ${forkId}: populate: ${err}`));
      populateMs = performance.now() - tp;
      const refused = await setCapabilities(proc, {
        events: true,
        "x-ignore-shared": false,
        "pause-before-switchover": false,
        "background-snapshot": true,
      }).then(
        () => undefined,
        (err: unknown) => err,
      );
      if (refused) {
        if (!proc.isAlive()) throw refused;
        log(
          `fork ${forkId}: QEMU refused a background snapshot (${String(refused)}); stopping the parent for the copy`,
        );
        method = "stop-copy";
      }
    }
    if (method === "snapshot") {
      // The stream goes to tmpfs through the agent's socket: no bandwidth cap (migrate.ts).
      await setMigrationParameters(proc, { maxBandwidth: LOCAL_MIGRATION_MAX_BANDWIDTH });
      // -- 2. stop, move the parent onto its new overlay, snapshot: QEMU resumes the guest once
      // the RAM is write-protected
      await qmp(proc, "stop");
      await switchDisk();
      save = await startSave(proc, {
        path: statePath,
        maxBytes: migrationByteCap(s.memMib),
        timeoutMs: 2 * PRECOPY_TIMEOUT_MS,
        // A sink that fails (tmpfs full) must not fail QEMU's side midway: see stream.ts.
        drainOnError: true,
      });
      const tStream = performance.now();
      stateBytes = await save.finish();
      precopyMs = performance.now() - tStream;
      // QEMU 7.2 starts the guest when the RAM is protected; one that keeps a stopped guest
      // stopped (later versions restore the run state from before the snapshot) is started here.
      const st = await qmp<{ status: string }>(proc, "query-status");
      if (st.status !== "running") await qmp(proc, "cont");
    } else {
      // -- 1. live precopy (or, stop-copy, the whole copy with the guest stopped)
      const live = method === "precopy";
      await setCapabilities(proc, {
        events: true,
        "x-ignore-shared": false,
        "pause-before-switchover": true,
        "background-snapshot": false,
      });
      await setMigrationParameters(proc, {
        maxBandwidth: LOCAL_MIGRATION_MAX_BANDWIDTH,
        downtimeLimitMs: PRECOPY_DOWNTIME_LIMIT_MS,
      });
      if (!live) await qmp(proc, "stop");
      // A live precopy sends the pages the guest dirties meanwhile again: room for a second pass.
      save = await startSave(proc, {
        path: statePath,
        maxBytes: migrationByteCap(s.memMib, live ? 2 : 1),
        timeoutMs: 2 * PRECOPY_TIMEOUT_MS,
      });
      await save.waitFor(["pre-switchover"], PRECOPY_TIMEOUT_MS);
      precopyMs = performance.now() - t0;
      // -- 2. guest stopped: move the parent onto a new overlay; the old one is the fork's disk
      await switchDisk();
      // -- 3. finish the migration, 4. run again
      await qmp(proc, "migrate-continue", { state: "pre-switchover" });
      stateBytes = await save.finish();
      // The migration thread reports "completed" a moment before it moves the run state from
      // finish-migrate to postmigrate, and `cont` refuses finish-migrate ("not finalized yet").
      for (let i = 0; ; i++) {
        const st = await qmp<{ status: string }>(proc, "query-status");
        if (st.status !== "finish-migrate") break;
        if (i > FINALIZE_POLLS)
          throw new SnapshotError("fork_failed", "the parent's migration never finalized");
        await Bun.sleep(1);
      }
      await qmp(proc, "cont");
    }
    // Later migrations of this QEMU (suspend) set what they need; a snapshot's capability would
    // refuse theirs, so it is cleared here.
    if (method === "snapshot") await setCapabilities(proc, { "background-snapshot": false });
  } catch (err) {
    offStop();
    offResume();
    const e = asSnapshotError(err, "fork_failed", `forking VM ${parent.id} failed`);
    /** The new overlay joins the parent's chain if QEMU took it (removed with the parent), else goes. */
    const keepOrDropNewTop = async () => {
      if (switched) await adoptNewTop(parent, newTop, newNode).catch(() => {});
      else await Promise.all([rm(staged, { force: true }), rm(newTop, { force: true })]);
    };
    await save?.abort();
    await rm(statePath, { force: true });
    if (proc.isAlive()) {
      await proc.qmp.execute("migrate_cancel").catch(() => {});
      // A cancelled background snapshot may still be ending (its thread resumes the guest as it
      // unwinds); wait for it so the capability can be cleared and `cont` is not refused.
      await waitMigrationIdle(proc);
      await proc.qmp.execute("cont").catch(() => {});
      await setCapabilities(proc, { "background-snapshot": false }).catch(() => {});
      // A background snapshot that failed on QEMU's side (cancelled, a QEMU error) can leave a
      // vCPU blocked for good in a write fault (QEMU 7.2): the parent would look running and
      // never answer. It is ended instead, and the error says why; its record follows its exit.
      if (method === "snapshot" && switched && (await blockedInUserfault(proc.pid))) {
        log(`fork ${forkId}: the parent's vCPU stays blocked in a userfaultfd fault; ending the parent`);
        await adoptNewTop(parent, newTop, newNode).catch(() => {});
        await parent.destroy();
        return fail(
          new SnapshotError(
            "vm_died",
            `forking VM ${parent.id} failed (${e.message}) and left its guest blocked in a memory write fault; the VM was ended`,
            { cause: e },
          ),
        );
      }
      await keepOrDropNewTop();
      // QEMU can die while the cancel unwinds (a wedged one is killed by a QMP timeout, or it
      // exits on its own): its record already says dead, and the fork fails with what it was.
      if (parent.state === "dead" || !proc.isAlive()) {
        await parent.destroy();
        return fail(e);
      }
      parent.enter("running");
      return fail(e);
    }
    // QEMU is gone (killed at a QMP deadline, or died): its new overlay goes with it too.
    await keepOrDropNewTop();
    await parent.destroy();
    return fail(e);
  }
  // The guest runs again; wait briefly for RESUME's timestamp (it precedes cont's answer).
  for (let i = 0; i < 50 && resumeTs === undefined; i++) await Bun.sleep(2);
  offStop();
  offResume();
  const tResumed = performance.now();
  const parentStallMs = stopTs !== undefined && resumeTs !== undefined ? resumeTs - stopTs : -1;
  await adoptNewTop(parent, newTop, newNode);
  // Off the stall: the guest runs again, and only the new top's link is still needed.
  await removeStagedLinks(parent.dir, staged);
  parent.enter("running");
  await chmod(frozen, 0o444).catch(() => {});
  log(
    `fork ${forkId} (${method}): parent stalled ${parentStallMs.toFixed(1)} ms, populate ${populateMs.toFixed(0)} ms, copy ${precopyMs.toFixed(0)} ms, state ${stateBytes} B`,
  );
  // The fork point's files are held by the fork itself until every child holds its own.
  const forkHolder = `fork:${forkId}`;
  await chain.add(statePath, { kind: "state", holder: forkHolder, deps: [parent.memPath] });
  await chain.hold(forkHolder, [frozen]);
  // Keep the parent's own chain shallow. It runs meanwhile; the children wait (rare: once per
  // MAX_CHAIN_DEPTH forks of one VM).
  if (chain.depth(newTop) > MAX_CHAIN_DEPTH)
    await collapseParentChain(parent).catch((err) => log(`collapse: ${err}`));

  const children: SandboxVm[] = [];
  let forkPointMs = 0;
  try {
    // The children's disk base: the frozen overlay, or a flat copy of it past the bound.
    let childBase = frozen;
    if (chain.depth(frozen) >= MAX_CHAIN_DEPTH) {
      childBase = join(disks, `${forkId}-flat.qcow2`);
      await flattenOnto(frozen, s.baseDisk, childBase);
      await chain.add(childBase, { kind: "overlay", holder: forkHolder, depth: 1 });
    }

    let memPath = parent.memPath;
    let childState = statePath;
    let ignoreShared = false;
    if (mode === "shared") {
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
      Array.from({ length: o.count }, async (_, i) => {
        const id = o.ids?.[i] ?? newVmId();
        const disk = join(disks, `${id}-0.qcow2`);
        const child = new SandboxVm(id, join(vmsRoot(s.dataDir), id), s, disk, memPath, o.log);
        children.push(child);
        await chain.hold(child.holder, [childBase, memPath]);
        await createOverlayOn(childBase, disk, s.diskBytes);
        await chain.add(disk, { kind: "overlay", deps: [childBase], holder: child.holder });
        const timings = await restoreInto({
          vm: child,
          mem: { path: memPath, share: false },
          statePath: childState,
          ignoreShared,
          ...(o.readyTimeoutMs ? { readyTimeoutMs: o.readyTimeoutMs } : {}),
        });
        child.enter("running");
        return timings;
      }),
    );
    const failed = results.find((r) => r.status === "rejected");
    if (failed) throw (failed as PromiseRejectedResult).reason;
    const tDone = performance.now();
    await chain.release(forkHolder);
    return ok({
      children,
      timings: {
        parentStallMs,
        precopyMs,
        populateMs,
        method,
        stateBytes,
        forkPointMs,
        childrenReadyMs: tDone - t0,
        childrenAfterResumeMs: tDone - tResumed,
        children: results.map((r) => (r as PromiseFulfilledResult<RestoreTimings>).value),
        totalMs: tDone - t0,
        mode,
      },
    });
  } catch (err) {
    for (const c of children) await c.destroy();
    await chain.release(forkHolder);
    return fail(asSnapshotError(err, "fork_failed", `starting the children of ${parent.id} failed`));
  }
}

/** Removes the hard links earlier forks left in `dir` (see forkVm), all but `keep`. */
async function removeStagedLinks(dir: string, keep?: string): Promise<void> {
  for (const name of await readdir(dir)) {
    const p = join(dir, name);
    if (p === keep) continue;
    const st = await lstat(p).catch(() => undefined);
    if (st?.isFile() && st.nlink > 1) await rm(p, { force: true });
  }
}

/** Records the parent's move onto its new overlay (the old one stays, as its backing file). */
async function adoptNewTop(parent: SandboxVm, newTop: string, newNode: string): Promise<void> {
  const chain = await openChainStore(parent.shape.dataDir);
  const old = parent.disk;
  await chain.add(newTop, { kind: "overlay", deps: [old], holder: parent.holder });
  parent.disk = newTop;
  parent.topNode = newNode;
  parent.generation++;
  await chain.release(parent.holder, [old]);
}

/**
 * Shared mode: restore the full stream once into a new SHARED RAM file (tmpfs), never run it,
 * and save its device state with x-ignore-shared: a template of the fork point.
 */
async function makeForkPoint(
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
    await rm(point.dir, { recursive: true, force: true });
  }
}

/**
 * Collapses the running parent's chain onto the image base with `block-stream` (data of every
 * overlay between is copied into the top), then drops the overlays it no longer needs.
 */
async function collapseParentChain(parent: SandboxVm): Promise<void> {
  const proc = parent.process;
  if (!proc) return;
  const jobId = `stream-${parent.generation}`;
  const done = proc.qmp.waitEvent("BLOCK_JOB_COMPLETED", {
    timeoutMs: STREAM_TIMEOUT_MS,
    filter: (ev) => (ev.data as { device?: string } | undefined)?.device === jobId,
  });
  done.catch(() => {});
  await qmp(proc, "block-stream", { "job-id": jobId, device: parent.topNode, base: parent.shape.baseDisk });
  const ev = await done;
  const err = (ev.data as { error?: string } | undefined)?.error;
  if (err) throw new SnapshotError("fork_failed", `block-stream failed: ${err}`);
  const chain = await openChainStore(parent.shape.dataDir);
  await chain.setDeps(parent.disk, [], 1);
}

/** Cancelled migration's end: query-migrate polls, 5 ms apart (a cancel ends in a few ms). */
const CANCEL_POLLS = 400;

/** Waits (bounded, ~2 s) until no migration is running on `proc`; errors are left to the caller. */
async function waitMigrationIdle(proc: Parameters<typeof qmp>[0]): Promise<void> {
  for (let i = 0; i < CANCEL_POLLS; i++) {
    const info = await proc.qmp.execute<{ status?: string }>("query-migrate").catch(() => undefined);
    const st = info?.status;
    if (!st || st === "completed" || st === "failed" || st === "cancelled" || st === "none") return;
    await Bun.sleep(5);
  }
}
