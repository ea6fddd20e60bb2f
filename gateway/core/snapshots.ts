/**
 * Snapshots a tenant keeps (docs/snapshots.md): take one of a running sandbox, list, read and
 * delete them, and start a sandbox from one. A snapshot lives on the agent that took it: its files
 * (memory image, disk overlay) are that host's, so a sandbox made from it is placed there, and
 * when that host is lost the snapshot reads `lost` (host-loss.ts; `ready` again if the host comes
 * back with its files, reconcile.ts). Every rule is checked here, whatever the
 * agent: ownership (another tenant's snapshot is 404, as a missing one), the per-tenant cap, the
 * states a call may start from.
 *
 * Delete marks the row deleted at once (the tenant's count drops) and asks the agent to drop the
 * snapshot; the agent keeps the files while VMs made from it still rest on them (their disk chain
 * and memory mapping) and frees them when the last of those ends, so a delete never waits on, nor
 * breaks, the sandboxes started from it.
 */
import { and, desc, eq, inArray, isNull, ne, type SQL, sql } from "drizzle-orm";
import type { CreatedVm, SnapshotRestored } from "../../contracts/agent/api.ts";
import { parseAllowList } from "../../contracts/egress.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { agents } from "../../db/schema/agents.ts";
import { snapshots } from "../../db/schema/snapshots.ts";
import { templates } from "../../db/schema/templates.ts";
import type { Principal } from "../auth/keys.ts";
import type { Deps } from "../deps.ts";
import { newSnapshotId } from "../ids.ts";
import { beforePosition, cursorKey, decodeCursor, encodeCursor, filtersDigest, pageOf } from "./paging.ts";
import {
  type AbsoluteLifetime,
  type IdleLifetime,
  markFailed,
  markStarted,
  reserve,
} from "./sandboxes/create.ts";
import { beginActivity, endActivity } from "./sandboxes/exec.ts";
import { agentOf, getOwned, inTermsOf, requireAllowed, type SandboxRow } from "./sandboxes/records.ts";
import { checkSnapshotSize, type SizeWish } from "./sizes.ts";
import { underTenantLock } from "./tenant-lock.ts";

export type SnapshotRow = typeof snapshots.$inferSelect;

/** States that keep files on a host and count against the tenant's cap. */
const KEPT = ["creating", "ready"] as const;

/** A snapshot of the caller's tenant, not deleted; anything else is 404 (no existence leak). */
export async function getOwnedSnapshot(deps: Deps, p: Principal, id: string): Promise<SnapshotRow> {
  const [row] = await deps.db
    .select()
    .from(snapshots)
    .where(and(eq(snapshots.id, id), eq(snapshots.tenantId, p.tenantId), ne(snapshots.state, "deleted")));
  if (!row) throw new SandboxdError("not_found", `snapshot ${id} not found`, { details: { id } });
  return row;
}

/** Filters of `GET /v1/snapshots` (docs/lists.md), all AND-ed. */
export interface SnapshotFilter {
  labels?: Record<string, string>;
  state?: "creating" | "ready" | "failed" | "lost";
  sourceSandboxId?: string;
  templateId?: string;
  /** Only the snapshot of this name (names are the tenant's own words; not unique). */
  name?: string;
}

/**
 * One page of the tenant's snapshots, newest first by (created_at, id), with the lists' signed
 * cursor (gateway/core/paging.ts): a keyset read before the last row given, so rows taken during
 * a walk sort before its first page and never shift one into a page twice or out of all of them.
 */
export async function listSnapshotsPage(
  deps: Deps,
  p: Principal,
  filter: SnapshotFilter,
  page: { limit: number; cursor?: string | undefined },
): Promise<{ rows: SnapshotRow[]; next: string | null }> {
  const key = cursorKey(deps.config.keyPepper);
  const labelPairs = Object.entries(filter.labels ?? {}).map(([k, v]) => `${k}:${v}`);
  const scope = {
    owner: `${p.tenantId}/${p.api}`,
    digest: filtersDigest("snapshots", {
      label: labelPairs,
      state: filter.state,
      source_sandbox: filter.sourceSandboxId,
      template: filter.templateId,
      name: filter.name,
    }),
  };
  const before = page.cursor !== undefined ? decodeCursor(key, scope, page.cursor) : undefined;
  const conds: SQL[] = [eq(snapshots.tenantId, p.tenantId), ne(snapshots.state, "deleted")];
  if (filter.state !== undefined) conds.push(eq(snapshots.state, filter.state));
  if (filter.sourceSandboxId !== undefined) conds.push(eq(snapshots.sourceSandboxId, filter.sourceSandboxId));
  if (filter.templateId !== undefined) conds.push(eq(snapshots.templateId, filter.templateId));
  if (filter.name !== undefined) conds.push(eq(snapshots.name, filter.name));
  if (labelPairs.length > 0) conds.push(sql`${snapshots.labels} @> ${JSON.stringify(filter.labels)}::jsonb`);
  if (before) conds.push(beforePosition(snapshots.createdAt, snapshots.id, before));
  const rows = await deps.db
    .select()
    .from(snapshots)
    .where(and(...conds))
    .orderBy(desc(snapshots.createdAt), desc(snapshots.id))
    .limit(page.limit + 1);
  return pageOf(
    rows,
    page.limit,
    (r) => ({ at: r.createdAt, id: r.id }),
    (pos) => encodeCursor(key, scope, pos),
  );
}

export interface TakeInput {
  name?: string;
  labels: Record<string, string>;
}

/**
 * Takes a snapshot of running sandbox `sandboxId`: a row in `creating` under the tenant's cap
 * (atomically per tenant, as creates count), then the agent keeps the VM's memory and disk (the
 * sandbox stalls as for a fork and runs on), then the row is `ready` with its size, or `failed`
 * with why (the agent rolled its files back; the failed row stays visible until deleted and does
 * not count against the cap).
 */
export async function takeSnapshot(
  deps: Deps,
  p: Principal,
  sandboxId: string,
  input: TakeInput,
): Promise<SnapshotRow> {
  const source = await getOwned(deps, p, sandboxId);
  // A snapshot copies the VM as a fork does: from the same states.
  requireAllowed(sandboxId, source.state, "fork");
  const id = await reserveSnapshot(deps, p, source, input);
  // The sandbox is in use while it is copied: the reaper leaves it alone until the copy ends.
  await beginActivity(deps, p, source, "fork");
  try {
    const taken = await inTermsOf(source, agentOf(deps, source).takeSnapshot(source.vmId!, id));
    const [row] = await deps.db
      .update(snapshots)
      .set({
        state: "ready",
        sizeBytes: taken.sizeBytes,
        vcpus: taken.resources.vcpus,
        memMib: taken.resources.memMib,
        diskBytes: taken.resources.diskBytes,
        readyAt: new Date(deps.clock()),
      })
      .where(and(eq(snapshots.id, id), eq(snapshots.state, "creating")))
      .returning();
    if (!row) throw new SandboxdError("conflict", `snapshot ${id} was deleted while it was taken`);
    return row;
  } catch (err) {
    await deps.db
      .update(snapshots)
      .set({ state: "failed", error: err instanceof Error ? err.message : String(err) })
      .where(and(eq(snapshots.id, id), eq(snapshots.state, "creating")));
    throw err;
  } finally {
    await endActivity(deps, source, false);
  }
}

async function reserveSnapshot(
  deps: Deps,
  p: Principal,
  source: SandboxRow,
  input: TakeInput,
): Promise<string> {
  const cap = deps.config.limits.snapshotQuotaByTier[p.tier];
  return underTenantLock(deps.db, p.tenantId, async (tx) => {
    const [counted] = await tx
      .select({ n: sql<number>`count(*)::int` })
      .from(snapshots)
      .where(
        and(
          eq(snapshots.tenantId, p.tenantId),
          isNull(snapshots.deletedAt),
          inArray(snapshots.state, [...KEPT]),
        ),
      );
    const n = counted?.n ?? 0;
    if (n >= cap) {
      throw new SandboxdError("quota_exceeded", `quota reached: ${n} of ${cap} snapshots kept`, {
        details: { cap, current: n },
      });
    }
    const id = newSnapshotId();
    await tx.insert(snapshots).values({
      id,
      tenantId: p.tenantId,
      sourceSandboxId: source.id,
      agentId: source.agentId,
      templatePk: source.templatePk,
      templateId: source.templateId,
      state: "creating",
      name: input.name ?? null,
      labels: input.labels,
      createdAt: new Date(deps.clock()),
    });
    return id;
  });
}

/**
 * Deletes a snapshot: gone for the tenant at once. Its agent drops it (files freed now, or with
 * the last VM made from it); a snapshot whose host is lost or removed has no files left to drop.
 * An agent that is only unreachable for now makes the delete 503 with the row unchanged: retried,
 * it frees the files instead of leaking them.
 */
export async function deleteSnapshot(deps: Deps, p: Principal, id: string): Promise<void> {
  const row = await getOwnedSnapshot(deps, p, id);
  if (row.state === "creating") {
    throw new SandboxdError("conflict", `cannot delete ${id}: it is still being taken`, {
      details: { state: row.state },
    });
  }
  // A lost one's files are gone with its host, or, if that host came back with them, freed by
  // reconciliation once the row says deleted (gateway/core/reconcile.ts).
  if (row.state !== "lost" && !(await hostGone(deps, row.agentId)))
    await agentOf(deps, row).deleteSnapshot(id);
  // A lost one keeps the end of its metered interval (its host's last heartbeat).
  await deps.db
    .update(snapshots)
    .set({
      state: "deleted",
      deletedAt: sql`coalesce(${snapshots.deletedAt}, ${new Date(deps.clock()).toISOString()}::timestamptz)`,
    })
    .where(and(eq(snapshots.id, id), ne(snapshots.state, "deleted")));
}

/** The snapshot's host was removed or declared lost (gateway/core/host-loss.ts): its files are gone. */
async function hostGone(deps: Deps, agentId: string): Promise<boolean> {
  const [a] = await deps.db.select({ lostAt: agents.lostAt }).from(agents).where(eq(agents.id, agentId));
  return !a || a.lostAt !== null;
}

/**
 * Rolls running sandbox `sandboxId` back to snapshot `snapshotId` in place (docs/snapshots.md
 * "Restore in place"): the same sandbox, row and lifetime. The snapshot must be the caller's,
 * ready, kept on the sandbox's own host (its files are there) and of the sandbox's template; the
 * agent refuses another size. A restore is in use of the sandbox, as a fork is: the reaper leaves
 * it alone meanwhile.
 */
export async function restoreSandbox(
  deps: Deps,
  p: Principal,
  sandboxId: string,
  snapshotId: string,
): Promise<SnapshotRestored> {
  const sb = await getOwned(deps, p, sandboxId);
  requireAllowed(sandboxId, sb.state, "fork");
  const snap = await getReadySnapshot(deps, p, snapshotId);
  if (await hostGone(deps, snap.agentId)) throw lostError(snap);
  if (snap.agentId !== sb.agentId || snap.templatePk !== sb.templatePk) {
    const why =
      snap.agentId !== sb.agentId
        ? `it is kept on host ${snap.agentId}, the sandbox runs on ${sb.agentId}`
        : `it is of template ${snap.templateId}, the sandbox of ${sb.templateId}`;
    throw new SandboxdError("conflict", `sandbox ${sandboxId} cannot be restored to ${snap.id}: ${why}`, {
      details: { snapshot: snap.id, sandbox: sandboxId },
    });
  }
  await beginActivity(deps, p, sb, "fork");
  try {
    return await inTermsOf(sb, agentOf(deps, sb).restoreSnapshot(sb.vmId!, snap.id));
  } finally {
    await endActivity(deps, sb, false);
  }
}

export interface FromSnapshotInput {
  snapshotId: string;
  labels: Record<string, string>;
  egressAllow?: string[];
  idle?: IdleLifetime;
  /** `timeout_seconds`/`on_timeout` of the create, counted from it as for a create from a template. */
  lifetime?: AbsoluteLifetime;
  /** A size asked for: only the snapshot's own is allowed (docs/templates.md "Size classes"). */
  size?: SizeWish;
}

/**
 * A sandbox from a ready snapshot: its record reserved under the running quota as any create,
 * placed on the snapshot's agent (the only host with its files), marked started with
 * `snapshot_id`. Its template is the snapshot's source template, which it shows and is billed as.
 */
export async function createFromSnapshot(
  deps: Deps,
  p: Principal,
  input: FromSnapshotInput,
): Promise<{ row: SandboxRow; vm: CreatedVm }> {
  const snap = await getReadySnapshot(deps, p, input.snapshotId);
  if (input.egressAllow !== undefined) parseAllowList(input.egressAllow);
  checkSnapshotSize(snap.id, snap, input.size ?? {});
  if (await hostGone(deps, snap.agentId)) throw lostError(snap);
  const [tpl] = await deps.db
    .select({ pk: templates.pk, id: templates.id })
    .from(templates)
    .where(eq(templates.pk, snap.templatePk));
  const template = tpl ?? { pk: snap.templatePk, id: snap.templateId };
  const item: Parameters<typeof reserve>[4][number] = { labels: input.labels, snapshotId: snap.id };
  if (input.idle !== undefined) item.idle = input.idle;
  if (input.lifetime !== undefined) item.lifetime = input.lifetime;
  const [id] = await reserve(deps, p, "sandbox", template, [item], snap.agentId);
  let vm: CreatedVm;
  try {
    const opts: { kind: "sandbox"; egressAllow?: string[] } = { kind: "sandbox" };
    if (input.egressAllow !== undefined) opts.egressAllow = input.egressAllow;
    vm = await agentOf(deps, snap).createFromSnapshot(snap.id, opts);
  } catch (err) {
    await markFailed(deps, [id!]);
    throw err;
  }
  await markStarted(deps, id!, p.tenantId, vm, snap.agentId);
  return { row: await getOwned(deps, p, id!), vm };
}

/** A `ready` snapshot of the caller's to start from: 410 when it is lost, 409 in another state. */
async function getReadySnapshot(deps: Deps, p: Principal, id: string): Promise<SnapshotRow> {
  const snap = await getOwnedSnapshot(deps, p, id);
  if (snap.state === "lost") throw lostError(snap);
  if (snap.state !== "ready") {
    throw new SandboxdError("conflict", `snapshot ${snap.id} is ${snap.state}, not ready`, {
      details: { state: snap.state },
    });
  }
  return snap;
}

function lostError(snap: SnapshotRow): SandboxdError {
  // A row marked lost says why (its host was lost, or a live host no longer has its files:
  // gateway/core/host-loss.ts, reconcile.ts); a ready row on a host that is gone says that.
  const why =
    snap.state === "lost" && snap.error
      ? `snapshot ${snap.id} is lost: ${snap.error}`
      : `snapshot ${snap.id} was kept on host ${snap.agentId}, which is lost or removed; its files went with it`;
  return new SandboxdError("gone", why, { details: { id: snap.id, agentId: snap.agentId } });
}

/** The public shape of a snapshot (contracts/api/sandboxes-api.ts `SnapshotInfo`). */
export function snapshotInfo(row: SnapshotRow) {
  return {
    id: row.id,
    state: row.state === "deleted" ? ("failed" as const) : row.state,
    source_sandbox: row.sourceSandboxId,
    template: row.templateId,
    ...(row.name !== null ? { name: row.name } : {}),
    labels: row.labels,
    size_bytes: row.sizeBytes ?? 0,
    created_at: row.createdAt.toISOString(),
    ...(row.readyAt ? { ready_at: row.readyAt.toISOString() } : {}),
    ...(row.error !== null ? { error: row.error } : {}),
  };
}
