/**
 * Sandbox and session rows served from memory to the reads that only show a row (`GET
 * /v1/sandboxes/{id}`, `GET /v1/sessions/{id}`), so that an authenticated read costs no database
 * round trip. Keyed by id only: the tenant and API check stays on every read of a cached row
 * (sandboxes/records.ts getOwned), so tenant B is answered 404 for tenant A's row as before.
 *
 * Invalidation: a trigger on the table (migration 0007) NOTIFYs `sandboxes_changed` with the id
 * of every row inserted, updated or deleted, by anyone; each gateway LISTENs (db/client.ts
 * `listen`) and drops that id. The cache serves only while the LISTEN is in effect: before it is
 * confirmed, and from the moment its connection is lost until it is confirmed again, every read
 * goes to the database, and the cache is emptied at each change of that state (notifications
 * were, or may have been, lost meanwhile). This process's own writes also drop their ids at once
 * (`forgetRows`), so a client sees its own change on its next read here even before the
 * notification comes back.
 *
 * A read that raced a change: a row read from the database is kept only if no invalidation of its
 * id came after the read began (`begin` / `put`), else a read that started before a change and
 * answered after its notification would put the old row back for good (core/invalidations.ts,
 * which the key cache shares).
 */
import type { sandboxes } from "../../db/schema/sandboxes.ts";
import { Invalidations } from "./invalidations.ts";

type Row = typeof sandboxes.$inferSelect;

/** The channel the migration's trigger notifies, payload: the row's id. */
export const ROWS_CHANNEL = "sandboxes_changed";

/**
 * Rows held at most: a row is ~1-2 KB with its labels and endpoints, so 10,000 rows cost ~10-20
 * MB, and 10,000 is past the sandboxes one gateway's clients read in any short while; past it the
 * least recently read row goes (its next read costs one query).
 */
export const ROW_CACHE_MAX = 10_000;
export class RowCache {
  private readonly rows = new Map<string, Readonly<Row>>();
  /** The LISTEN's state and the ids notified as changed (shared with the key cache's kind). */
  private readonly changes = new Invalidations({
    invalidate: (id) => this.rows.delete(id),
    // Emptied at each change of the LISTEN's state: notifications were, or may have been, missed.
    reset: () => this.rows.clear(),
  });
  /** Reads answered from memory / from the database (tests and measurements). */
  hits = 0;
  misses = 0;

  constructor(private readonly max = ROW_CACHE_MAX) {}

  /** Whether reads are served from memory now (the LISTEN is in effect). */
  get serving(): boolean {
    return this.changes.serving;
  }

  get size(): number {
    return this.rows.size;
  }

  /** The row of `id` if held and serving; the caller still checks its tenant. */
  get(id: string): Readonly<Row> | undefined {
    if (!this.changes.serving) return undefined;
    const row = this.rows.get(id);
    if (row === undefined) return undefined;
    // Least recently read goes first: a read moves its row to the end of the Map's order.
    this.rows.delete(id);
    this.rows.set(id, row);
    this.hits++;
    return row;
  }

  /** Before a database read whose row may be `put`: the mark `put` checks. */
  begin(): number {
    this.misses++;
    return this.changes.begin();
  }

  /** Keeps `row`, read from the database after `begin` gave `mark`, unless it changed since. */
  put(row: Row, mark: number): void {
    if (!this.changes.unchanged(row.id, mark)) return;
    this.rows.delete(row.id);
    if (this.rows.size >= this.max) {
      // Maps iterate in insertion order: the first is the least recently read.
      const oldest = this.rows.keys().next().value;
      if (oldest !== undefined) this.rows.delete(oldest);
    }
    this.rows.set(row.id, Object.freeze(row));
  }

  /** The row of `id` changed (a notification, or this process's own write). */
  invalidate(id: string): void {
    this.changes.invalidate(id);
  }

  /** The channel's events (db/client.ts `listen`). */
  get events(): Invalidations["events"] {
    return this.changes.events;
  }
}

/** Drops `ids` from the process's cache, if any: call after a write to their rows commits. */
export function forgetRows(deps: { rows?: RowCache | undefined }, ...ids: string[]): void {
  const rows = deps.rows;
  if (rows === undefined) return;
  for (const id of ids) rows.invalidate(id);
}
