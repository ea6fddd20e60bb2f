/**
 * Templates, without HTTP: resolve what a tenant may use, register (upload or bake), refresh
 * build status from the agent, delete. The db records *that* a template exists and its state;
 * the agent builds and holds it.
 */

import { randomBytes } from "node:crypto";
import { rm } from "node:fs/promises";
import { setTimeout as sleep } from "node:timers/promises";
import { and, eq, inArray, isNull, or, sql } from "drizzle-orm";
import type { TemplateSource } from "../../contracts/agent/api.ts";
import type { BakeTemplateRequest } from "../../contracts/api/sandboxes-api.ts";
import type { KeyApi } from "../../contracts/api/tiers.ts";
import { describeError, SandboxdError } from "../../contracts/errors.ts";
import { ImageReferenceError, parseImageReference } from "../../contracts/image-ref.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { templates } from "../../db/schema/templates.ts";
import { type Deps, logOf } from "../deps.ts";
import { notFound } from "../errors.ts";
import { base36, newTemplatePk } from "../ids.ts";
import { homeRegion, hostOf } from "./regions.ts";
import { ociSourceOf } from "./template-catch-up.ts";
import { type Tx, underTenantLock } from "./tenant-lock.ts";

export type TemplateRow = typeof templates.$inferSelect;

/** Live (not deleted) rows that a tenant can see: its own and the public catalog. */
function visibleTo(tenantId: string) {
  return and(isNull(templates.deletedAt), or(eq(templates.tenantId, tenantId), isNull(templates.tenantId)));
}

/** The template `id` as `tenantId` sees it: its own first, else the public one. */
export async function resolveTemplate(deps: Deps, tenantId: string, id: string): Promise<TemplateRow> {
  const rows = await deps.db
    .select()
    .from(templates)
    .where(and(eq(templates.id, id), visibleTo(tenantId)));
  const row = rows.find((r) => r.tenantId === tenantId) ?? rows[0];
  if (!row) throw notFound(`template ${id}`);
  return refreshTemplate(deps, row);
}

/** Templates visible to a tenant (own and public). */
export async function visibleTemplates(deps: Deps, tenantId: string | null): Promise<TemplateRow[]> {
  const rows = await deps.db
    .select()
    .from(templates)
    .where(
      tenantId === null ? and(isNull(templates.tenantId), isNull(templates.deletedAt)) : visibleTo(tenantId),
    )
    .orderBy(templates.id);
  return Promise.all(rows.map((r) => refreshTemplate(deps, r)));
}

/** While building, ask the agent and record a finished build. */
export async function refreshTemplate(deps: Deps, row: TemplateRow): Promise<TemplateRow> {
  if (row.status !== "building") return row;
  const host = await hostOf(deps, row.tenantId);
  let st: Awaited<ReturnType<Deps["agent"]["templateStatus"]>>;
  try {
    st = await host.templateStatus(row.agentRef);
  } catch (err) {
    if (neverStarted(deps, row, err)) {
      await markBuildFailed(
        deps,
        row,
        "agent_unavailable: the build was never started (the gateway that accepted it stopped before an agent was live); retry the request",
      );
      return (await rowByPk(deps, row.pk)) ?? row;
    }
    // The agent is unreachable or has not started this build yet: the row stays "building"
    // (a listing or health check must not fail because one build cannot be asked about).
    return row;
  }
  if (st.status === "building" && st.phase === row.phase) return row;
  const readyAt = st.status === "ready" ? new Date(st.readyAtMs ?? deps.clock()) : null;
  const [updated] = await deps.db
    .update(templates)
    .set({
      status: st.status,
      phase: st.phase,
      error: st.error ?? null,
      // While building the agent knows no ports yet; the row keeps the ones the request named.
      ...(st.status === "ready" ? { exposedPorts: st.exposedPorts } : {}),
      readyAt,
    })
    .where(and(eq(templates.pk, row.pk), eq(templates.status, "building")))
    .returning();
  return updated ?? row;
}

/**
 * A `Pending` build that the live agents do not know, accepted longer ago than twice the wait
 * for an agent: whichever gateway accepted it has either started it or given up by now (the
 * wait, plus as much again for its last try's call), so no one will start it: a gateway that
 * stopped while it waited. Failed rather than left `Pending` for ever. Measured from
 * `createdAt`, which for an upload is before its body was read: after a long upload the check can
 * meet a wait still running, and wins only in the half second (BUILD_RETRY_MS) between an
 * agent's first beat and the wait's next try.
 */
function neverStarted(deps: Deps, row: TemplateRow, err: unknown): boolean {
  return (
    err instanceof SandboxdError &&
    err.code === "not_found" &&
    row.phase === "Pending" &&
    // An upload still streaming is reserved but not yet asked for (its size is set once it is).
    (row.api === "sandboxes" || row.uploadBytes !== null) &&
    deps.clock() - row.createdAt.getTime() > 2 * deps.config.agentWaitMs
  );
}

/** A template the caller may spawn from: ready, or a clean 409. */
export function requireReady(row: TemplateRow): void {
  if (row.status === "ready") return;
  if (row.status === "building") {
    throw new SandboxdError("template_not_ready", `template ${row.id} is still building`);
  }
  throw new SandboxdError("conflict", `template ${row.id} failed to build: ${row.error ?? "unknown error"}`);
}

function agentRef(tenantId: string, id: string): string {
  return `${tenantId}.${id}`;
}

/**
 * The agent's name for one sessions API registration: the tenant, a per-registration tag, the id.
 * A deleted template lives on its agent until the VMs still running on it end (docs/templates.md "Rules of templates"), and
 * its id is free again at once, so a registration under the same id must not meet it there.
 */
function uploadAgentRef(tenantId: string, id: string): string {
  return `${tenantId}.${base36(UPLOAD_REF_TAG_CHARS)}.${id}`;
}
/** 36^6 tags: two registrations of one id by one tenant meeting on an agent is negligible. */
const UPLOAD_REF_TAG_CHARS = 6;

/** Refuses an id that the tenant already has or that a public template uses (never overwrite). */
async function assertIdFree(deps: Deps, tenantId: string, id: string): Promise<void> {
  const [clash] = await deps.db
    .select({ pk: templates.pk })
    .from(templates)
    .where(and(eq(templates.id, id), visibleTo(tenantId)));
  if (clash) throw new SandboxdError("conflict", `template id ${id} already exists`);
}

/**
 * Refuses a new template when the tenant already owns `cap` (any status but deleted): each one
 * holds a base disk and a RAM file on every agent of its region (docs/quotas-and-usage.md "Disk budgets").
 * Called alone it is an early refusal (before an upload's body is read); the binding check is
 * `insertWithinQuota`'s, made with the insert under the tenant's lock.
 */
export async function requireTemplateRoom(deps: Deps, tenantId: string, cap: number): Promise<void> {
  await checkTemplateRoom(deps.db, tenantId, cap);
}

async function checkTemplateRoom(db: Deps["db"] | Tx, tenantId: string, cap: number): Promise<void> {
  const [c] = await db
    .select({ n: sql<number>`count(*)::int` })
    .from(templates)
    .where(and(eq(templates.tenantId, tenantId), isNull(templates.deletedAt)));
  const n = c?.n ?? 0;
  if (n >= cap) {
    throw new SandboxdError("quota_exceeded", `quota reached: ${n} of ${cap} templates`, {
      details: { cap, current: n },
    });
  }
}

/**
 * Inserts a tenant's new template row if the tenant has room for it, counting and inserting in
 * one transaction under the tenant's lock (tenant-lock.ts): two racing registrations cannot both
 * take the last place. The row (status `building`) is the reservation; the agent is asked to
 * build only after it is committed. Undefined when the id is taken (a racing request of the same
 * id, or one that exists): the caller decides whether that is a retry or a conflict.
 */
async function insertWithinQuota(
  deps: Deps,
  tenantId: string,
  cap: number,
  values: typeof templates.$inferInsert,
): Promise<TemplateRow | undefined> {
  return underTenantLock(deps.db, tenantId, async (tx) => {
    // Before the count: a retry of an existing bake is not a new template.
    const [clash] = await tx
      .select({ pk: templates.pk })
      .from(templates)
      .where(and(eq(templates.id, values.id), visibleTo(tenantId)));
    if (clash) return undefined;
    await checkTemplateRoom(tx, tenantId, cap);
    const rows = await tx.insert(templates).values(values).onConflictDoNothing().returning();
    return rows[0];
  });
}

/**
 * The sessions API: reserve the id (status building) before the upload is read, so a duplicate is
 * refused without consuming a multi-GB body, and a place in the tenant's template quota
 * (`templateCap`). Returns the row; `startUploadBuild` follows.
 */
export async function reserveUploadTemplate(
  deps: Deps,
  tenantId: string,
  opts: { id: string; memMib?: number; vcpuCount?: number; waitSecs?: number },
  templateCap = Number.POSITIVE_INFINITY,
): Promise<TemplateRow> {
  await assertIdFree(deps, tenantId, opts.id);
  const row = await insertWithinQuota(deps, tenantId, templateCap, {
    pk: newTemplatePk(),
    id: opts.id,
    tenantId,
    api: "sessions",
    agentRef: uploadAgentRef(tenantId, opts.id),
    name: opts.id,
    status: "building",
    phase: "Pending",
    spec: { ...opts },
    memMib: opts.memMib ?? null,
    vcpuCount: opts.vcpuCount ?? null,
    createdAt: new Date(deps.clock()),
  });
  if (!row) throw new SandboxdError("conflict", `template id ${opts.id} already exists`);
  return row;
}

export async function startUploadBuild(
  deps: Deps,
  row: TemplateRow,
  upload: { path: string; bytes: number },
): Promise<void> {
  const spec = row.spec as { memMib?: number; vcpuCount?: number; waitSecs?: number };
  const source: TemplateSource = { kind: "upload", path: upload.path };
  if (spec.memMib !== undefined) source.memMib = spec.memMib;
  if (spec.vcpuCount !== undefined) source.vcpuCount = spec.vcpuCount;
  if (spec.waitSecs !== undefined) source.waitSecs = spec.waitSecs;
  await deps.db.update(templates).set({ uploadBytes: upload.bytes }).where(eq(templates.pk, row.pk));
  await startBuild(deps, row, source);
}

/** Forgets a reservation whose upload never completed. */
export async function dropReservation(deps: Deps, row: TemplateRow): Promise<void> {
  await deps.db.delete(templates).where(and(eq(templates.pk, row.pk), eq(templates.status, "building")));
  // (No sandbox can reference a template that never finished building.)
}

/**
 * The sandboxes API bake (Pro). Idempotent on (tenant, name): a retry with the same request returns the
 * existing template; a different request under the same name is a 409.
 */
export async function bakeTemplate(
  deps: Deps,
  tenantId: string,
  req: BakeTemplateRequest,
  templateCap = Number.POSITIVE_INFINITY,
): Promise<TemplateRow> {
  // Refused here with a readable 400 rather than as a failed bake; the agent checks again before
  // it hands the reference to skopeo (agent/image/pull.ts).
  try {
    parseImageReference(req.image);
  } catch (err) {
    if (err instanceof ImageReferenceError) throw new SandboxdError("bad_request", err.message);
    throw err;
  }
  const spec: Record<string, unknown> = { image: req.image };
  if (req.ready !== undefined) spec.ready = req.ready;
  if (req.width !== undefined) spec.width = req.width;
  if (req.expected_width !== undefined) spec.expected_width = req.expected_width;
  // Size classes (docs/templates.md "Size classes"): each once; the first is the default.
  const sizes = req.sizes ?? [];
  const keys = sizes.map((z) => `${z.vcpus}x${z.memory_mib}`);
  if (new Set(keys).size !== keys.length)
    throw new SandboxdError("bad_request", "sizes: each size class may be listed once");
  if (req.sizes !== undefined) spec.sizes = req.sizes;
  const [existing] = await deps.db
    .select()
    .from(templates)
    .where(and(eq(templates.id, req.name), visibleTo(tenantId)));
  if (existing) {
    if (
      existing.tenantId === tenantId &&
      existing.api === "sandboxes" &&
      stableJson(existing.spec) === stableJson(spec)
    ) {
      return refreshTemplate(deps, existing);
    }
    throw new SandboxdError("conflict", `template ${req.name} already exists with a different definition`);
  }
  // A retry of an existing bake (above) is not a new template and is never refused here.
  const row = await insertWithinQuota(deps, tenantId, templateCap, {
    pk: newTemplatePk(),
    id: req.name,
    tenantId,
    api: "sandboxes",
    agentRef: agentRef(tenantId, req.name),
    name: req.name,
    description: `baked from ${req.image}`,
    image: req.image,
    spec,
    status: "building",
    phase: "Pending",
    exposedPorts: req.ready?.ports ?? [],
    ...(sizes[0] !== undefined ? { vcpuCount: sizes[0].vcpus, memMib: sizes[0].memory_mib } : {}),
    createdAt: new Date(deps.clock()),
  });
  if (!row) return bakeTemplate(deps, tenantId, req, templateCap); // lost a race with an identical retry
  // What the row stores (the same a later agent's rebuild is given), plus this request's
  // credentials, which go to the agent with it only: `spec` (stored) never holds them.
  const source = ociSourceOf(row)!;
  if (req.registry_auth !== undefined) source.registryAuth = req.registry_auth;
  if (req.width !== undefined) source.width = req.width;
  if (req.expected_width !== undefined) source.expectedWidth = req.expected_width;
  const started = await startBuild(deps, row, source);
  return started ? refreshTemplate(deps, row) : ((await rowByPk(deps, row.pk)) ?? row);
}

/**
 * How often a build accepted while no agent was live tries again. Each try is one read of the
 * agents table (the router's `live`), so two a second per waiting build is cheap, and the build
 * starts within half a second of an agent's first heartbeat.
 */
const BUILD_RETRY_MS = 500;

/** Nothing was started: no agent is live, or the one tried refused the connection (router.ts `retryElsewhere`). */
function nothingStarted(err: unknown): boolean {
  return err instanceof SandboxdError && err.code === "agent_unavailable" && err.details?.timedOut !== true;
}

async function rowByPk(deps: Deps, pk: string): Promise<TemplateRow | undefined> {
  return (await deps.db.select().from(templates).where(eq(templates.pk, pk)))[0];
}

async function markBuildFailed(deps: Deps, row: TemplateRow, message: string): Promise<void> {
  await deps.db
    .update(templates)
    .set({ status: "failed", phase: "Failed", error: message })
    .where(and(eq(templates.pk, row.pk), eq(templates.status, "building")));
}

/**
 * Asks the agents to build a committed row. True once one took it. A build that cannot even start
 * is a failed build (docs/templates.md "Rules of templates": reported, never a crash), except when
 * no agent is live: then the row stays `Pending` and the build waits for one in the background,
 * up to `config.agentWaitMs` from now, and fails with that reason past it (docs/templates.md
 * "Waiting for an agent"). An upload's file is the agent's once taken, else removed here.
 */
async function startBuild(deps: Deps, row: TemplateRow, source: TemplateSource): Promise<boolean> {
  try {
    await (await hostOf(deps, row.tenantId)).buildTemplate(row.agentRef, source);
    return true;
  } catch (err) {
    if (!nothingStarted(err) || deps.config.agentWaitMs <= 0) {
      await dropUpload(source);
      await markBuildFailed(deps, row, buildStartError(err));
      return false;
    }
  }
  const log = logOf(deps);
  void buildWhenAgentLive(deps, row, source).catch((err: unknown) => {
    // The wait runs after the request was answered: its failure has no caller but the log.
    log(`template ${row.id} (${row.pk}): waiting for an agent failed: ${describeError(err)}`);
  });
  return false;
}

async function dropUpload(source: TemplateSource): Promise<void> {
  if (source.kind === "upload") await rm(source.path, { force: true });
}

/** `startBuild`'s wait: tries again every BUILD_RETRY_MS until an agent takes the build or the bound passes. */
async function buildWhenAgentLive(deps: Deps, row: TemplateRow, source: TemplateSource): Promise<void> {
  const waitMs = deps.config.agentWaitMs;
  // The tenant's home region is fixed at its creation, so the host looked up once serves every try.
  const region = await homeRegion(deps, row.tenantId);
  // A tenant's template goes where its VMs go (its own agents, else the operator's); a public one
  // to every agent of the region.
  const host = deps.placement.hostIn(region, row.tenantId ?? undefined);
  const deadline = performance.now() + waitMs;
  while (performance.now() < deadline) {
    await sleep(Math.min(BUILD_RETRY_MS, Math.max(0, deadline - performance.now())));
    // Deleted (or settled by another replica's refresh) while it waited: nothing left to build.
    const now = await rowByPk(deps, row.pk);
    if (!now || now.deletedAt !== null || now.status !== "building") return dropUpload(source);
    try {
      await host.buildTemplate(row.agentRef, source);
      return;
    } catch (err) {
      if (!nothingStarted(err)) {
        await dropUpload(source);
        return markBuildFailed(deps, row, buildStartError(err));
      }
    }
  }
  await dropUpload(source);
  await markBuildFailed(
    deps,
    row,
    `agent_unavailable: no agent of region ${region} was live to build on within ${waitMs / 1000} s of the request; retry the request`,
  );
}

/**
 * A build the agent refused to start, as the template's `error`: the agent's own words where it
 * judged the request (they are about the request), else a code and an error id; the full text,
 * which can name an agent's address, goes to the gateway's log under that id.
 */
function buildStartError(err: unknown): string {
  if (
    err instanceof SandboxdError &&
    ["bad_request", "conflict", "forbidden", "not_found"].includes(err.code)
  )
    return `${err.code}: ${err.message}`;
  const errorId = `err-${randomBytes(6).toString("hex")}`;
  console.error(`template build could not start [${errorId}]: ${describeError(err)}`);
  const code = err instanceof SandboxdError ? err.code : "internal";
  return `${code}: the build could not be started on an agent (error id ${errorId})`;
}

function stableJson(v: unknown): string {
  if (Array.isArray(v)) return `[${v.map(stableJson).join(",")}]`;
  if (v !== null && typeof v === "object") {
    const entries = Object.entries(v as Record<string, unknown>).sort(([a], [b]) => (a < b ? -1 : 1));
    return `{${entries.map(([k, x]) => `${JSON.stringify(k)}:${stableJson(x)}`).join(",")}}`;
  }
  return JSON.stringify(v);
}

/**
 * A template the caller owns, for delete/expect/release. Public rows are 403 `forbidden`
 * (docs/sandboxes.md "Rules of the sandboxes API"); another tenant's or unknown is 404.
 */
export async function ownTemplate(
  deps: Deps,
  tenantId: string,
  id: string,
  api: KeyApi,
): Promise<TemplateRow> {
  const row = await resolveTemplate(deps, tenantId, id);
  if (row.tenantId === null) throw new SandboxdError("forbidden", `template ${id} is in the shared catalog`);
  if (row.api !== api) throw notFound(`template ${id}`);
  return row;
}

export async function deleteTemplate(deps: Deps, row: TemplateRow): Promise<void> {
  const [inUse] = await deps.db
    .select({ n: sql<number>`count(*)::int` })
    .from(sandboxes)
    .where(
      and(eq(sandboxes.templatePk, row.pk), inArray(sandboxes.state, ["starting", "running", "suspended"])),
    );
  // The sandboxes API: 409 template_in_use while sandboxes run on it (docs/sandboxes.md "Rules of the sandboxes API"). The sessions API: in-flight VMs
  // finish first, then resources are reclaimed (docs/templates.md "Rules of templates"): the agent keeps the template, marked
  // deleting, until its last VM ends; here the row goes at once (new sessions: 404).
  if (row.api === "sandboxes" && (inUse?.n ?? 0) > 0) {
    throw new SandboxdError("template_in_use", `template ${row.id} has ${inUse?.n} live sandboxes`);
  }
  await (await hostOf(deps, row.tenantId)).deleteTemplate(row.agentRef);
  // The row stays (sandbox rows and usage history reference it); the id becomes free again.
  await deps.db
    .update(templates)
    .set({ deletedAt: new Date(deps.clock()) })
    .where(eq(templates.pk, row.pk));
}

/** Operator: add or update a shared catalog template (docs/templates.md "Rules of templates": e.g. `python`). */
export async function upsertPublicTemplate(
  deps: Pick<Deps, "db" | "clock">,
  t: {
    id: string;
    name: string;
    description: string;
    tier?: string;
    exposedPorts?: number[];
    /** "building" while the agent still builds it: refreshTemplate then follows the agent. */
    status?: "building" | "ready";
  },
): Promise<void> {
  const building = t.status === "building";
  await deps.db
    .insert(templates)
    .values({
      pk: newTemplatePk(),
      id: t.id,
      tenantId: null,
      api: "sandboxes",
      agentRef: t.id,
      name: t.name,
      description: t.description,
      tier: t.tier ?? null,
      status: building ? "building" : "ready",
      phase: building ? "Converting" : "Live",
      exposedPorts: t.exposedPorts ?? [],
      createdAt: new Date(deps.clock()),
      readyAt: building ? null : new Date(deps.clock()),
    })
    .onConflictDoNothing();
}
