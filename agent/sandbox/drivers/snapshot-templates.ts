/**
 * The templates of the snapshot driver (snapshot.ts): the ones this process can restore from, by
 * the manager's template id, and their builds (snapshot-build.ts) with the image caches kept under
 * their budget around each build.
 */
import { createHash } from "node:crypto";
import { existsSync } from "node:fs";
import { open, rm } from "node:fs/promises";
import { dirname } from "node:path";
import { describeError, SandboxdError } from "../../../contracts/errors.ts";
import { evictImageCaches } from "../../image/evict.ts";
import type { ImageConfig } from "../../image/import.ts";
import { claimShmRoot } from "../../snapshot/shm.ts";
import { allocatedBytes } from "../../snapshot/sparse.ts";
import { deleteTemplate, listTemplates, loadTemplate, type TemplateMeta } from "../../snapshot/template.ts";
import { exportTemplate, importTemplate } from "../../snapshot/template-copy.ts";
import type { PreparedWithTelemetry } from "../templates.ts";
import type { BuildPhase, PreparedTemplate, TemplateInput, VmSize } from "./driver.ts";
import { type BuildContext, buildFromInput } from "./snapshot-build.ts";

/** The engine's template ids (template.ts ID_RE); other manager ids are mapped by hash. */
const ENGINE_TEMPLATE_ID = /^[a-z0-9][a-z0-9-]{0,40}$/;

/** Template ids the engine accepts: the manager's id when it fits, else a stable hash of it. */
export function engineTemplateId(templateId: string): string {
  if (ENGINE_TEMPLATE_ID.test(templateId)) return templateId;
  const h = createHash("sha256").update(templateId).digest("hex").slice(0, 16);
  return `t-${h}`;
}

/** What the templates need of the driver: a build's context and the image caches' budget. */
export interface TemplatesContext extends Omit<BuildContext, "building"> {
  imageCacheBytes: number;
}

export type Template = { meta: TemplateMeta; image: ImageConfig };

export class SnapshotTemplates {
  private readonly templates = new Map<string, Template>();
  /** Engine template ids being built by this process (their files are not registered yet). */
  readonly building = new Set<string>();
  /** Image cache entries (directories) that builds in progress hold, with how many hold each. */
  private readonly pinned = new Map<string, number>();

  constructor(private readonly ctx: TemplatesContext) {}

  /** RAM files of the templates this process knows (registered or not). */
  memPaths(): string[] {
    return [...this.templates.values()].map((t) => t.meta.memPath);
  }

  /** Returns `PreparedWithTelemetry`: the registry reports its `telemetry` (docs/templates.md "Rules of templates"). */
  async prepare(
    templateId: string,
    input: TemplateInput,
    signal: AbortSignal,
    onPhase?: (phase: BuildPhase) => void,
  ): Promise<PreparedTemplate> {
    const held: string[] = [];
    // Before (room for this pull and import) and after (what this build added), the image caches
    // go back under their budget; the entries this build holds are kept meanwhile.
    await this.evictImages();
    try {
      return await this.prepareHolding(templateId, input, signal, held, onPhase);
    } finally {
      for (const d of held) {
        const n = (this.pinned.get(d) ?? 1) - 1;
        if (n > 0) this.pinned.set(d, n);
        else this.pinned.delete(d);
      }
      await this.evictImages();
    }
  }

  private hold(held: string[], dir: string): void {
    held.push(dir);
    this.pinned.set(dir, (this.pinned.get(dir) ?? 0) + 1);
  }

  /**
   * The image caches least-recently-used down to `SANDBOXD_IMAGE_CACHE_BYTES`, keeping every
   * base disk a template of this data dir stands on and every entry a build here holds. Never
   * fails a build: a failed eviction is logged.
   */
  private async evictImages(): Promise<void> {
    try {
      const bases = new Set((await listTemplates(this.ctx.stateDir)).map((t) => dirname(t.baseDisk)));
      await evictImageCaches(this.ctx.cacheDir, {
        budgetBytes: this.ctx.imageCacheBytes,
        inUse: (dir) => bases.has(dir) || this.pinned.has(dir),
        log: this.ctx.log,
      });
    } catch (err) {
      this.ctx.log(`image cache eviction failed: ${describeError(err)}`);
    }
  }

  private async prepareHolding(
    templateId: string,
    input: TemplateInput,
    signal: AbortSignal,
    held: string[],
    onPhase?: (phase: BuildPhase) => void,
  ): Promise<PreparedTemplate> {
    const id = engineTemplateId(templateId);
    if (input.kind === "copy") return await this.copyIn(templateId, id, input.path, signal, onPhase);
    const { meta, image, importMs, pullMs } = await buildFromInput(
      {
        stateDir: this.ctx.stateDir,
        cacheDir: this.ctx.cacheDir,
        registry: this.ctx.registry,
        shmRoot: this.ctx.shmRoot,
        defaultSize: this.ctx.defaultSize,
        artifacts: this.ctx.artifacts,
        accel: this.ctx.accel,
        host: this.ctx.host,
        timeouts: this.ctx.timeouts,
        log: this.ctx.log,
        building: this.building,
      },
      templateId,
      id,
      input,
      signal,
      (dir) => this.hold(held, dir),
      onPhase,
    );
    this.templates.set(templateId, { meta, image: image.config });
    this.ctx.log(
      `template ${templateId} (${id}) frozen: boot ${meta.timings?.bootMs.toFixed(0)} ms, snapshot ${meta.timings?.snapshotMs.toFixed(0)} ms`,
    );
    const prepared: PreparedWithTelemetry = {
      image: image.config,
      // A bake's `ready.ports` (docs/templates.md "Rules of templates") are the template's ports; else the image's ExposedPorts.
      exposedPorts:
        input.kind === "oci" && input.exposedPorts ? [...input.exposedPorts] : image.config.exposedPorts,
      telemetry: snapshotTelemetry(meta, importMs, pullMs),
    };
    return prepared;
  }

  /** A template copied from another agent: its bundle staged at `path` (removed here). */
  private async copyIn(
    templateId: string,
    id: string,
    path: string,
    signal: AbortSignal,
    onPhase?: (phase: BuildPhase) => void,
  ): Promise<PreparedWithTelemetry> {
    try {
      onPhase?.("Converting");
      // A failed build or copy of the same id left its meta.json: cleared for this one.
      const old = (await listTemplates(this.ctx.stateDir)).find((t) => t.id === id);
      if (old && old.state !== "building") await deleteTemplate(this.ctx.stateDir, id);
      await claimShmRoot(this.ctx.shmRoot, this.ctx.stateDir);
      this.building.add(id);
      const file = await open(path, "r");
      let r: Awaited<ReturnType<typeof importTemplate>>;
      try {
        r = await importTemplate({
          dataDir: this.ctx.stateDir,
          cacheDir: this.ctx.cacheDir,
          shmRoot: this.ctx.shmRoot,
          id,
          bundle: file.readableWebStream() as ReadableStream<Uint8Array>,
          artifacts: this.ctx.artifacts,
          accel: this.ctx.accel,
          host: this.ctx.host,
          signal,
          onDistributing: () => onPhase?.("Distributing"),
          log: this.ctx.log,
        });
      } finally {
        await file.close();
        this.building.delete(id);
      }
      if (!r.ok) throw r.error;
      const { meta, config, exposedPorts } = r.value;
      if (signal.aborted) {
        await deleteTemplate(this.ctx.stateDir, id);
        throw new SandboxdError("gone", `template ${templateId} was deleted during its copy`);
      }
      this.templates.set(templateId, { meta, image: config });
      return {
        image: config,
        exposedPorts,
        frozenSize: { memMib: meta.memMib, vcpus: meta.vcpus },
        telemetry: {
          ...(meta.timings?.distributeMs !== undefined ? { distributing_ms: meta.timings.distributeMs } : {}),
          snapshot_bytes: {
            memory: await allocatedBytes(meta.memPath),
            device_state: meta.stateBytes ?? 0,
            disk: await allocatedBytes(meta.disk),
          },
        },
      };
    } finally {
      await rm(path, { force: true });
    }
  }

  /** The bundle another agent copies ready template `templateId` from (template-copy.ts). */
  async export(templateId: string, prepared: PreparedTemplate): Promise<AsyncIterable<Uint8Array>> {
    if (!this.templates.has(templateId))
      throw new SandboxdError("not_found", `template ${templateId} is not prepared on this agent`);
    return await exportTemplate(this.ctx.stateDir, engineTemplateId(templateId), {
      config: prepared.image,
      exposedPorts: prepared.exposedPorts,
    });
  }

  async restore(templateId: string, prepared: PreparedTemplate): Promise<void> {
    const r = await loadTemplate(this.ctx.stateDir, engineTemplateId(templateId));
    if (!r.ok) throw r.error;
    const meta = r.value;
    // tmpfs does not survive a host reboot: a template without its RAM file cannot be restored.
    for (const f of [meta.memPath, meta.statePath, meta.disk])
      if (!existsSync(f)) throw new SandboxdError("gone", `template ${templateId}: ${f} is missing`);
    this.templates.set(templateId, { meta, image: prepared.image });
  }

  async drop(templateId: string): Promise<void> {
    this.templates.delete(templateId);
    // Files still used by VMs of this template stay until the last of them ends (chain store).
    const r = await deleteTemplate(this.ctx.stateDir, engineTemplateId(templateId));
    if (!r.ok && r.error.code !== "template_not_found") throw r.error;
  }

  /** Virtual size of the template's disk, what each of its VMs' overlays may grow to; 0 unknown. */
  diskBytes(templateId: string): number {
    return this.templates.get(templateId)?.meta.diskBytes ?? 0;
  }

  /** The template and the one size its VMs have; throws for another. */
  sized(templateId: string, size: VmSize): Template {
    const t = this.templates.get(templateId);
    if (!t) throw new SandboxdError("not_found", `template ${templateId} is not prepared on this agent`);
    if (size.memMib !== t.meta.memMib || size.vcpus !== t.meta.vcpus)
      throw new SandboxdError(
        "bad_request",
        `template ${templateId} was frozen with ${t.meta.memMib} MiB and ${t.meta.vcpus} vCPU; a restore cannot change the size (asked ${size.memMib} MiB, ${size.vcpus} vCPU)`,
      );
    return t;
  }
}

/** Readiness telemetry of a frozen template (contracts/api/sandboxes-api.ts TemplateTelemetry). */
function snapshotTelemetry(
  meta: TemplateMeta,
  importMs: number,
  pullMs: number | undefined,
): PreparedWithTelemetry["telemetry"] {
  const t = meta.timings;
  const pull = pullMs !== undefined ? { pull_ms: pullMs } : {};
  if (!t) return { ...pull, import_ms: importMs };
  return {
    ...pull,
    import_ms: importMs,
    boot_ms: t.bootMs,
    ready_cmd_ms: t.readyCmdMs,
    snapshot_ms: t.snapshotMs,
    converting_ms: (pullMs ?? 0) + importMs + t.bootMs + t.readyCmdMs + t.snapshotMs,
    ...(t.distributeMs !== undefined ? { distributing_ms: t.distributeMs } : {}),
    snapshot_bytes: {
      memory: meta.memFileBytes ?? 0,
      device_state: meta.stateBytes ?? 0,
      disk: meta.diskFileBytes ?? 0,
    },
  };
}
