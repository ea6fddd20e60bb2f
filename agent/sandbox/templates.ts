/**
 * Templates on this agent: building -> ready | failed (docs/templates.md "Rules of templates"), kept as records so that a
 * restarted agent still spawns from them. The build runs in the background (the API answers 202
 * at once); a failure is a status with a readable error, never a crash (docs/templates.md "Rules of templates"): a stable code,
 * a short reason and an error id naming the full text in the agent's log (tenant-error.ts).
 *
 * Readiness telemetry (docs/templates.md "Rules of templates", contracts/api/sandboxes-api.ts TemplateTelemetry): the registry times
 * the Pending wait and the whole build; a driver may add what it measured (phase timings,
 * snapshot sizes) by returning `PreparedWithTelemetry`. It is written into the template's record,
 * so a template restored after an agent restart reports what its build measured.
 */

import type { TemplateBuildStatus } from "../../contracts/agent/api.ts";
import type { BakePhase, TemplateTelemetry } from "../../contracts/api/sandboxes-api.ts";
import { bestEffort } from "../../contracts/best-effort.ts";
import { describeError, SandboxdError } from "../../contracts/errors.ts";
import type { BuildPhase, PreparedTemplate, SandboxDriver, TemplateInput, VmSize } from "./drivers/driver.ts";
import type { RecordStore, TemplateRecord } from "./records.ts";
import { newErrorId, tenantErrorText } from "./tenant-error.ts";

/**
 * Builds that run at once on one agent; later ones wait, reported as `Pending` (docs/templates.md "Rules of templates"). Each
 * build boots a VM and runs the image tools (skopeo, umoci, mkfs.ext4), which are CPU and disk
 * bound: two keep a small host busy without making every build slower than it would be alone,
 * and a burst of bakes cannot starve the sandboxes already running.
 */
export const MAX_CONCURRENT_BUILDS = 2;

/**
 * How long a delete waits for the build it cancelled to unwind (its tools killed, its import's
 * work dir removed, its VM stopped). Every stage stops within one chunk read or one process kill,
 * well under a second. 3 s keeps the answer inside the gateway's 5 s deadline for quick agent
 * calls (gateway/agents/client.ts) even when removing a big partial rootfs is slow: the delete
 * then answers anyway, the build's own cleanup still runs, and the overrun is logged.
 */
export const CANCEL_WAIT_MS = 3_000;

/**
 * Whose build this is, for sharing the slots: the tenant a bake names, else the owner part of
 * the gateway's template ref (`<tenant>.<id>`); builds of the operator (the catalog) share "".
 */
export function buildOwner(id: string, input: TemplateInput): string {
  if (input.kind === "oci" && input.tenantId) return input.tenantId;
  const dot = id.indexOf(".");
  return dot > 0 ? id.slice(0, dot) : "";
}

/** A build waiting for a slot. */
interface Waiter {
  owner: string;
  grant: () => void;
}

/**
 * The driver's id of size class `size` of template `id` (docs/templates.md "Size classes"): the
 * template's own id for its default size, `<id>@<vcpus>x<memMib>` for another (`@` is outside
 * the agent's template refs, so it never names a template of its own).
 */
export function sizedTemplateId(id: string, size: VmSize, defaultSize?: Partial<VmSize>): string {
  if (defaultSize && defaultSize.vcpus === size.vcpus && defaultSize.memMib === size.memMib) return id;
  return `${id}@${size.vcpus}x${size.memMib}`;
}

/** The template id a driver id of `sizedTemplateId` belongs to. */
export function baseTemplateId(driverId: string): string {
  const at = driverId.indexOf("@");
  return at < 0 ? driverId : driverId.slice(0, at);
}

export interface ReadyTemplate {
  /** The driver's template to spawn from: the template's own, or its size class's. */
  id: string;
  prepared: PreparedTemplate;
  size: Partial<VmSize>;
}

/** What `prepareTemplate` may return: the template plus what the driver measured building it. */
export type PreparedWithTelemetry = PreparedTemplate & {
  telemetry?: TemplateTelemetry;
  /** The size the template was frozen with when the build could not be told it (a copy). */
  frozenSize?: VmSize;
};

interface Entry {
  record: TemplateRecord;
  /** Where a build in progress is: Pending (queued), Converting, Distributing (docs/templates.md "Rules of templates"). */
  phase: Extract<BakePhase, "Pending" | "Converting" | "Distributing">;
  telemetry: TemplateTelemetry;
  abort?: AbortController;
  build?: Promise<void>;
}

export class TemplateRegistry {
  private readonly entries = new Map<string, Entry>();
  private running = 0;
  /** Running builds per owner. */
  private readonly runningBy = new Map<string, number>();
  /**
   * Waiting builds per owner, FIFO within an owner; the map's order is the round-robin order
   * (an owner served moves to the back).
   */
  private readonly waiting = new Map<string, Waiter[]>();

  constructor(
    private readonly driver: SandboxDriver,
    private readonly store: RecordStore<TemplateRecord>,
    private readonly log: (msg: string) => void,
    /** Builds that run at once (`SANDBOXD_BUILD_SLOTS`); default MAX_CONCURRENT_BUILDS. */
    private readonly slots: number = MAX_CONCURRENT_BUILDS,
  ) {}

  /** Loads the records: ready templates are handed back to the driver, interrupted builds fail. */
  async load(): Promise<void> {
    const { records, bad } = await this.store.list();
    for (const b of bad) this.log(`template record ${b.file} unreadable: ${b.error}`);
    for (const r of records) {
      let record = r;
      if (r.status === "building") {
        record = { ...r, status: "failed", error: "the agent restarted during the build" };
        await this.store.write(record);
      } else if (r.status === "ready" && r.prepared) {
        try {
          await this.driver.restoreTemplate(r.id, r.prepared);
          for (const x of r.extraSizes ?? [])
            await this.driver.restoreTemplate(sizedTemplateId(r.id, x), r.prepared);
        } catch (err) {
          const errorId = newErrorId();
          this.log(`template ${r.id} cannot be restored [${errorId}]: ${describeError(err)}`);
          record = {
            ...r,
            status: "failed",
            error: `template_files_gone: the template's files are gone (error id ${errorId})`,
          };
          await this.store.write(record);
        }
      }
      this.entries.set(r.id, {
        record,
        phase: "Converting",
        telemetry: (record.telemetry ?? {}) as TemplateTelemetry,
      });
    }
  }

  /** Starts a build and returns at once. An existing id is never overwritten (docs/sessions.md "Rules of the sessions API") unless
   * its build failed. */
  build(id: string, input: TemplateInput, size: Partial<VmSize> = {}, extraSizes: VmSize[] = []): void {
    this.assertBuildable(id);
    const record: TemplateRecord = { version: 1, id, status: "building", size };
    const entry: Entry = { record, phase: "Pending", telemetry: {}, abort: new AbortController() };
    const t0 = performance.now();
    this.entries.set(id, entry);
    const signal = entry.abort!.signal;
    const owner = buildOwner(id, input);
    entry.build = (async () => {
      // Slots are claimed in request order (before the first await): FIFO within an owner,
      // round-robin between owners.
      const slot = this.slot(owner, signal);
      try {
        await this.store.write(record);
      } catch (err) {
        if (await slot) this.release(owner);
        throw err;
      }
      // A build deleted while it waited never held a slot.
      if (!(await slot)) return;
      let tStart = performance.now();
      try {
        if (signal.aborted) return;
        tStart = performance.now();
        entry.telemetry = { pending_ms: tStart - t0 };
        entry.phase = "Converting";
        const onPhase = (p: BuildPhase) => {
          if (!signal.aborted) entry.phase = p;
        };
        const { telemetry, frozenSize, ...prepared }: PreparedWithTelemetry =
          await this.driver.prepareTemplate(id, input, signal, onPhase);
        if (signal.aborted) return;
        // Each other size class is a frozen template of its own, built from the same input in
        // this build's slot (docs/templates.md "Size classes"): the template is ready once all are.
        const built: VmSize[] = [];
        try {
          for (const x of input.kind === "copy" ? [] : extraSizes) {
            await this.driver.prepareTemplate(sizedTemplateId(id, x), { ...input, size: x }, signal);
            built.push(x);
            if (signal.aborted) return;
          }
        } catch (err) {
          // A failed class fails the template: the classes frozen before it go with the default.
          for (const x of built) {
            const xid = sizedTemplateId(id, x);
            await bestEffort(
              this.log,
              `dropping ${xid} after its template failed`,
              this.driver.dropTemplate(xid),
            );
          }
          await bestEffort(
            this.log,
            `dropping ${id} after a size class failed`,
            this.driver.dropTemplate(id),
          );
          throw err;
        }
        entry.telemetry = {
          ...entry.telemetry,
          converting_ms: performance.now() - tStart,
          ...telemetry,
          total_ms: performance.now() - t0,
        };
        entry.record = {
          ...record,
          ...(frozenSize ? { size: { ...frozenSize } } : {}),
          ...(built.length > 0 ? { extraSizes: built } : {}),
          status: "ready",
          readyAtMs: Date.now(),
          prepared,
          telemetry: entry.telemetry,
        };
      } catch (err) {
        if (signal.aborted) return;
        // The tenant reads `error`: a code, a short reason and the id of the full text logged here.
        const errorId = newErrorId();
        const tenant = input.kind === "oci" && input.tenantId ? ` of ${input.tenantId}` : "";
        this.log(`template ${id}${tenant} build failed [${errorId}]: ${describeError(err)}`);
        entry.record = { ...record, status: "failed", error: tenantErrorText(err, errorId) };
      } finally {
        this.release(owner);
      }
      await this.store.write(entry.record);
    })().catch((err) => this.log(`template ${id}: cannot write its record: ${describeError(err)}`));
  }

  /**
   * Throws `conflict` unless a build of `id` may start now: an id is never overwritten unless its
   * build failed, nor while it is being deleted. Asked by `build`, and by a copy before its bundle
   * is staged (agent/api/templates.ts), so a refused copy costs no transfer.
   */
  assertBuildable(id: string): void {
    const existing = this.entries.get(id);
    if (existing?.record.deleting) {
      throw new SandboxdError("conflict", `template ${id} is being deleted; VMs still run on it`);
    }
    if (existing && existing.record.status !== "failed") {
      throw new SandboxdError("conflict", `template ${id} already exists (${existing.record.status})`);
    }
  }

  status(id: string): TemplateBuildStatus {
    const e = this.visible(id);
    const r = e.record;
    const out: TemplateBuildStatus = {
      status: r.status,
      phase: r.status === "ready" ? "Live" : r.status === "failed" ? "Failed" : e.phase,
      exposedPorts: r.prepared?.exposedPorts ?? [],
      telemetry: { ...e.telemetry },
    };
    if (r.error !== undefined) out.error = r.error;
    if (r.readyAtMs !== undefined) out.readyAtMs = r.readyAtMs;
    return out;
  }

  /** The size the template's VMs get (what its build was asked for). */
  sizeOf(id: string): Partial<VmSize> {
    return this.mustGet(id).record.size ?? {};
  }

  /**
   * A template a VM can be spawned from, or the API's error for why not. `want` picks a size
   * class (docs/templates.md "Size classes"): the default one when it is absent or matches the
   * template's size, else one of its other classes; any other size is `bad_request`.
   */
  ready(id: string, want?: Partial<VmSize>, defaultSize?: VmSize): ReadyTemplate {
    const r = this.visible(id).record;
    if (r.status === "building") throw new SandboxdError("template_not_ready", `template ${id} is building`);
    if (r.status === "failed" || !r.prepared)
      throw new SandboxdError("template_not_ready", `template ${id} failed to build: ${r.error ?? ""}`);
    const own = { ...defaultSize, ...r.size };
    const matches = (s: Partial<VmSize>) =>
      (want?.vcpus === undefined || want.vcpus === s.vcpus) &&
      (want?.memMib === undefined || want.memMib === s.memMib);
    if (want === undefined || (want.vcpus === undefined && want.memMib === undefined) || matches(own))
      return { id, prepared: r.prepared, size: r.size ?? {} };
    const x = (r.extraSizes ?? []).find(matches);
    if (!x) {
      const sizes = [own, ...(r.extraSizes ?? [])].map(
        (s) => `${s.vcpus ?? "?"} vCPU/${s.memMib ?? "?"} MiB`,
      );
      throw new SandboxdError(
        "bad_request",
        `template ${id} has no size class of ${want.vcpus ?? "any"} vCPU and ${want.memMib ?? "any"} MiB; it has ${sizes.join(", ")}`,
      );
    }
    return { id: sizedTemplateId(id, x), prepared: r.prepared, size: x };
  }

  /** The size classes template `id` has besides its default one. */
  extraSizesOf(id: string): VmSize[] {
    return this.mustGet(id).record.extraSizes ?? [];
  }

  /**
   * Removes a template, or, while VMs still run on it (`inUse`), marks it deleting (docs/templates.md "Rules of templates":
   * in-flight VMs finish, then its resources are reclaimed): from then on it is unknown to
   * `status` and `ready` (nothing new spawns from it) and its id cannot be built again; the
   * manager calls this again with `inUse` false once the last of its VMs has ended.
   */
  async delete(id: string, inUse: boolean): Promise<"deleted" | "deferred"> {
    const e = this.entries.get(id);
    if (!e) return "deleted";
    if (inUse) {
      if (!e.record.deleting) {
        e.record = { ...e.record, deleting: true };
        await this.store.write(e.record);
      }
      return "deferred";
    }
    e.abort?.abort();
    this.entries.delete(id);
    // The delete answers once the cancelled build has removed its partial files, so a re-bake of
    // the same id or image never meets them.
    if (e.build) {
      let timer: ReturnType<typeof setTimeout> | undefined;
      const late = await Promise.race([
        e.build.then(() => false),
        new Promise<boolean>((r) => {
          timer = setTimeout(() => r(true), CANCEL_WAIT_MS);
        }),
      ]);
      clearTimeout(timer);
      if (late) this.log(`template ${id}: its cancelled build is still stopping after ${CANCEL_WAIT_MS} ms`);
    }
    await this.store.remove(id);
    await this.driver.dropTemplate(id);
    for (const x of e.record.extraSizes ?? []) await this.driver.dropTemplate(sizedTemplateId(id, x));
    return "deleted";
  }

  /** Every template id this agent can spawn from or build, in any state; not those being deleted. */
  ids(): string[] {
    return [...this.entries].filter(([, e]) => !e.record.deleting).map(([id]) => id);
  }

  /** The templates deleted while VMs still ran on them, waiting for the last to end. */
  deletingIds(): string[] {
    return [...this.entries].filter(([, e]) => e.record.deleting).map(([id]) => id);
  }

  /** Resolves when the build of `id` (if any) has finished. */
  async settled(id: string): Promise<void> {
    await this.entries.get(id)?.build;
  }

  /**
   * Waits for one of the `slots` build slots, shared between owners: a free slot
   * goes first to an owner with no build running (round-robin among them), so while others wait
   * an owner holds at most one slot more than it already had, and one tenant's queue of bakes
   * (each may hold its slot for its whole `ready` timeout) cannot keep the others out. An owner
   * alone uses every slot.
   * Resolves false, holding nothing, if `signal` aborts (the template was deleted) while it waits.
   */
  private slot(owner: string, signal: AbortSignal): Promise<boolean> {
    if (signal.aborted) return Promise.resolve(false);
    return new Promise<boolean>((resolve) => {
      const w: Waiter = {
        owner,
        grant: () => {
          signal.removeEventListener("abort", onAbort);
          resolve(true);
        },
      };
      const onAbort = () => {
        const q = this.waiting.get(owner);
        const i = q?.indexOf(w) ?? -1;
        if (q && i >= 0) {
          q.splice(i, 1);
          if (q.length === 0) this.waiting.delete(owner);
        }
        resolve(false);
      };
      signal.addEventListener("abort", onAbort, { once: true });
      const q = this.waiting.get(owner);
      if (q) q.push(w);
      else this.waiting.set(owner, [w]);
      this.dispatch();
    });
  }

  private release(owner: string): void {
    this.running--;
    const n = (this.runningBy.get(owner) ?? 1) - 1;
    if (n > 0) this.runningBy.set(owner, n);
    else this.runningBy.delete(owner);
    this.dispatch();
  }

  /**
   * Hands free slots to waiting builds: the first owner in round-robin order with nothing
   * running, else (every waiting owner runs one already) the first in that order.
   */
  private dispatch(): void {
    while (this.running < this.slots && this.waiting.size > 0) {
      const owners = [...this.waiting.keys()];
      const owner = owners.find((o) => !this.runningBy.has(o)) ?? owners[0]!;
      const q = this.waiting.get(owner)!;
      const w = q.shift()!;
      // The served owner goes to the back of the rotation.
      this.waiting.delete(owner);
      if (q.length > 0) this.waiting.set(owner, q);
      this.running++;
      this.runningBy.set(owner, (this.runningBy.get(owner) ?? 0) + 1);
      w.grant();
    }
  }

  /** Builds waiting and running per owner (for tests and diagnostics). */
  slotsByOwner(): { running: Record<string, number>; waiting: Record<string, number> } {
    return {
      running: Object.fromEntries(this.runningBy),
      waiting: Object.fromEntries([...this.waiting].map(([o, q]) => [o, q.length])),
    };
  }

  /** A template as the API sees it: one being deleted is already gone (docs/templates.md "Rules of templates" "removed"). */
  private visible(id: string): Entry {
    const e = this.mustGet(id);
    if (e.record.deleting) throw new SandboxdError("not_found", `template ${id} is being deleted`);
    return e;
  }

  private mustGet(id: string): Entry {
    const e = this.entries.get(id);
    if (!e) throw new SandboxdError("not_found", `template ${id} is unknown to this agent`);
    return e;
  }
}
