/**
 * Creating VMs: a sandbox or session (`createVm`) and one-shot execs (`execOneShots`). The records
 * are reserved in `starting` under the tenant's cap first, atomically per tenant, then the VM is
 * placed and the record marked started (or failed).
 */

import { and, eq, inArray } from "drizzle-orm";
import type {
  CreatedVm,
  CreateVmOpts,
  ExecAction,
  OneShotResult,
  VmResources,
} from "../../../contracts/agent/api.ts";
import { bestEffort } from "../../../contracts/best-effort.ts";
import { parseAllowList } from "../../../contracts/egress.ts";
import { SandboxdError } from "../../../contracts/errors.ts";
import { sandboxes } from "../../../db/schema/sandboxes.ts";
import { usageIntervals } from "../../../db/schema/usage-intervals.ts";
import type { Principal } from "../../auth/keys.ts";
import type { Deps } from "../../deps.ts";
import { logOf } from "../../deps.ts";
import { newExecId, newSandboxId, newSessionId } from "../../ids.ts";
import { idleDeadlineMs, lifetimeColumns, noteDeadline } from "../deadlines.ts";
import { type RecordState, recordChange } from "../record-states.ts";
import { homeRegion } from "../regions.ts";
import { forgetRows } from "../row-cache.ts";
import { pickTemplateSize, type SizeWish, sizesOf } from "../sizes.ts";
import { requireReady, resolveTemplate } from "../templates.ts";
import { underTenantLock } from "../tenant-lock.ts";
import { countInStates } from "./quota.ts";
import {
  agentOf,
  getOwned,
  type Kind,
  LIVE,
  running,
  type SandboxRow,
  switchInterval,
  type VmKind,
} from "./records.ts";

/**
 * Reserves `count` records in state `starting` if the tenant's cap allows, atomically per tenant
 * (tenant-lock.ts: concurrent creates, forks, resumes of one tenant count one after the other).
 */
export async function reserve(
  deps: Deps,
  p: Principal,
  kind: Kind,
  template: { pk: string; id: string },
  items: {
    labels: Record<string, string>;
    parentId?: string;
    template?: { pk: string; id: string };
    idle?: IdleLifetime;
    /** The kept snapshot it starts from (docs/snapshots.md). */
    snapshotId?: string;
    lifetime?: AbsoluteLifetime;
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
        snapshotId: it.snapshotId ?? null,
        // Counted from the reservation: the create's own time is part of the lifetime.
        ...lifetimeColumns(it.lifetime, now.getTime()),
        createdAt: now,
      })),
    );
    return ids;
  });
}

/**
 * Connect hints in the client's terms (docs/sandboxes.md "Rules of the sandboxes API": not a dialable address): `<sandbox id>:<port>`,
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
export async function markStarted(
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
  // Reconciliation removes a VM without a row if this fails too; the log says it was left.
  await bestEffort(
    logOf(deps),
    `destroying VM ${vm.vmId} that has no row`,
    agentOf(deps, { agentId }).destroy(vm.vmId, { force: true }),
  );
  throw new SandboxdError(
    "spawn_failed",
    `${id} was settled as failed while its VM was starting (the start outlasted the bring-up bound)`,
    { details: { id } },
  );
}

/**
 * A row just started: its deadlines to this process's timer (a deadline that passed while it was
 * starting is due now; the claims take running rows only).
 */
export function noteStarted(deps: Deps, row: SandboxRow): void {
  noteDeadline(deps, row.expiresAt?.getTime());
  noteDeadline(deps, idleDeadlineMs(deps, row, (row.lastExecAt ?? row.createdAt).getTime()));
}

export async function markFailed(deps: Deps, ids: string[]): Promise<void> {
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

/**
 * An absolute lifetime as asked for: `timeoutS` from the create (or fork, or resume), then
 * `onTimeout` (`null`: none).
 */
export interface AbsoluteLifetime {
  timeoutS: number | null;
  onTimeout: "delete" | "suspend" | null;
}

/** What a new VM claims on its agent (the core names it through `Deps`, not the agents room). */
type PlacementNeed = NonNullable<Parameters<Deps["placement"]["firstChoice"]>[1]>;

export interface CreateInput {
  templateId: string;
  labels: Record<string, string>;
  egressAllow?: string[];
  idle?: IdleLifetime;
  lifetime?: AbsoluteLifetime;
  /** The size class asked for (docs/templates.md "Size classes"); none: the template's default. */
  size?: SizeWish;
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
  // A template built without a size runs at the agent's default one: a slot of the agent's
  // `slotsFree` (which counts VMs of that size) is then the whole claim.
  // Its tenant's own agents (BYOC) when it has any live, else the operator's.
  // A size class it lacks is 400 size_unavailable here, before anything is reserved.
  const size = pickTemplateSize(template.id, sizesOf(template), input.size ?? {});
  const need: PlacementNeed = { template: template.agentRef, tenant: p.tenantId };
  const vcpus = size?.vcpus ?? template.vcpuCount;
  const memMib = size?.memMib ?? template.memMib;
  if (vcpus !== null) need.vcpus = vcpus;
  if (memMib !== null) need.memMib = memMib;
  const region = await homeRegion(deps, p.tenantId);
  const [id] = await reserve(
    deps,
    p,
    kind,
    template,
    [
      {
        labels: input.labels,
        ...(input.idle !== undefined ? { idle: input.idle } : {}),
        ...(input.lifetime !== undefined ? { lifetime: input.lifetime } : {}),
      },
    ],
    await deps.placement.firstChoice(region, need),
  );
  let vm: CreatedVm;
  let agentId: string;
  try {
    const opts: CreateVmOpts = { kind };
    if (input.egressAllow !== undefined) opts.egressAllow = input.egressAllow;
    if (size !== undefined) Object.assign(opts, size);
    ({ agentId, result: vm } = await deps.placement.place(
      (a) => a.createSandbox(template.agentRef, opts),
      region,
      need,
    ));
  } catch (err) {
    await markFailed(deps, [id!]);
    throw err;
  }
  await markStarted(deps, id!, p.tenantId, vm, agentId);
  const row = await getOwned(deps, p, id!);
  noteStarted(deps, row);
  return { row, vm };
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
  const region = await homeRegion(deps, p.tenantId);
  const ids = await reserve(
    deps,
    p,
    "exec",
    calls[0]!.template,
    calls.map((c) => ({ labels: {}, template: c.template })),
    await deps.placement.firstChoice(region, { template: calls[0]!.template.agentRef, tenant: p.tenantId }),
    opts.partial ?? false,
  );
  const startedAt = new Date(deps.clock());
  const settled = await Promise.allSettled(
    calls.slice(0, ids.length).map(async (c, i) => {
      const id = ids[i]!;
      try {
        const { agentId, result } = await deps.placement.place(
          (a) => a.execOnce(c.template.agentRef, c.action),
          region,
          { template: c.template.agentRef, tenant: p.tenantId },
        );
        await endOneShot(deps, id, p.tenantId, agentId, startedAt, result.resources);
        return result;
      } catch (err) {
        await bestEffort(logOf(deps), `marking ${id} failed`, markFailed(deps, [id]));
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
