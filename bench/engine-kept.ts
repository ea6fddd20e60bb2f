/**
 * The kept-snapshot figures of an engine run (docs/benchmarks.md "Kept snapshots and restore in
 * place"): one snapshot of a running sandbox kept (keep.ts `keepVm`), that sandbox rolled back to
 * it in place several times (`restoreInPlace`) as the agent does it (a standby QEMU armed after
 * the snapshot and after each rollback, standby.ts) and a few times cold (no standby: the QEMU
 * launched on the spot), and VMs started from it (`startFromKept`). Every
 * VM is tracked by the run's scope; the snapshot lives in the run's scratch data dir and is
 * dropped before the step returns (the scope's cleanup removes its files on an error).
 */
import { unwrap } from "../agent/snapshot/errors.ts";
import type { ForkMethod } from "../agent/snapshot/fork-method.ts";
import { dropKept, keepVm, restoreInPlace, startFromKept } from "../agent/snapshot/keep.ts";
import { armStandby } from "../agent/snapshot/standby.ts";
import { newVmId } from "../agent/vm/ids.ts";
import { SandboxdError } from "../contracts/errors.ts";
import { runTrue } from "./engine-scope.ts";
import type { Run, Spawner } from "./engine-steps.ts";
import { type Summary, summarize } from "./stats.ts";

/**
 * Timed rollbacks of the one sandbox to the one snapshot, after one untimed (the first pays for
 * cold code paths, as the spawns' untimed round does): 5 give a p50 at ~250 ms each under TCG,
 * ~1.5 s of the run.
 */
export const KEPT_ROLLBACKS = 5;
/** Timed cold rollbacks (no standby): 3 give a p50 and add ~0.5 s to the run. */
export const KEPT_COLD_ROLLBACKS = 3;
/** Timed starts of a new VM from the snapshot: 3 give a p50 and add ~1 s to the run. */
export const KEPT_STARTS = 3;
/** Untimed `true` runs on the source before the snapshot, so that it is taken of a sandbox that ran something. */
const SOURCE_WARMUP = 3;
/** The snapshot's name (keep.ts KEPT_REF); unique within the run's own scratch data dir. */
const REF = "snap_bench";

export interface KeptFigures {
  stallMs: number;
  takeMs: number;
  bytes: number;
  rollbackMs: Summary;
  downMs: Summary;
  coldRollbackMs: Summary;
  /** No launch: the standby's was done before the call. */
  parts: { load: Summary; hello: Summary; identity: Summary };
  fromSnapshotMs: Summary;
}

/**
 * A fresh sandbox from the template (not the fork parent, whose chain the forks deepened: a
 * snapshot past the depth bound is flattened, which would time a copy instead), a `true` run on it
 * a few times, the snapshot taken by `method` (the forks' method, so its stall compares with
 * theirs), the rollbacks, each checked by a `true` after it (untimed), then the starts, each
 * checked the same way.
 */
export async function measureKept(run: Run, sp: Spawner, method: ForkMethod): Promise<KeptFigures> {
  const { scope, log } = run;
  const source = (await sp.spawn()).vm;
  for (let i = 0; i < SOURCE_WARMUP; i++) await runTrue(source, run.config);
  scope.check();
  const t0 = performance.now();
  const kept = unwrap(await keepVm(source, REF, { method, notes: {} }));
  const takeMs = performance.now() - t0;
  const { record, parentStallMs } = kept;
  try {
    const totals: number[] = [];
    const downs: number[] = [];
    const load: number[] = [];
    const hello: number[] = [];
    const identity: number[] = [];
    for (let i = 0; i <= KEPT_ROLLBACKS; i++) {
      scope.check();
      // As the agent does: a standby armed for the next rollback. It is waited for before the
      // timed call: a user's next rollback comes after some work in the sandbox, not within the
      // standby's ~100 ms launch (a rollback that comes sooner waits for it).
      armStandby(source, record);
      if (!(await source.standby))
        throw new SandboxdError("internal", "no standby QEMU could be launched for the rollback");
      const r = unwrap(await restoreInPlace(source, record, { sameMachine: true }));
      if (!r.standby) throw new SandboxdError("internal", "the rollback did not take its standby");
      await runTrue(source, run.config);
      if (i === 0) continue;
      totals.push(r.totalMs);
      downs.push(r.downMs);
      load.push(r.timings.incomingMs);
      hello.push(r.timings.helloMs);
      identity.push(r.timings.identityMs);
    }
    const cold: number[] = [];
    for (let i = 0; i < KEPT_COLD_ROLLBACKS; i++) {
      scope.check();
      const r = unwrap(await restoreInPlace(source, record, { sameMachine: true }));
      await runTrue(source, run.config);
      cold.push(r.totalMs);
    }
    await scope.release(source);
    const starts: number[] = [];
    for (let i = 0; i < KEPT_STARTS; i++) {
      scope.check();
      const s = unwrap(await startFromKept(record, newVmId(), { host: run.host }));
      scope.track(s.vm);
      await runTrue(s.vm, run.config);
      starts.push(s.timings.readyMs);
      await scope.release(s.vm);
    }
    const figures: KeptFigures = {
      stallMs: parentStallMs,
      takeMs,
      bytes: record.sizeBytes,
      rollbackMs: summarize(totals),
      downMs: summarize(downs),
      coldRollbackMs: summarize(cold),
      parts: {
        load: summarize(load),
        hello: summarize(hello),
        identity: summarize(identity),
      },
      fromSnapshotMs: summarize(starts),
    };
    log(
      `kept snapshot: stall ${parentStallMs.toFixed(1)} ms, taken in ${takeMs.toFixed(0)} ms, ${record.sizeBytes} B; ` +
        `restore in place p50 ${figures.rollbackMs.p50} ms (down ${figures.downMs.p50} ms; cold ${figures.coldRollbackMs.p50} ms); ` +
        `a VM from it p50 ${figures.fromSnapshotMs.p50} ms`,
    );
    return figures;
  } finally {
    if (scope.vms.has(source)) await scope.release(source);
    await dropKept(run.dataDir, REF);
  }
}
