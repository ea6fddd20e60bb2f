/**
 * The sandbox records: the kinds, the lookup of a tenant's own record (a foreign or gone id is 404),
 * the state check every action makes (record-states.ts), the agent a record names, the usage
 * intervals that meter it, and the client's terms for an agent's errors.
 */
import { and, eq, inArray, isNull, type SQL, sql } from "drizzle-orm";
import type { AgentVmApi, VmResources } from "../../../contracts/agent/api.ts";
import type { KeyApi, Tier } from "../../../contracts/api/tiers.ts";
import { SandboxdError } from "../../../contracts/errors.ts";
import type { Db } from "../../../db/client.ts";
import { sandboxes } from "../../../db/schema/sandboxes.ts";
import { usageIntervals } from "../../../db/schema/usage-intervals.ts";
import type { Principal } from "../../auth/keys.ts";
import type { Deps } from "../../deps.ts";
import { notFound } from "../../errors.ts";
import { afterPosition, cursorKey, decodeCursor, encodeCursor, filtersDigest, pageOf } from "../paging.ts";
import { checkRecordAction, type RecordAction, type RecordState } from "../record-states.ts";
import type { RowCache } from "../row-cache.ts";
import type { Tx } from "../tenant-lock.ts";

export type SandboxRow = typeof sandboxes.$inferSelect;
export type Kind = "session" | "sandbox" | "exec";
/** The kinds that hold a VM past one call. */
export type VmKind = Exclude<Kind, "exec">;

export const LIVE: RecordState[] = ["starting", "running", "suspended"];

/** The record's state must allow `action` (record-states.ts); the refusal is thrown as is. */
export function requireAllowed(id: string, state: RecordState, action: RecordAction): void {
  const check = checkRecordAction(id, state, action);
  if (!check.ok) throw check.error;
}

/** The agent a sandbox lives on: the one recorded on its row (gateway/agents/placement.ts). */
export function agentOf(deps: Deps, row: Pick<SandboxRow, "agentId">): AgentVmApi {
  return deps.placement.agentFor(row.agentId);
}

/**
 * A record owned by the caller, in the caller's API; anything else is 404 (docs/keys-and-auth.md "Rules of authentication").
 * `cached`: the row may come from this process's row cache (row-cache.ts), for the reads that only
 * show it; a call that acts on the row next reads the database, since a row another gateway
 * changed a moment ago would turn its compare-and-set into a 409 it need not be.
 */
export async function getOwned(
  deps: Deps,
  p: Principal,
  id: string,
  opts: { cached?: boolean } = {},
): Promise<SandboxRow> {
  const read = opts.cached && deps.rows ? await cachedRow(deps.rows, deps.db, id) : await rowOf(deps.db, id);
  // The owner check, on a cached row as on one just read: the cache is keyed by id alone.
  const owned = read && read.tenantId === p.tenantId && read.api === p.api ? read : undefined;
  // This process's ends not yet written count as written (core/activity.ts).
  const row = owned && deps.activity ? deps.activity.overlay(owned) : owned;
  const what = p.api === "sessions" ? `session ${id}` : `sandbox ${id}`;
  if (!row) throw notFound(what);
  if (row.state === "destroyed") {
    // The sessions API: a reclaimed session answers 410 (docs/sessions.md "Rules of the sessions API"; docs/api.md "Rules every route shares"); deleted ones are simply gone.
    if (row.api === "sessions" && row.endReason === "reaped") {
      throw new SandboxdError("gone", `${what} was reclaimed after being idle`);
    }
    // The sandboxes API: one its idle lifetime deleted is gone like a deleted one (404), said why.
    if (row.endReason === "reaped") {
      throw new SandboxdError("not_found", `${what} was deleted after being idle`);
    }
    // Deleted at its absolute deadline (`on_timeout: delete`): gone like a deleted one, said why.
    if (row.endReason === "expired") {
      throw new SandboxdError("not_found", `${what} was deleted at its timeout`);
    }
    // Its host agent went silent past the lost bound: answered here, the agent is never asked
    // (docs/fleet.md "Losing a host").
    if (row.endReason === "host_lost") {
      throw new SandboxdError(
        "not_found",
        `${what} ended: its host was lost (${row.endDetail ?? "host_lost"})`,
      );
    }
    throw notFound(what);
  }
  return row;
}

async function rowOf(db: Db, id: string): Promise<SandboxRow | undefined> {
  const [row] = await db.select().from(sandboxes).where(eq(sandboxes.id, id));
  return row;
}

async function cachedRow(rows: RowCache, db: Db, id: string): Promise<SandboxRow | undefined> {
  const hit = rows.get(id);
  if (hit !== undefined) return hit;
  const mark = rows.begin();
  const row = await rowOf(db, id);
  if (row) rows.put(row, mark);
  return row;
}

/** A list's filters (docs/lists.md), parsed: all AND-ed. */
export interface ListFilter {
  /** Label pairs every row must hold. */
  labels?: Record<string, string>;
  /** One public state; absent: both live ones. */
  state?: "running" | "suspended";
  templateId?: string;
}

/** Rows a list shows: live ones only; a row being created (`starting`) shows once it runs. */
const LISTED: RecordState[] = ["running", "suspended"];

/**
 * One page of the caller's own live records in its API, oldest first by (created_at, id)
 * (gateway/core/paging.ts). `cursor` is the previous page's `next` for the same filters; a bad one
 * is 400 before the database is asked. The tenant and API conditions apply whatever it says.
 */
export async function listOwnedPage(
  deps: Deps,
  p: Principal,
  filter: ListFilter,
  page: { limit: number; cursor?: string | undefined },
): Promise<{ rows: SandboxRow[]; next: string | null }> {
  const key = cursorKey(deps.config.keyPepper);
  const labelPairs = Object.entries(filter.labels ?? {}).map(([k, v]) => `${k}:${v}`);
  const scope = {
    owner: `${p.tenantId}/${p.api}`,
    digest: filtersDigest(p.api, { label: labelPairs, state: filter.state, template: filter.templateId }),
  };
  const after = page.cursor !== undefined ? decodeCursor(key, scope, page.cursor) : undefined;
  const conds: SQL[] = [
    eq(sandboxes.tenantId, p.tenantId),
    eq(sandboxes.api, p.api),
    inArray(sandboxes.state, filter.state !== undefined ? [filter.state] : LISTED),
  ];
  if (filter.templateId !== undefined) conds.push(eq(sandboxes.templateId, filter.templateId));
  if (labelPairs.length > 0) {
    conds.push(sql`${sandboxes.labels} @> ${JSON.stringify(filter.labels)}::jsonb`);
  }
  if (after) conds.push(afterPosition(sandboxes.createdAt, sandboxes.id, after));
  const rows = await deps.db
    .select()
    .from(sandboxes)
    .where(and(...conds))
    .orderBy(sandboxes.createdAt, sandboxes.id)
    .limit(page.limit + 1);
  const out = pageOf(
    rows,
    page.limit,
    (r) => ({ at: r.createdAt, id: r.id }),
    (pos) => encodeCursor(key, scope, pos),
  );
  const activity = deps.activity;
  return activity ? { rows: out.rows.map((r) => activity.overlay(r)), next: out.next } : out;
}

/** Closes the open usage interval of a sandbox and opens `next` (null: none). */
export async function switchInterval(
  tx: Tx | Db,
  row: Pick<SandboxRow, "id" | "tenantId">,
  next: {
    state: "running" | "paused" | "suspended";
    vcpus: number;
    memMib: number;
    diskBytes: number;
  } | null,
  at: Date,
): Promise<void> {
  await tx
    .update(usageIntervals)
    .set({ endedAt: at })
    .where(and(eq(usageIntervals.sandboxId, row.id), isNull(usageIntervals.endedAt)));
  if (next) {
    await tx
      .insert(usageIntervals)
      .values({ sandboxId: row.id, tenantId: row.tenantId, ...next, startedAt: at });
  }
}

export const running = (r: VmResources) => ({
  state: "running" as const,
  vcpus: r.vcpus,
  memMib: r.memMib,
  diskBytes: r.diskBytes,
});

/** Ages for info/status responses, in seconds. */
export function ages(row: SandboxRow, nowMs: number): { ageSecs: number; idleSecs: number } {
  const created = row.createdAt.getTime();
  const last = row.lastExecAt?.getTime() ?? created;
  // A running exec is activity: not idle until it ends.
  const idleSecs = row.execsInFlight > 0 ? 0 : Math.max(0, (nowMs - last) / 1000);
  return { ageSecs: Math.max(0, (nowMs - created) / 1000), idleSecs };
}

export type { KeyApi, Tier };

/**
 * The agent names VMs by its own ids; a client knows only the sandbox or session id. Agent errors
 * about this sandbox are restated with the client's id (same code, cause kept).
 */
export async function inTermsOf<T>(row: { id: string; vmId: string | null }, call: Promise<T>): Promise<T> {
  try {
    return await call;
  } catch (err) {
    if (err instanceof SandboxdError && row.vmId !== null && err.message.includes(row.vmId)) {
      throw new SandboxdError(err.code, err.message.replaceAll(row.vmId, row.id), {
        cause: err,
        details: err.details,
      });
    }
    throw err;
  }
}
