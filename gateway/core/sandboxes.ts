/**
 * Sessions (sessions API) and sandboxes (sandboxes API) without HTTP: the gateway records where each VM
 * runs, its state and its metering; the agent runs it. Every state change goes through
 * record-states.ts and updates the db only with a compare-and-set on the old state, so two racing
 * requests cannot both apply.
 */
import { and, eq, gt, inArray, isNotNull, isNull, lte, or, type SQL, sql } from "drizzle-orm";
import type {
  AgentVmApi,
  CreatedVm,
  ExecAction,
  ExecResult,
  ExecStreamOptions,
  OneShotResult,
  VmResources,
} from "../../contracts/agent/api.ts";
import type { KeyApi, Tier } from "../../contracts/api/tiers.ts";
import { parseAllowList } from "../../contracts/egress.ts";
import { describeError, SandboxdError } from "../../contracts/errors.ts";
import type { Db } from "../../db/client.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { usageIntervals } from "../../db/schema/usage-intervals.ts";
import type { Principal } from "../auth/keys.ts";
import type { Deps } from "../deps.ts";
import { notFound } from "../errors.ts";
import { newExecId, newSandboxId, newSessionId } from "../ids.ts";
import {
  checkRecordAction,
  nextState,
  RECORD_TRANSITIONS,
  type RecordAction,
  type RecordChange,
  type RecordState,
  recordChange,
} from "./record-states.ts";
import { forgetRows, type RowCache } from "./row-cache.ts";
import { requireReady, resolveTemplate } from "./templates.ts";
import { type Tx, underTenantLock } from "./tenant-lock.ts";

export type SandboxRow = typeof sandboxes.$inferSelect;
type Kind = "session" | "sandbox" | "exec";
/** The kinds that hold a VM past one call. */
type VmKind = Exclude<Kind, "exec">;

const LIVE: RecordState[] = ["starting", "running", "suspended"];

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
 * A record owned by the caller, in the caller's API; anything else is 404 (spec 5.7).
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
    // The sessions API: a reclaimed session answers 410 (spec 3.3, 7); deleted ones are simply gone.
    if (row.api === "sessions" && row.endReason === "reaped") {
      throw new SandboxdError("gone", `${what} was reclaimed after being idle`);
    }
    // The sandboxes API: one its idle lifetime deleted is gone like a deleted one (404), said why.
    if (row.endReason === "reaped") {
      throw new SandboxdError("not_found", `${what} was deleted after being idle`);
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

export async function listOwned(deps: Deps, p: Principal): Promise<SandboxRow[]> {
  const rows = await deps.db
    .select()
    .from(sandboxes)
    .where(
      and(
        eq(sandboxes.tenantId, p.tenantId),
        eq(sandboxes.api, p.api),
        inArray(sandboxes.state, ["running", "suspended"]),
      ),
    )
    .orderBy(sandboxes.createdAt, sandboxes.id);
  const activity = deps.activity;
  return activity ? rows.map((r) => activity.overlay(r)) : rows;
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

const running = (r: VmResources) => ({
  state: "running" as const,
  vcpus: r.vcpus,
  memMib: r.memMib,
  diskBytes: r.diskBytes,
});

/**
 * Reserves `count` records in state `starting` if the tenant's cap allows, atomically per tenant
 * (tenant-lock.ts: concurrent creates, forks, resumes of one tenant count one after the other).
 */
async function reserve(
  deps: Deps,
  p: Principal,
  kind: Kind,
  template: { pk: string; id: string },
  items: {
    labels: Record<string, string>;
    parentId?: string;
    template?: { pk: string; id: string };
    idle?: IdleLifetime;
  }[],
  agentId: string,
  /** Reserve the first items that fit instead of refusing all (a batch: the rest fail one by one). */
  partial = false,
): Promise<string[]> {
  const cap =
    p.api === "sessions"
      ? deps.config.limits.sessionCapPerTenant
      : deps.config.limits.sandboxQuotaByTier[p.tier];
  // The sandboxes API quota counts running sandboxes only: suspended ones hold no CPU or memory.
  const counted: RecordState[] = p.api === "sessions" ? LIVE : ["starting", "running"];
  const now = new Date(deps.clock());
  return underTenantLock(deps.db, p.tenantId, async (tx) => {
    // Resumes on their way count as running already (`holdForQuota`).
    const n = await countInStates(tx, p, counted, p.api === "sessions" ? undefined : { hold: "resume", now });
    const taken = partial ? items.slice(0, Math.max(0, cap - n)) : items;
    if (n + taken.length > cap) {
      // One-shot execs hold a VM for their call: they count with the sessions.
      const what =
        p.api === "sessions"
          ? kind === "exec"
            ? "live sessions and execs"
            : "live sessions"
          : "running sandboxes";
      throw new SandboxdError("quota_exceeded", `quota reached: ${n} of ${cap} ${what}`, {
        details: { cap, current: n },
      });
    }
    const ids = taken.map(() =>
      kind === "session" ? newSessionId() : kind === "exec" ? newExecId() : newSandboxId(),
    );
    if (ids.length === 0) return ids;
    await tx.insert(sandboxes).values(
      taken.map((it, i) => ({
        id: ids[i]!,
        tenantId: p.tenantId,
        api: p.api,
        kind,
        templatePk: (it.template ?? template).pk,
        templateId: (it.template ?? template).id,
        agentId,
        parentId: it.parentId ?? null,
        state: "starting" as const,
        labels: it.labels,
        idleTimeoutS: it.idle?.timeoutS ?? null,
        idleAction: it.idle?.action ?? null,
        createdAt: now,
      })),
    );
    return ids;
  });
}

/**
 * Connect hints in the client's terms (spec 2.5: not a dialable address): `<sandbox id>:<port>`,
 * the two things a connect URL needs. The agent's VM id stays internal.
 */
export function publicEndpoints(id: string, vmEndpoints: Record<string, string>): Record<string, string> {
  return Object.fromEntries(Object.keys(vmEndpoints).map((port) => [port, `${id}:${port}`]));
}

/**
 * Records that the agent made the VM: the row turns `running` and its metering starts. Only a row
 * still `starting`: reconciliation settles a row older than the bring-up bound as failed (its
 * create may still answer later, e.g. after placement retried other agents), and a running
 * interval opened on that ended row would bill forever. Such a VM has no row to live in: it is
 * destroyed and the call fails as a failed spawn.
 */
async function markStarted(
  deps: Deps,
  id: string,
  tenantId: string,
  vm: CreatedVm,
  agentId: string,
): Promise<void> {
  const at = new Date(deps.clock());
  const started = recordChange("started");
  const done = await deps.db
    .transaction(async (tx) => {
      const rows = await tx
        .update(sandboxes)
        .set({
          state: started.state,
          agentId,
          vmId: vm.vmId,
          endpoints: publicEndpoints(id, vm.endpoints),
          vcpus: vm.resources.vcpus,
          memMib: vm.resources.memMib,
          diskBytes: vm.resources.diskBytes,
        })
        .where(and(eq(sandboxes.id, id), started.from))
        .returning({ id: sandboxes.id });
      if (rows.length === 0) return false;
      await switchInterval(tx, { id, tenantId }, running(vm.resources), at);
      return true;
    })
    .finally(() => forgetRows(deps, id));
  if (done) return;
  await agentOf(deps, { agentId })
    .destroy(vm.vmId, { force: true })
    .catch(() => {}); // reconciliation removes a VM without a row if this fails too
  throw new SandboxdError(
    "spawn_failed",
    `${id} was settled as failed while its VM was starting (the start outlasted the bring-up bound)`,
    { details: { id } },
  );
}

async function markFailed(deps: Deps, ids: string[]): Promise<void> {
  if (ids.length === 0) return;
  const failed = recordChange("failed");
  await deps.db
    .update(sandboxes)
    .set({ state: failed.state, endReason: "failed", destroyedAt: new Date(deps.clock()) })
    .where(and(inArray(sandboxes.id, ids), failed.from))
    .finally(() => forgetRows(deps, ...ids));
}

/** An idle lifetime as recorded on a row: after `timeoutS` without a call, `action`. */
export interface IdleLifetime {
  timeoutS: number | null;
  action: "suspend" | "delete" | null;
}

export interface CreateInput {
  templateId: string;
  labels: Record<string, string>;
  egressAllow?: string[];
  idle?: IdleLifetime;
}

export async function createVm(
  deps: Deps,
  p: Principal,
  kind: VmKind,
  input: CreateInput,
): Promise<{ row: SandboxRow; vm: CreatedVm }> {
  const template = await resolveTemplate(deps, p.tenantId, input.templateId);
  requireReady(template);
  // A malformed egress.allow is a 400 here, before a row is reserved or an agent is asked.
  if (input.egressAllow !== undefined) parseAllowList(input.egressAllow);
  const [id] = await reserve(
    deps,
    p,
    kind,
    template,
    [input.idle === undefined ? { labels: input.labels } : { labels: input.labels, idle: input.idle }],
    await deps.placement.firstChoice(),
  );
  let vm: CreatedVm;
  let agentId: string;
  try {
    const opts: { kind: VmKind; egressAllow?: string[] } = { kind };
    if (input.egressAllow !== undefined) opts.egressAllow = input.egressAllow;
    ({ agentId, result: vm } = await deps.placement.place((a) => a.createSandbox(template.agentRef, opts)));
  } catch (err) {
    await markFailed(deps, [id!]);
    throw err;
  }
  await markStarted(deps, id!, p.tenantId, vm, agentId);
  return { row: await getOwned(deps, p, id!), vm };
}

/** One one-shot exec's outcome: its result, or why it did not run (a batch answers each). */
export type OneShotOutcome = { ok: true; result: OneShotResult } | { ok: false; error: unknown };

/**
 * A one-shot of the sessions API execs (`/v1/exec`, `/v1/exec/batch`): each holds a VM for its call, so each
 * takes a place in the tenant's concurrency cap (a row of kind `exec`, reserved before any VM
 * starts) and is metered like a session that ran for the call (one running interval with the
 * VM's size). The row ends `destroyed` when the call ends, whatever its outcome. `partial` (a
 * batch): the calls that fit the cap run and the rest are `quota_exceeded` each; otherwise a
 * set of calls over the cap is refused whole. Every call's outcome is returned, in order.
 */
export async function execOneShots(
  deps: Deps,
  p: Principal,
  calls: { template: { pk: string; id: string; agentRef: string }; action: ExecAction }[],
  opts: { partial?: boolean } = {},
): Promise<OneShotOutcome[]> {
  if (calls.length === 0) return [];
  const ids = await reserve(
    deps,
    p,
    "exec",
    calls[0]!.template,
    calls.map((c) => ({ labels: {}, template: c.template })),
    await deps.placement.firstChoice(),
    opts.partial ?? false,
  );
  const startedAt = new Date(deps.clock());
  const settled = await Promise.allSettled(
    calls.slice(0, ids.length).map(async (c, i) => {
      const id = ids[i]!;
      try {
        const { agentId, result } = await deps.placement.place((a) =>
          a.execOnce(c.template.agentRef, c.action),
        );
        await endOneShot(deps, id, p.tenantId, agentId, startedAt, result.resources);
        return result;
      } catch (err) {
        await markFailed(deps, [id]).catch(() => {});
        throw err;
      }
    }),
  );
  const out: OneShotOutcome[] = settled.map((r) =>
    r.status === "fulfilled" ? { ok: true, result: r.value } : { ok: false, error: r.reason },
  );
  const cap = deps.config.limits.sessionCapPerTenant;
  for (let i = ids.length; i < calls.length; i++) {
    const error = new SandboxdError("quota_exceeded", `quota reached: ${cap} live sessions and execs`, {
      details: { cap },
    });
    out.push({ ok: false, error });
  }
  return out;
}

/** A one-shot exec's row ends `destroyed` with the call metered as one running interval. */
async function endOneShot(
  deps: Deps,
  id: string,
  tenantId: string,
  agentId: string,
  startedAt: Date,
  resources: VmResources | undefined,
): Promise<void> {
  const at = new Date(deps.clock());
  const r = resources ?? { vcpus: 0, memMib: 0, diskBytes: 0 };
  // Its call is over: destroyed, as a delete leaves a record (a one-shot row is only `starting`).
  const ended = recordChange("destroy");
  await deps.db
    .transaction(async (tx) => {
      await tx
        .update(sandboxes)
        .set({
          state: ended.state,
          endReason: "deleted",
          destroyedAt: at,
          agentId,
          vcpus: r.vcpus,
          memMib: r.memMib,
          diskBytes: r.diskBytes,
          execCount: 1,
          lastExecAt: at,
        })
        .where(and(eq(sandboxes.id, id), ended.from));
      await tx
        .insert(usageIntervals)
        .values({ sandboxId: id, tenantId, ...running(r), startedAt, endedAt: at });
    })
    .finally(() => forgetRows(deps, id));
}

/** Runs an exec in a sandbox or session; with `stream`, its output streams (AgentVmApi.execStream). */
export async function execIn(
  deps: Deps,
  p: Principal,
  id: string,
  action: ExecAction,
  stream?: ExecStreamOptions,
): Promise<ExecResult> {
  const row = await claimForExec(deps, p, id);
  let ok = false;
  try {
    const agent = agentOf(deps, row);
    const call = stream ? agent.execStream(row.vmId!, action, stream) : agent.exec(row.vmId!, action);
    const result = await inTermsOf(row, call);
    ok = true;
    return result;
  } finally {
    await endActivity(deps, id, ok);
  }
}

/**
 * An exec's start in one round trip when it can run: the row, owned by the caller and running,
 * counted in flight with its idleness reset by one UPDATE (what `getOwned`, the state check and
 * `beginActivity` do in three steps, which answer every other case: 404, 410, 409).
 */
async function claimForExec(deps: Deps, p: Principal, id: string): Promise<SandboxRow> {
  const [claimed] = await deps.db
    .update(sandboxes)
    .set({ execsInFlight: sql`${sandboxes.execsInFlight} + 1`, lastExecAt: new Date(deps.clock()) })
    .where(
      and(
        eq(sandboxes.id, id),
        eq(sandboxes.tenantId, p.tenantId),
        eq(sandboxes.api, p.api),
        inArray(sandboxes.state, RECORD_TRANSITIONS.exec.from),
      ),
    )
    .returning()
    .finally(() => forgetRows(deps, id));
  if (claimed) return claimed;
  const row = await getOwned(deps, p, id);
  requireAllowed(id, row.state, "exec");
  await beginActivity(deps, p, row, "exec");
  return row;
}

/**
 * Starts a call that uses a live sandbox or session beside its exec (the file API): the same
 * state check as an exec, and counted in flight like one, so no reaper takes the sandbox
 * mid-transfer; `end` (once, idempotent) when the call is over, a download's stream included.
 */
export async function beginUse(
  deps: Deps,
  p: Principal,
  id: string,
): Promise<{ row: SandboxRow; agent: AgentVmApi; end: () => Promise<void> }> {
  const row = await getOwned(deps, p, id);
  const { end } = await beginUseOf(deps, p, row, "exec");
  return { row, agent: agentOf(deps, row), end };
}

/**
 * Counts a call on `row` in flight, through the one compare-and-set every use of a live record
 * takes (`beginActivity`): an exec-like call (files, processes) or a relay (`connect`: connects and
 * terminals). The call is also held in this process's registry (`touchRelayed` keeps its row
 * fresh each reaper pass), so one that outlasts any exec (a long transfer, a followed log) is not
 * taken for a count left by a dead gateway. `end` (once, idempotent) ends both.
 */
export async function beginUseOf(
  deps: Deps,
  p: Principal,
  row: SandboxRow,
  action: "exec" | "connect",
): Promise<{ end: () => Promise<void> }> {
  requireAllowed(row.id, row.state, action);
  await beginActivity(deps, p, row, action);
  const release = deps.relays?.hold(row.id) ?? (() => {});
  let ended: Promise<void> | undefined;
  return {
    end: () => {
      release();
      ended ??= endActivity(deps, row.id, false);
      return ended;
    },
  };
}

/**
 * Counts a call in flight on the row (an exec, or a fork of it) and resets its idleness, in one
 * compare-and-set on the state just read: a reaper (of any gateway) that claimed the session
 * first wins, and this call then answers as a call on the reclaimed session would (410), without
 * reaching the agent.
 */
async function beginActivity(
  deps: Deps,
  p: Principal,
  row: SandboxRow,
  action: "exec" | "fork" | "connect",
): Promise<void> {
  const marked = await deps.db
    .update(sandboxes)
    .set({ execsInFlight: sql`${sandboxes.execsInFlight} + 1`, lastExecAt: new Date(deps.clock()) })
    .where(and(eq(sandboxes.id, row.id), eq(sandboxes.state, row.state)))
    .returning({ id: sandboxes.id })
    .finally(() => forgetRows(deps, row.id));
  if (marked.length > 0) return;
  const now = await getOwned(deps, p, row.id); // 410 when reaped, 404 when deleted
  requireAllowed(row.id, now.state, action);
  throw new SandboxdError("conflict", `cannot ${action} ${row.id}: its state changed meanwhile`);
}

/**
 * The call's end resets idleness again (an exec longer than the TTL leaves a whole TTL after
 * it); a successful exec counts in `exec_count`.
 */
async function endActivity(deps: Deps, id: string, execDone: boolean): Promise<void> {
  if (deps.activity) {
    deps.activity.end(id, new Date(deps.clock()), execDone);
    return;
  }
  await deps.db
    .update(sandboxes)
    .set({
      execsInFlight: sql`greatest(${sandboxes.execsInFlight} - 1, 0)`,
      lastExecAt: new Date(deps.clock()),
      ...(execDone ? { execCount: sql`${sandboxes.execCount} + 1` } : {}),
    })
    .where(eq(sandboxes.id, id))
    .finally(() => forgetRows(deps, id));
}

export async function forkVm(
  deps: Deps,
  p: Principal,
  id: string,
  count: number,
  childLabels: (string | undefined)[],
): Promise<{ parent: SandboxRow; children: { id: string; vm: CreatedVm }[] }> {
  const parent = await getOwned(deps, p, id);
  requireAllowed(id, parent.state, "fork");
  const cap = deps.config.limits.forkCapByTier[p.tier];
  if (count > cap) {
    throw new SandboxdError(
      "bad_request",
      `count ${count} is over the per-call fork cap of ${cap} for ${p.tier} keys; call again for more`,
    );
  }
  const items = Array.from({ length: count }, (_, i) => {
    const labels = { ...parent.labels };
    const own = childLabels[i];
    if (own !== undefined) labels.label = own;
    // A child is a copy of its parent: it keeps the parent's idle lifetime.
    return {
      labels,
      parentId: parent.id,
      idle: { timeoutS: parent.idleTimeoutS, action: parent.idleAction },
    };
  });
  const kind = parent.kind;
  // A fork uses the parent like an exec: the reaper leaves it alone until the fork has ended.
  await beginActivity(deps, p, parent, "fork");
  try {
    return await forkMarked(deps, p, parent, kind, count, items);
  } finally {
    await endActivity(deps, id, false);
  }
}

async function forkMarked(
  deps: Deps,
  p: Principal,
  parent: SandboxRow,
  kind: Kind,
  count: number,
  items: { labels: Record<string, string>; parentId: string; idle: IdleLifetime }[],
): Promise<{ parent: SandboxRow; children: { id: string; vm: CreatedVm }[] }> {
  // Children share the parent's memory: they live on the parent's agent.
  const ids = await reserve(
    deps,
    p,
    kind,
    { pk: parent.templatePk, id: parent.templateId },
    items,
    parent.agentId,
  );
  let vms: CreatedVm[];
  try {
    vms = await inTermsOf(parent, agentOf(deps, parent).fork(parent.vmId!, count));
    if (vms.length !== count) {
      throw new SandboxdError("internal", `agent returned ${vms.length} children for a fork of ${count}`);
    }
  } catch (err) {
    await markFailed(deps, ids);
    throw err;
  }
  const children = ids.map((cid, i) => ({ id: cid, vm: vms[i]! }));
  for (const ch of children) await markStarted(deps, ch.id, p.tenantId, ch.vm, parent.agentId);
  return { parent, children };
}

export async function applyTransition(
  deps: Deps,
  row: SandboxRow,
  action: RecordChange,
  set: Partial<typeof sandboxes.$inferInsert>,
  interval: Parameters<typeof switchInterval>[2],
): Promise<void> {
  const at = new Date(deps.clock());
  try {
    await applyTransitionTx(deps, row, action, set, interval, at);
  } finally {
    forgetRows(deps, row.id);
  }
}

async function applyTransitionTx(
  deps: Deps,
  row: SandboxRow,
  action: RecordChange,
  set: Partial<typeof sandboxes.$inferInsert>,
  interval: Parameters<typeof switchInterval>[2],
  at: Date,
): Promise<void> {
  await deps.db.transaction(async (tx) => {
    const updated = await tx
      .update(sandboxes)
      .set({ ...set, state: nextState(action) })
      .where(and(eq(sandboxes.id, row.id), eq(sandboxes.state, row.state)))
      .returning({ id: sandboxes.id });
    if (updated.length === 0) {
      // The agent's report of the VM's end (core/agent-events.ts) or reconciliation settled the
      // row first: what this destroy wanted is done.
      if (action === "destroy" && (await stateOf(tx, row.id)) === "destroyed") return;
      throw new SandboxdError("conflict", `cannot ${action} ${row.id}: its state changed meanwhile`);
    }
    await switchInterval(tx, row, interval, at);
  });
}

async function stateOf(tx: Tx, id: string): Promise<RecordState | undefined> {
  const [r] = await tx.select({ state: sandboxes.state }).from(sandboxes).where(eq(sandboxes.id, id));
  return r?.state;
}

/**
 * The tenant's records of its API in `states` (in `db`, or a transaction of it), plus, with
 * `held`, the live records held for that change (`holdForQuota`): they are on their way there.
 */
export async function countInStates(
  db: Pick<Deps["db"], "select">,
  p: Pick<Principal, "tenantId" | "api">,
  states: RecordState[],
  held?: { hold: QuotaHold; now: Date },
): Promise<number> {
  const inStates = inArray(sandboxes.state, states);
  const [c] = await db
    .select({ n: sql<number>`count(*)::int` })
    .from(sandboxes)
    .where(
      and(
        eq(sandboxes.tenantId, p.tenantId),
        eq(sandboxes.api, p.api),
        held === undefined
          ? inStates
          : or(
              inStates,
              and(
                eq(sandboxes.hold, held.hold),
                gt(sandboxes.holdUntil, held.now),
                inArray(sandboxes.state, RECORD_TRANSITIONS[held.hold].from),
              ),
            ),
      ),
    );
  return c?.n ?? 0;
}

type QuotaHold = "suspend" | "resume";

/**
 * How long a hold counts at most, ms: well past the longest suspend or resume the gateway waits
 * for (the agent client's `vmOp`, 120 s by default), so only a hold whose gateway died during the
 * call ever runs out, and it stops counting then.
 */
export const HOLD_TTL_MS = 10 * 60_000;

/**
 * Checks the quota of the state `hold` leads to and, in the same locked transaction
 * (tenant-lock.ts), marks the record as on its way there, so a racing request counts it. The
 * agent is asked only after the lock is released; `releaseHold` or the recorded change ends it.
 * A record already held (a suspend or resume of it in flight) is a 409.
 */
async function holdForQuota(
  deps: Deps,
  p: Principal,
  row: SandboxRow,
  hold: QuotaHold,
  quota: { cap: number; what: string },
): Promise<void> {
  const now = new Date(deps.clock());
  const target = nextState(hold);
  // Suspended counts those in the target state; running also those still starting.
  const states: RecordState[] = target === "running" ? ["starting", "running"] : [target];
  await underTenantLock(deps.db, p.tenantId, async (tx) => {
    const n = await countInStates(tx, p, states, { hold, now });
    if (n >= quota.cap) {
      throw new SandboxdError("quota_exceeded", `quota reached: ${n} of ${quota.cap} ${quota.what}`, {
        details: { cap: quota.cap, current: n },
      });
    }
    const held = await tx
      .update(sandboxes)
      .set({ hold, holdUntil: new Date(now.getTime() + HOLD_TTL_MS) })
      .where(
        and(
          eq(sandboxes.id, row.id),
          eq(sandboxes.state, row.state),
          or(isNull(sandboxes.hold), lte(sandboxes.holdUntil, now)),
        ),
      )
      .returning({ id: sandboxes.id })
      .finally(() => forgetRows(deps, row.id));
    if (held.length === 0) {
      throw new SandboxdError(
        "conflict",
        `cannot ${hold} ${row.id}: a suspend or resume of it is in progress`,
      );
    }
  });
}

/** Ends a hold whose change failed (the record keeps its state). */
async function releaseHold(deps: Deps, id: string, hold: QuotaHold): Promise<void> {
  await deps.db
    .update(sandboxes)
    .set({ hold: null, holdUntil: null })
    .where(and(eq(sandboxes.id, id), eq(sandboxes.hold, hold)))
    .finally(() => forgetRows(deps, id));
}

export async function suspendVm(deps: Deps, p: Principal, id: string): Promise<{ memBytes: number }> {
  // Suspended sandboxes keep a RAM image on the host's disk: their own quota bounds them.
  const quota = { cap: deps.config.limits.suspendedQuotaByTier[p.tier], what: "suspended sandboxes" };
  return changeUnderHold(deps, p, id, "suspend", quota, async (agent, vmId) => {
    const r = await agent.suspend(vmId);
    const interval = { state: "suspended" as const, vcpus: 0, memMib: 0, diskBytes: r.snapshotBytes };
    // The user's suspend: calls stay refused until a resume (only the reaper's wakes itself).
    return { result: { memBytes: r.memBytes }, set: { suspendedBy: "user" as const }, interval };
  });
}

export async function resumeVm(deps: Deps, p: Principal, id: string): Promise<{ memBytes: number }> {
  // Resuming makes the sandbox count against the running quota again.
  const quota = { cap: deps.config.limits.sandboxQuotaByTier[p.tier], what: "running sandboxes" };
  return changeUnderHold(deps, p, id, "resume", quota, async (agent, vmId, row) => {
    const r = await agent.resume(vmId);
    const { vcpus, memMib, diskBytes } = r.resources;
    // A resume of a sandbox with an idle lifetime counts as activity: it gets a whole timeout
    // before the reaper may suspend it again (else the call that woke it could lose it at once).
    const touched = row.idleTimeoutS !== null ? { lastExecAt: new Date(deps.clock()) } : {};
    return {
      result: { memBytes: r.memBytes },
      set: { vcpus, memMib, diskBytes, suspendedBy: null, ...touched },
      interval: running(r.resources),
    };
  });
}

/**
 * A suspend or resume: the record must allow it, the quota of the state it leads to must have
 * room (`holdForQuota` reserves it), then the agent is asked and the change recorded, clearing
 * the hold; any failure releases it.
 */
async function changeUnderHold<T>(
  deps: Deps,
  p: Principal,
  id: string,
  action: QuotaHold,
  quota: { cap: number; what: string },
  call: (
    agent: AgentVmApi,
    vmId: string,
    row: SandboxRow,
  ) => Promise<{
    result: T;
    set: Partial<typeof sandboxes.$inferInsert>;
    interval: Parameters<typeof switchInterval>[2];
  }>,
): Promise<T> {
  const row = await getOwned(deps, p, id);
  requireAllowed(id, row.state, action);
  await holdForQuota(deps, p, row, action, quota);
  try {
    const done = await inTermsOf(row, call(agentOf(deps, row), row.vmId!, row));
    await applyTransition(deps, row, action, { ...done.set, hold: null, holdUntil: null }, done.interval);
    return done.result;
  } catch (err) {
    await releaseHold(deps, id, action).catch(() => {});
    throw err;
  }
}

export async function destroyVm(
  deps: Deps,
  row: SandboxRow,
  opts: { force: boolean; reason: "deleted" | "reaped" },
): Promise<void> {
  requireAllowed(row.id, row.state, "destroy");
  if (row.vmId !== null) await inTermsOf(row, agentOf(deps, row).destroy(row.vmId, { force: opts.force }));
  await applyTransition(
    deps,
    row,
    "destroy",
    { endReason: opts.reason, destroyedAt: new Date(deps.clock()) },
    null,
  );
  // Its connect tokens are refused from now on (the record is destroyed); relays already open on
  // it end too, with 1001 going away (gateway/relay/).
  deps.relays?.closeSandbox(row.id, 1001, `sandbox ${opts.reason}`);
}

/**
 * Reclaims sessions API sessions idle past the TTL (spec 3.3); later calls on them get 410.
 * Returns the ids reclaimed. Safe with several gateways on one database: each session is claimed
 * by one conditional UPDATE (running, no exec in flight, idle past the TTL) that also ends its
 * metering, so exactly one reaper wins it and only the winner calls the agent. An exec counted in
 * flight is never reaped, however long it runs; a count older than any exec may run was left by
 * a gateway that died during the call and no longer holds the session.
 */
export async function reapIdleSessions(
  deps: Deps,
  log: (line: string) => void = () => {},
): Promise<string[]> {
  const at = new Date(deps.clock());
  const claimed = await deps.db.transaction(async (tx) => {
    const rows = await tx
      .update(sandboxes)
      .set({ state: nextState("destroy"), endReason: "reaped", destroyedAt: at })
      .where(
        and(
          idleClaimable(deps, at),
          or(
            and(eq(sandboxes.kind, "session"), eq(sandboxes.api, "sessions")),
            // Sandboxes of the sandboxes API whose idle lifetime deletes them (gateway/core/idle.ts suspends
            // the others with the same test).
            and(
              eq(sandboxes.kind, "sandbox"),
              eq(sandboxes.idleAction, "delete"),
              isNotNull(sandboxes.idleTimeoutS),
            ),
          ),
        ),
      )
      .returning();
    for (const row of rows) await switchInterval(tx, row, null, at);
    return rows;
  });
  forgetRows(deps, ...claimed.map((r) => r.id));
  for (const row of claimed) {
    deps.relays?.closeSandbox(row.id, 1001, `${row.kind} reaped`);
    if (row.vmId === null) continue;
    try {
      await inTermsOf(row, agentOf(deps, row).destroy(row.vmId, { force: true }));
    } catch (err) {
      // The row is reclaimed and no longer billed; the VM left on the agent is a VM without a
      // live row, which the agent's reconciliation with the gateway removes.
      log(`reaper: ${row.id}: agent ${row.agentId} did not destroy ${row.vmId}: ${describeError(err)}`);
    }
  }
  if (claimed.length > 0) log(`reaper: reclaimed idle ${claimed.map((r) => r.id).join(", ")}`);
  return claimed.map((r) => r.id);
}

/**
 * The one test of idleness every reaper claim makes, in SQL: running, no suspend or resume held,
 * no call in flight (or only a count left by a gateway that died during the call), and no
 * activity for its idle lifetime (the row's own `idle_timeout_s`; a session without one has the
 * operator's TTL). Open connect relays count as calls in flight (gateway/routes/connect.ts).
 */
export function idleClaimable(deps: Deps, at: Date): SQL {
  const limits = deps.config.limits;
  const lostExecCutoff = new Date(at.getTime() - (limits.maxExecTimeoutS + STALE_EXEC_MARGIN_S) * 1000);
  const lastActivity = sql`coalesce(${sandboxes.lastExecAt}, ${sandboxes.createdAt})`;
  const idleFor = sql`coalesce(${sandboxes.idleTimeoutS}, ${limits.sessionIdleTtlS}::int)`;
  return and(
    eq(sandboxes.state, "running"),
    or(isNull(sandboxes.hold), lte(sandboxes.holdUntil, at)),
    sql`${lastActivity} + make_interval(secs => ${idleFor}) < ${at.toISOString()}::timestamptz`,
    sql`(${sandboxes.execsInFlight} = 0 or ${lastActivity} < ${lostExecCutoff.toISOString()})`,
  )!;
}

/**
 * Keeps the rows of the sandboxes this gateway relays fresh (each reaper pass), so that a relay
 * open longer than any exec is not taken for a count left by a dead gateway.
 */
export async function touchRelayed(deps: Deps): Promise<void> {
  const ids = deps.relays?.sandboxIds() ?? [];
  if (ids.length === 0) return;
  await deps.db
    .update(sandboxes)
    .set({ lastExecAt: new Date(deps.clock()) })
    .where(and(inArray(sandboxes.id, ids), eq(sandboxes.state, "running")))
    .finally(() => forgetRows(deps, ...ids));
}

/**
 * How long past the longest allowed exec a one-shot exec's row may stay `starting` before it is
 * taken for the row of a gateway that died during the call: the agent's own grace and the VM's
 * create fit well within it.
 */
const STALE_EXEC_MARGIN_S = 600;

/**
 * Ends the rows of one-shot execs whose gateway died during the call (still `starting` long after
 * any exec could have ended), so they stop holding a place in their tenant's cap. Returns the ids.
 */
export async function endStaleExecs(deps: Deps): Promise<string[]> {
  const limits = deps.config.limits;
  const cutoff = new Date(deps.clock() - (limits.maxExecTimeoutS + STALE_EXEC_MARGIN_S) * 1000);
  const failed = recordChange("failed");
  const rows = await deps.db
    .update(sandboxes)
    .set({ state: failed.state, endReason: "failed", destroyedAt: new Date(deps.clock()) })
    .where(
      and(eq(sandboxes.kind, "exec"), failed.from, sql`${sandboxes.createdAt} < ${cutoff.toISOString()}`),
    )
    .returning({ id: sandboxes.id });
  forgetRows(deps, ...rows.map((r) => r.id));
  return rows.map((r) => r.id);
}

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
