/**
 * The end of a call on a sandbox (an exec, a file transfer, a fork), written behind: its begin is
 * a synchronous compare-and-set on the row (sandboxes/exec.ts beginActivity: the reaper must see the
 * call before it starts), but its end only lowers `execs_in_flight`, moves `last_exec_at` and
 * counts `exec_count`, so the ends of one sandbox are coalesced here and written in one UPDATE
 * every `ACTIVITY_FLUSH_MS` instead of one per call.
 *
 * Why nothing is lost that matters: until a row's ends are written its `execs_in_flight` is
 * higher than the truth, which only keeps every reaper away from it (never the other way). A
 * crash loses at most the last `ACTIVITY_FLUSH_MS` of ends: their `exec_count` increments, and
 * their in-flight counts, which the reapers already treat as lost once they are older than any
 * exec may run (sandboxes/reaping.ts idleClaimable). A graceful stop writes everything (`stop`). Usage
 * intervals and state changes never go through here: they stay synchronous.
 *
 * Reads by this process see their own ends at once (`overlay`), so an exec's count shows in the
 * next GET of the sandbox here; another gateway sees them within `ACTIVITY_FLUSH_MS`.
 */
import { eq, sql } from "drizzle-orm";
import { describeError } from "../../contracts/errors.ts";
import type { Db } from "../../db/client.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import type { RowCache } from "./row-cache.ts";

/**
 * How long an end may wait to be written: the most a crash loses, and how stale another
 * gateway's view of a busy sandbox's counts may be. 100 ms turns any rate of execs on one
 * sandbox into at most ten UPDATEs a second.
 */
export const ACTIVITY_FLUSH_MS = 100;

const later = (a: Date, b: Date): Date => (b.getTime() > a.getTime() ? b : a);

interface Pending {
  /** Calls ended: subtracted from `execs_in_flight`. */
  ended: number;
  /** Execs that succeeded: added to `exec_count`. */
  execs: number;
  /** The latest end: `last_exec_at` moves to it (never back). */
  lastAt: Date;
}

export class ActivityWriter {
  private pending = new Map<string, Pending>();
  private timer: ReturnType<typeof setTimeout> | undefined;
  private flushing: Promise<void> | undefined;
  private stopped = false;
  /** UPDATEs written (tests and measurements). */
  writes = 0;
  /** The process's row cache: a written row is dropped from it (row-cache.ts). */
  rows: RowCache | undefined;

  constructor(
    private readonly db: Db,
    private readonly log: (line: string) => void = () => {},
    private readonly flushMs = ACTIVITY_FLUSH_MS,
  ) {}

  /** Records the end of a call on sandbox `id` at `at`; `execDone` counts a successful exec. */
  end(id: string, at: Date, execDone: boolean): void {
    const p = this.pending.get(id);
    if (p) {
      p.ended++;
      if (execDone) p.execs++;
      p.lastAt = later(p.lastAt, at);
    } else this.pending.set(id, { ended: 1, execs: execDone ? 1 : 0, lastAt: at });
    if (this.stopped) {
      void this.flush();
      return;
    }
    this.timer ??= setTimeout(() => {
      this.timer = undefined;
      void this.flush();
    }, this.flushMs);
  }

  /** `row` as it is once this process's pending ends are written. */
  overlay<R extends { id: string; execsInFlight: number; execCount: number; lastExecAt: Date | null }>(
    row: R,
  ): R {
    const p = this.pending.get(row.id);
    if (!p) return row;
    return {
      ...row,
      execsInFlight: Math.max(0, row.execsInFlight - p.ended),
      execCount: row.execCount + p.execs,
      lastExecAt: row.lastExecAt === null ? p.lastAt : later(row.lastExecAt, p.lastAt),
    };
  }

  /** Writes every pending end now (the reaper's pass starts with this; so does `stop`). */
  async flush(): Promise<void> {
    // One flush at a time: a second waits for the first, then writes what came meanwhile.
    while (this.flushing) await this.flushing;
    if (this.pending.size === 0) return;
    const batch = this.pending;
    this.pending = new Map();
    this.flushing = this.write(batch).finally(() => {
      this.flushing = undefined;
    });
    await this.flushing;
  }

  /** Writes what is pending and writes later ends at once (the server is stopping). */
  async stop(): Promise<void> {
    this.stopped = true;
    clearTimeout(this.timer);
    this.timer = undefined;
    await this.flush();
  }

  private async write(batch: Map<string, Pending>): Promise<void> {
    for (const [id, p] of batch) {
      try {
        this.writes++;
        await this.db
          .update(sandboxes)
          .set({
            execsInFlight: sql`greatest(${sandboxes.execsInFlight} - ${p.ended}::int, 0)`,
            lastExecAt: sql`greatest(${sandboxes.lastExecAt}, ${p.lastAt.toISOString()}::timestamptz)`,
            execCount: sql`${sandboxes.execCount} + ${p.execs}::int`,
          })
          .where(eq(sandboxes.id, id))
          .finally(() => this.rows?.invalidate(id));
      } catch (err) {
        // The database is away: keep the ends for the next flush (a count kept high only keeps
        // the reapers off the sandbox meanwhile).
        this.log(`activity: ${id}: ${describeError(err)}`);
        const now = this.pending.get(id);
        this.pending.set(
          id,
          now
            ? {
                ended: now.ended + p.ended,
                execs: now.execs + p.execs,
                lastAt: later(now.lastAt, p.lastAt),
              }
            : p,
        );
        if (!this.stopped) {
          this.timer ??= setTimeout(() => {
            this.timer = undefined;
            void this.flush();
          }, this.flushMs);
        }
      }
    }
  }
}
