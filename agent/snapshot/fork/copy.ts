/**
 * The copy of a running parent's memory into the fork point (`<fork>.mem`, its RAM, and
 * `<fork>.state`, its device state, split from QEMU's stream by ram-split.ts), by one of three methods
 * (fork-method.ts says when each is used):
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
 *   3. The RAM streams into the fork point (ram-split.ts) while the guest runs: a page the guest writes is copied out
 *      first, so the stream is the RAM at the stop. No `cont` is needed: the disks stay active.
 *
 * `stop-copy`: stop, snapshot the disk, migrate the whole RAM, cont (the stall is the whole copy).
 *
 * `precopy`, a live precopy with dirty tracking:
 *
 *   1. `pause-before-switchover` on, bandwidth unlimited, `migrate` into a socket the agent copies
 *      to the fork point (stream.ts, ram-split.ts): RAM streams to tmpfs WHILE the guest runs (dirty pages are sent
 *      again).
 *   2. QEMU stops the guest for the switchover and pauses in `pre-switchover`. The STOP event
 *      starts the stall. Now `blockdev-snapshot-sync` moves the parent onto a NEW overlay: its
 *      old overlay becomes the frozen disk of the fork point (the backing file of every child).
 *   3. `migrate-continue`: the last dirty pages and the device state are written, the migration
 *      completes (and QEMU inactivates the block nodes).
 *   4. `cont`: QEMU re-activates the block nodes (qmp_cont's bdrv_activate_all) and the guest
 *      runs again. RESUME ends the stall. Stall = RESUME - STOP, both QEMU event timestamps.
 */

import { DEVICE_IDS, type VmProcess } from "../../qemu/launch.ts";
import type { QmpEvent } from "../../qemu/qmp/framing.ts";
import { SnapshotError } from "../errors.ts";
import type { ForkMethod } from "../fork-method.ts";
import {
  eventTimeMs,
  LOCAL_MIGRATION_MAX_BANDWIDTH,
  type MigrateInfo,
  qmp,
  setCapabilities,
  setMigrationParameters,
} from "../migrate.ts";
import { populateMapping } from "../populate.ts";
import type { SplitTarget } from "../ram-split.ts";
import { migrationByteCap, type SaveStream, startSave } from "../stream.ts";
import type { SandboxVm } from "../vm.ts";

/**
 * Largest stall QEMU plans for when it decides to switch over (remaining dirty bytes / measured
 * bandwidth). 50 ms: a guest under TCG dirties few MB/s, so the first pass already fits.
 */
const PRECOPY_DOWNTIME_LIMIT_MS = 50;
/** Whole precopy of a 256 MiB guest: ~0.3-0.6 s under TCG; a minute means something is stuck. */
export const PRECOPY_TIMEOUT_MS = 60_000;

/** query-status polls (1 ms apart) for the finish-migrate -> postmigrate step: ~1 ms in practice. */
const FINALIZE_POLLS = 2000;

/**
 * A fork in flight, up to the parent running again: what the copy was given, and what it has
 * done so far (the rollback reads it when the copy fails).
 */
export interface ForkRun {
  parent: SandboxVm;
  proc: VmProcess;
  forkId: string;
  /**
   * The fork point on tmpfs, split from the stream as it arrives (ram-split.ts): `memPath` holds
   * the parent's RAM at the fork point, `statePath` its device state in the x-ignore-shared form
   * that a QEMU mapping `memPath` private loads.
   */
  memPath: string;
  statePath: string;
  /** The parent's new overlay in the storage directory, and its node name once QEMU takes it. */
  newTop: string;
  newNode: string;
  /** The new overlay's hard link in the parent's directory, the name QEMU opens. */
  staged: string;
  t0: number;
  /** performance.now() when the copy began: the parent's stop, or a live precopy's `migrate`. */
  tCopy: number;
  log: (m: string) => void;
  /** The method in use: a snapshot QEMU refuses falls back to stop-copy. */
  method: ForkMethod;
  /** Whether QEMU moved the parent onto its new overlay. */
  switched: boolean;
  save?: SaveStream;
  /**
   * Called once the parent runs again, while its RAM may still stream (a background snapshot):
   * what can start before the fork point is whole starts here (fork.ts: the children's QEMUs).
   */
  onResumed?: () => void;
  precopyMs: number;
  populateMs: number;
  stateBytes: number;
}

/** The fork point's two files, written from the stream as it arrives. */
function splitTarget(run: ForkRun): SplitTarget {
  return {
    ramBlock: DEVICE_IDS.memBackend,
    ramBytes: run.parent.shape.memMib * 1024 * 1024,
    ramPath: run.memPath,
    statePath: run.statePath,
  };
}

/** Copies the parent's memory by `run.method`; the parent runs again when it returns. */
export async function copyParentMemory(run: ForkRun): Promise<void> {
  if (run.method === "snapshot") await copyByBackgroundSnapshot(run);
  else await copyThroughSwitchover(run, run.method === "precopy");
}

/** Moves the stopped parent onto its new overlay; the old one becomes the fork point's disk. */
async function switchDisk(run: ForkRun): Promise<void> {
  await qmp(run.proc, "blockdev-snapshot-sync", {
    "node-name": run.parent.topNode,
    "snapshot-file": run.staged,
    "snapshot-node-name": run.newNode,
    format: "qcow2",
    mode: "existing",
  });
  run.switched = true;
}

async function copyByBackgroundSnapshot(run: ForkRun): Promise<void> {
  const { proc, forkId, log } = run;
  // -- 1. read in the unmapped pages while the guest runs (only a speed-up: QEMU maps the
  // rest itself, inside the stall)
  const tp = performance.now();
  await populateMapping(proc.pid, run.parent.memPath).catch((err) => log(`fork ${forkId}: populate: ${err}`));
  run.populateMs = performance.now() - tp;
  const refused = await setCapabilities(proc, {
    events: true,
    // The stream's header form the children load (ram-split.ts); no block is ignored, as the
    // parent maps its RAM private.
    "x-ignore-shared": true,
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
    run.method = "stop-copy";
    return copyThroughSwitchover(run, false);
  }
  // The stream goes to tmpfs through the agent's socket: no bandwidth cap (migrate.ts).
  await setMigrationParameters(proc, { maxBandwidth: LOCAL_MIGRATION_MAX_BANDWIDTH });
  // -- 2. stop, move the parent onto its new overlay, snapshot: QEMU resumes the guest once
  // the RAM is write-protected
  run.tCopy = performance.now();
  await qmp(proc, "stop");
  await switchDisk(run);
  run.save = await startSave(proc, {
    path: run.statePath,
    split: splitTarget(run),
    maxBytes: migrationByteCap(run.parent.shape.memMib),
    timeoutMs: 2 * PRECOPY_TIMEOUT_MS,
    // A sink that fails (tmpfs full) must not fail QEMU's side midway: see stream.ts.
    drainOnError: true,
  });
  const tStream = performance.now();
  await contOnceProtected(run);
  run.onResumed?.();
  run.stateBytes = await run.save.finish();
  run.precopyMs = performance.now() - tStream;
  // A save that ended before the wait above saw it: the guest runs again either way.
  const st = await qmp<{ status: string }>(proc, "query-status");
  if (st.status !== "running") await qmp(proc, "cont");
  // Later migrations of this QEMU (suspend) set what they need; a snapshot's capability would
  // refuse theirs, so it is cleared here.
  await setCapabilities(proc, { "background-snapshot": false });
}

/**
 * How long the guest may stay stopped waiting for QEMU to protect its RAM before the wait gives
 * up and leaves the start to the end of the save: the device state of a 256 MiB microvm saves in
 * a few ms; a loaded 2-core host has taken ~100 ms.
 */
const PROTECT_WAIT_MS = 2_000;
/** Between two looks at the save: each look is two QMP round trips (~0.2 ms on an idle host). */
const PROTECT_POLL_MS = 1;

/**
 * Starts the guest once QEMU has write-protected its RAM. QEMU 7.2 starts it itself at that
 * point; QEMU >= 8.2 puts back the run state from before the snapshot, which is "paused" here
 * (the agent stopped the guest to move its disk), so without this the guest would stay stopped
 * for the whole RAM copy (measured with QEMU 10.0: a 2.2 s stall instead of ~15 ms). QEMU saves
 * the device state and protects the RAM before it sends the first page, all under its big lock,
 * so once a page is counted sent (`ram.normal` or `ram.duplicate`) the snapshot's point is fixed
 * and the guest's writes only fault copies out.
 */
async function contOnceProtected(run: ForkRun): Promise<void> {
  const { proc } = run;
  const deadline = performance.now() + PROTECT_WAIT_MS;
  while (performance.now() < deadline) {
    const st = await qmp<{ status: string }>(proc, "query-status");
    if (st.status === "running") return; // QEMU 7.2 started it
    const info = await qmp<MigrateInfo>(proc, "query-migrate");
    const sent = (info.ram?.normal ?? 0) + (info.ram?.duplicate ?? 0);
    if (sent > 0 || info.status === "completed") {
      await qmp(proc, "cont");
      return;
    }
    // A failed or cancelled save is the save's to report (finish), and the caller's to undo.
    if (info.status === "failed" || info.status === "cancelled") return;
    await new Promise((resolve) => setTimeout(resolve, PROTECT_POLL_MS));
  }
}

/** `precopy` (live: the guest runs during the first pass) and `stop-copy` (stopped throughout). */
async function copyThroughSwitchover(run: ForkRun, live: boolean): Promise<void> {
  const { proc } = run;
  // -- 1. live precopy (or, stop-copy, the whole copy with the guest stopped)
  await setCapabilities(proc, {
    events: true,
    "x-ignore-shared": true,
    "pause-before-switchover": true,
    "background-snapshot": false,
  });
  await setMigrationParameters(proc, {
    maxBandwidth: LOCAL_MIGRATION_MAX_BANDWIDTH,
    downtimeLimitMs: PRECOPY_DOWNTIME_LIMIT_MS,
  });
  run.tCopy = performance.now();
  if (!live) await qmp(proc, "stop");
  // A live precopy sends the pages the guest dirties meanwhile again: room for a second pass.
  run.save = await startSave(proc, {
    path: run.statePath,
    split: splitTarget(run),
    maxBytes: migrationByteCap(run.parent.shape.memMib, live ? 2 : 1),
    timeoutMs: 2 * PRECOPY_TIMEOUT_MS,
  });
  await run.save.waitFor(["pre-switchover"], PRECOPY_TIMEOUT_MS);
  run.precopyMs = performance.now() - run.t0;
  // -- 2. guest stopped: move the parent onto a new overlay; the old one is the fork's disk
  await switchDisk(run);
  // -- 3. finish the migration, 4. run again
  await qmp(proc, "migrate-continue", { state: "pre-switchover" });
  run.stateBytes = await run.save.finish();
  // The migration thread reports "completed" a moment before it moves the run state from
  // finish-migrate to postmigrate, and `cont` refuses finish-migrate ("not finalized yet").
  for (let i = 0; ; i++) {
    const st = await qmp<{ status: string }>(proc, "query-status");
    if (st.status !== "finish-migrate") break;
    if (i > FINALIZE_POLLS) throw new SnapshotError("fork_failed", "the parent's migration never finalized");
    await Bun.sleep(1);
  }
  await qmp(proc, "cont");
  run.onResumed?.();
}

/** The parent's stall, from QEMU's STOP and RESUME event timestamps. */
export interface StallWatch {
  /** Waits briefly for RESUME's timestamp, stops watching; the stall in ms, -1 when unknown. */
  settle(): Promise<number>;
  off(): void;
}

export function watchStall(proc: VmProcess): StallWatch {
  let stopTs: number | undefined;
  let resumeTs: number | undefined;
  const offStop = proc.qmp.on("STOP", (ev: QmpEvent) => {
    stopTs ??= eventTimeMs(ev);
  });
  const offResume = proc.qmp.on("RESUME", (ev: QmpEvent) => {
    if (stopTs !== undefined) resumeTs ??= eventTimeMs(ev);
  });
  const off = () => {
    offStop();
    offResume();
  };
  return {
    off,
    async settle() {
      // The guest runs again; wait briefly for RESUME's timestamp (it precedes cont's answer).
      for (let i = 0; i < 50 && resumeTs === undefined; i++) await Bun.sleep(2);
      off();
      return stopTs !== undefined && resumeTs !== undefined ? resumeTs - stopTs : -1;
    },
  };
}
