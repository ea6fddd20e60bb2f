/**
 * What the in-memory caches kept true by NOTIFY share (core/row-cache.ts for sandbox rows,
 * auth/key-cache.ts for verified keys): whether the LISTEN is in effect, and which ids were
 * notified as changed since a given database read began.
 *
 * A cache asks `begin()` before it reads a row from the database and `unchanged(id, mark)` before
 * it keeps what it read: a read that began before a change and answered after its notification
 * would otherwise put the old row back for good. `covers(mark)` says whether every change since
 * `mark` reaches this process as a notification (the LISTEN is in effect and has not been lost
 * and regained since), which is what lets a cache trust an entry past its short TTL.
 *
 * The LISTEN itself: db/client.ts `listen`, one connection for all channels; each channel's
 * events go to the `events` of its cache's `Invalidations`.
 */
import type { ChannelEvents } from "../../db/client.ts";

/**
 * Invalidations remembered per id for reads in flight (see `unchanged`); an older one is
 * remembered only as "some id changed before this", which makes reads begun before it not keep
 * their row (they still answer). Reads in flight last milliseconds, so a few thousand ids is far
 * more than enough.
 */
const RECENT_MAX = 4096;

export class Invalidations {
  /** Invalidations and state changes so far; `begin` hands out the current count. */
  private seq = 0;
  /** The last invalidation of each recently changed id. */
  private readonly recent = new Map<string, number>();
  /** A read begun before this may not keep its row: what changed then is no longer in `recent`. */
  private floor = 0;
  /** The mark of the last change of the LISTEN's state (up or down). */
  private lastReset = 0;
  private listening = false;

  constructor(
    private readonly on: {
      /** `id` changed: drop what is held of it. */
      invalidate(id: string): void;
      /** The LISTEN came (`true`) or went (`false`): notifications were, or may have been, lost. */
      reset(listening: boolean): void;
    },
  ) {}

  /** Whether the LISTEN is in effect now. */
  get serving(): boolean {
    return this.listening;
  }

  /** Before a database read whose row may be kept: the mark `unchanged` and `covers` check. */
  begin(): number {
    return this.seq;
  }

  /**
   * Whether a row of `id` read after `begin` gave `mark` may be kept: the LISTEN is in effect, has
   * not changed state since, and no change of `id` was notified since.
   */
  unchanged(id: string, mark: number): boolean {
    if (!this.listening || mark < this.floor) return false;
    const changed = this.recent.get(id);
    return changed === undefined || changed <= mark;
  }

  /** Whether every change since `mark` reaches this process as a notification. */
  covers(mark: number): boolean {
    return this.listening && mark >= this.lastReset;
  }

  /** `id` changed (a notification, or this process's own write). */
  invalidate(id: string): void {
    const seq = ++this.seq;
    this.on.invalidate(id);
    this.recent.delete(id);
    this.recent.set(id, seq);
    if (this.recent.size > RECENT_MAX) {
      const [oldId, oldSeq] = this.recent.entries().next().value!;
      this.recent.delete(oldId);
      this.floor = oldSeq;
    }
  }

  /** The channel's events (db/client.ts `listen`); the cause of a loss does not matter here. */
  readonly events: ChannelEvents & { down(cause?: unknown): void } = {
    notify: (payload: string) => this.invalidate(payload),
    up: () => this.reset(true),
    down: () => this.reset(false),
  };

  /** Refuses every read in flight: notifications were (down) or may have been (up) missed. */
  private reset(listening: boolean): void {
    this.listening = listening;
    this.recent.clear();
    this.floor = this.lastReset = ++this.seq;
    this.on.reset(listening);
  }
}
