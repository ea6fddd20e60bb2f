/**
 * Sessions (Family A) and sandboxes (Family B) without HTTP: the gateway records where each VM
 * runs, its state and its metering; the agent runs it. Every state change goes through
 * record-states.ts and updates the db only with a compare-and-set on the old state, so two racing
 * requests cannot both apply.
 */
import { and, eq, inArray, isNull, sql } from "drizzle-orm";
import type {
  AgentApi,
  CreatedVm,
  ExecAction,
  ExecResult,
  OneShotResult,
  VmResources,
} from "../../contracts/agent/api.ts";
import type { Family, Tier } from "../../contracts/api/tiers.ts";
import { parseAllowList } from "../../contracts/egress.ts";
import { SandboxdError } from "../../contracts/errors.ts";
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
  type RecordAction,
  type RecordChange,
  type RecordState,
} from "./record-states.ts";
import { requireReady, resolveTemplate } from "./templates.ts";

export type SandboxRow = typeof sandboxes.$inferSelect;
type Tx = Parameters<Parameters<Db["transaction"]>[0]>[0];
type Kind = "session" | "sandbox" | "exec";
/** The kinds that hold a VM past one call. */
type VmKind = Exclude<Kind, "exec">;

const LIVE: RecordState[] = ["starting", "running", "suspended"];

/** The record's state must allow `action` (record-states.ts); the refusal is thrown as is. */
function requireAllowed(id: string, state: RecordState, action: RecordAction): void {
  const check = checkRecordAction(id, state, action);
  if (!check.ok) throw check.error;
}

/** The agent a sandbox lives on: the one recorded on its row (gateway/agents/placement.ts). */
export function agentOf(deps: Deps, row: Pick<SandboxRow, "agentId">): AgentApi {
  return deps.placement.agentFor(row.agentId);
}

/** A record owned by the caller, in the caller's family; anything else is 404 (spec 5.7). */
export async function getOwned(deps: Deps, p: Principal, id: string): Promise<SandboxRow> {
  const [row] = await deps.db
    .select()
    .from(sandboxes)
    .where(and(eq(sandboxes.id, id), eq(sandboxes.tenantId, p.tenantId), eq(sandboxes.family, p.family)));
  const what = p.family === "a" ? `session ${id}` : `sandbox ${id}`;
  if (!row) throw notFound(what);
  if (row.state === "destroyed") {
    // Family A: a reclaimed session answers 410 (spec 3.3, 7); deleted ones are simply gone.
    if (row.family === "a" && row.endReason === "reaped") {
      throw new SandboxdError("gone", `${what} was reclaimed after being idle`);
    }
    throw notFound(what);
  }
  return row;
}

export async function listOwned(deps: Deps, p: Principal): Promise<SandboxRow[]> {
  return deps.db
    .select()
    .from(sandboxes)
    .where(
      and(
        eq(sandboxes.tenantId, p.tenantId),
        eq(sandboxes.family, p.family),
        inArray(sandboxes.state, ["running", "suspended"]),
      ),
    )
    .orderBy(sandboxes.createdAt, sandboxes.id);
}

/** Closes the open usage interval of a sandbox and opens `next` (null: none). */
async function switchInterval(
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
 * (an advisory lock serializes concurrent creates of one tenant, in PGlite and Postgres alike).
 */
async function reserve(
  deps: Deps,
  p: Principal,
  kind: Kind,
  template: { pk: string; id: string },
  items: { labels: Record<string, string>; parentId?: string; template?: { pk: string; id: string } }[],
  agentId: string,
  /** Reserve the first items that fit instead of refusing all (a batch: the rest fail one by one). */
  partial = false,
): Promise<string[]> {
  const cap =
    p.family === "a" ? deps.config.limits.sessionCapPerTenant : deps.config.limits.sandboxQuotaByTier[p.tier];
  // Family B quota counts running sandboxes only: suspended ones hold no CPU or memory.
  const counted: RecordState[] = p.family === "a" ? LIVE : ["starting", "running"];
  const now = new Date(deps.clock());
  return deps.db.transaction(async (tx) => {
    await tx.execute(sql`select pg_advisory_xact_lock(hashtext(${p.tenantId}))`);
    const n = await countInStates(tx, p, counted);
    const taken = partial ? items.slice(0, Math.max(0, cap - n)) : items;
    if (n + taken.length > cap) {
      // One-shot execs hold a VM for their call: they count with the sessions.
      const what =
        p.family === "a"
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
        family: p.family,
        kind,
        templatePk: (it.template ?? template).pk,
        templateId: (it.template ?? template).id,
        agentId,
        parentId: it.parentId ?? null,
        state: "starting" as const,
        labels: it.labels,
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

async function markStarted(
  deps: Deps,
  id: string,
  tenantId: string,
  vm: CreatedVm,
  agentId: string,
): Promise<void> {
  const at = new Date(deps.clock());
  await deps.db.transaction(async (tx) => {
    await tx
      .update(sandboxes)
      .set({
        state: "running",
        agentId,
        vmId: vm.vmId,
        endpoints: publicEndpoints(id, vm.endpoints),
        vcpus: vm.resources.vcpus,
        memMib: vm.resources.memMib,
        diskBytes: vm.resources.diskBytes,
      })
      .where(and(eq(sandboxes.id, id), eq(sandboxes.state, "starting")));
    await switchInterval(tx, { id, tenantId }, running(vm.resources), at);
  });
}

async function markFailed(deps: Deps, ids: string[]): Promise<void> {
  if (ids.length === 0) return;
  await deps.db
    .update(sandboxes)
    .set({ state: "destroyed", endReason: "failed", destroyedAt: new Date(deps.clock()) })
    .where(and(inArray(sandboxes.id, ids), eq(sandboxes.state, "starting")));
}

export interface CreateInput {
  templateId: string;
  labels: Record<string, string>;
  egressAllow?: string[];
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
    [{ labels: input.labels }],
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
 * Family A one-shot execs (`/v1/exec`, `/v1/exec/batch`): each holds a VM for its call, so each
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
  await deps.db.transaction(async (tx) => {
    await tx
      .update(sandboxes)
      .set({
        state: "destroyed",
        endReason: "deleted",
        destroyedAt: at,
        agentId,
        vcpus: r.vcpus,
        memMib: r.memMib,
        diskBytes: r.diskBytes,
        execCount: 1,
        lastExecAt: at,
      })
      .where(and(eq(sandboxes.id, id), eq(sandboxes.state, "starting")));
    await tx
      .insert(usageIntervals)
      .values({ sandboxId: id, tenantId, ...running(r), startedAt, endedAt: at });
  });
}

export async function execIn(deps: Deps, p: Principal, id: string, action: ExecAction): Promise<ExecResult> {
  const row = await getOwned(deps, p, id);
  requireAllowed(id, row.state, "exec");
  const result = await inTermsOf(row, agentOf(deps, row).exec(row.vmId!, action));
  await deps.db
    .update(sandboxes)
    .set({ execCount: sql`${sandboxes.execCount} + 1`, lastExecAt: new Date(deps.clock()) })
    .where(eq(sandboxes.id, id));
  return result;
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
    return { labels, parentId: parent.id };
  });
  const kind = parent.kind;
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

async function applyTransition(
  deps: Deps,
  row: SandboxRow,
  action: RecordChange,
  set: Partial<typeof sandboxes.$inferInsert>,
  interval: Parameters<typeof switchInterval>[2],
): Promise<void> {
  const at = new Date(deps.clock());
  await deps.db.transaction(async (tx) => {
    const updated = await tx
      .update(sandboxes)
      .set({ ...set, state: nextState(action) })
      .where(and(eq(sandboxes.id, row.id), eq(sandboxes.state, row.state)))
      .returning({ id: sandboxes.id });
    if (updated.length === 0) {
      throw new SandboxdError("conflict", `cannot ${action} ${row.id}: its state changed meanwhile`);
    }
    await switchInterval(tx, row, interval, at);
  });
}

/** The tenant's records of its family in `states` (in `db`, or a transaction of it). */
async function countInStates(
  db: Pick<Deps["db"], "select">,
  p: Principal,
  states: RecordState[],
): Promise<number> {
  const [c] = await db
    .select({ n: sql<number>`count(*)::int` })
    .from(sandboxes)
    .where(
      and(
        eq(sandboxes.tenantId, p.tenantId),
        eq(sandboxes.family, p.family),
        inArray(sandboxes.state, states),
      ),
    );
  return c?.n ?? 0;
}

export async function suspendVm(deps: Deps, p: Principal, id: string): Promise<{ memBytes: number }> {
  const row = await getOwned(deps, p, id);
  requireAllowed(id, row.state, "suspend");
  // Suspended sandboxes keep a RAM image on the host's disk: their own quota bounds them.
  const cap = deps.config.limits.suspendedQuotaByTier[p.tier];
  const n = await countInStates(deps.db, p, ["suspended"]);
  if (n >= cap) {
    throw new SandboxdError("quota_exceeded", `quota reached: ${n} of ${cap} suspended sandboxes`, {
      details: { cap, current: n },
    });
  }
  const r = await inTermsOf(row, agentOf(deps, row).suspend(row.vmId!));
  await applyTransition(
    deps,
    row,
    "suspend",
    {},
    {
      state: "suspended",
      vcpus: 0,
      memMib: 0,
      diskBytes: r.snapshotBytes,
    },
  );
  return { memBytes: r.memBytes };
}

export async function resumeVm(deps: Deps, p: Principal, id: string): Promise<{ memBytes: number }> {
  const row = await getOwned(deps, p, id);
  requireAllowed(id, row.state, "resume");
  // Resuming makes the sandbox count against the running quota again.
  const cap = deps.config.limits.sandboxQuotaByTier[p.tier];
  const n = await countInStates(deps.db, p, ["starting", "running"]);
  if (n >= cap) {
    throw new SandboxdError("quota_exceeded", `quota reached: ${n} of ${cap} running sandboxes`);
  }
  const r = await inTermsOf(row, agentOf(deps, row).resume(row.vmId!));
  await applyTransition(
    deps,
    row,
    "resume",
    { vcpus: r.resources.vcpus, memMib: r.resources.memMib, diskBytes: r.resources.diskBytes },
    running(r.resources),
  );
  return { memBytes: r.memBytes };
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
 * Reclaims Family A sessions idle past the TTL (spec 3.3); later calls on them get 410.
 * Returns the ids reclaimed. A session that fails to reclaim is retried on the next pass.
 */
export async function reapIdleSessions(
  deps: Deps,
  log: (line: string) => void = () => {},
): Promise<string[]> {
  const cutoff = new Date(deps.clock() - deps.config.limits.sessionIdleTtlS * 1000);
  const idle = await deps.db
    .select()
    .from(sandboxes)
    .where(
      and(
        eq(sandboxes.kind, "session"),
        eq(sandboxes.family, "a"),
        eq(sandboxes.state, "running"),
        sql`coalesce(${sandboxes.lastExecAt}, ${sandboxes.createdAt}) < ${cutoff.toISOString()}`,
      ),
    );
  const reaped: string[] = [];
  for (const row of idle) {
    try {
      await destroyVm(deps, row, { force: true, reason: "reaped" });
      reaped.push(row.id);
    } catch (err) {
      log(`reaper: ${row.id}: ${err instanceof Error ? err.message : String(err)}`);
    }
  }
  return reaped;
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
  const rows = await deps.db
    .update(sandboxes)
    .set({ state: "destroyed", endReason: "failed", destroyedAt: new Date(deps.clock()) })
    .where(
      and(
        eq(sandboxes.kind, "exec"),
        eq(sandboxes.state, "starting"),
        sql`${sandboxes.createdAt} < ${cutoff.toISOString()}`,
      ),
    )
    .returning({ id: sandboxes.id });
  return rows.map((r) => r.id);
}

/** Runs the reaper every `reaperIntervalS`; returns a stop function. */
export function startReaper(deps: Deps, log: (line: string) => void = console.error): () => void {
  let running = false;
  const timer = setInterval(() => {
    if (running) return; // a slow pass must not overlap the next
    running = true;
    reapIdleSessions(deps, log)
      .then(() => endStaleExecs(deps))
      .then((ended) => {
        if (ended.length > 0) log(`reaper: ended one-shot execs whose call was lost: ${ended.join(", ")}`);
      })
      .catch((err) => log(`reaper: ${err instanceof Error ? err.message : String(err)}`))
      .finally(() => {
        running = false;
      });
  }, deps.config.limits.reaperIntervalS * 1000);
  return () => clearInterval(timer);
}

/** Ages for info/status responses, in seconds. */
export function ages(row: SandboxRow, nowMs: number): { ageSecs: number; idleSecs: number } {
  const created = row.createdAt.getTime();
  const last = row.lastExecAt?.getTime() ?? created;
  return { ageSecs: Math.max(0, (nowMs - created) / 1000), idleSecs: Math.max(0, (nowMs - last) / 1000) };
}

export type { Family, Tier };

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
