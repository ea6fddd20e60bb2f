/**
 * One template build of the snapshot driver: the image pulled (OCI) or taken as uploaded, imported
 * into the image cache, booted and frozen by the snapshot engine (agent/snapshot/template.ts).
 */
import { SandboxdError } from "../../../contracts/errors.ts";
import type { GuestArtifacts } from "../../guest/artifacts.ts";
import { type ImportedImage, importImage } from "../../image/import.ts";
import { pullImage, type RegistryConfig } from "../../image/pull.ts";
import type { Accel } from "../../qemu/launch.ts";
import { claimShmRoot } from "../../snapshot/shm.ts";
import { buildTemplate, deleteTemplate, listTemplates, type TemplateMeta } from "../../snapshot/template.ts";
import type { VmHostSettings } from "../../vm/host-settings.ts";
import type { BuildPhase, TemplateInput, VmSize } from "./driver.ts";

/** What a build needs of its driver. */
export interface BuildContext {
  stateDir: string;
  cacheDir: string;
  registry: RegistryConfig;
  shmRoot: string;
  defaultSize: VmSize;
  artifacts: GuestArtifacts;
  accel: Accel;
  /** The operator's jail and disk-reserve settings. */
  host: VmHostSettings;
  timeouts: { bootMs?: number; readyMs?: number; restoreMs?: number } | undefined;
  log: (msg: string) => void;
  /** Engine template ids being built by this process (their files are not registered yet). */
  building: Set<string>;
}

export interface BuiltTemplate {
  meta: TemplateMeta;
  image: ImportedImage;
  importMs: number;
  pullMs: number | undefined;
}

/**
 * Builds template `templateId` (engine id `id`) from `input`; `hold` pins each image cache entry
 * it uses against eviction until the caller lets go.
 */
export async function buildFromInput(
  ctx: BuildContext,
  templateId: string,
  id: string,
  input: Exclude<TemplateInput, { kind: "copy" }>,
  signal: AbortSignal,
  hold: (dir: string) => void,
  onPhase?: (phase: BuildPhase) => void,
): Promise<BuiltTemplate> {
  onPhase?.("Converting");
  // A failed (or orphaned) build of the same id left its meta.json: clear it for the rebuild.
  const old = (await listTemplates(ctx.stateDir)).find((t) => t.id === id);
  if (old && old.state !== "building") await deleteTemplate(ctx.stateDir, id);
  let source = input.kind === "archive" ? input.path : "";
  let pullMs: number | undefined;
  if (input.kind === "oci") {
    // Pulled once per repository and manifest digest into the cache, and used only after the
    // registry served this bake's credentials the manifest (agent/image/pull.ts); then imported
    // like any OCI layout (the import is cached by config digest too).
    const pulled = await pullImage({
      reference: input.image,
      cacheDir: ctx.cacheDir,
      registry: ctx.registry,
      diskReserveBytes: ctx.host.diskReserveBytes,
      ...(input.registryAuth ? { auth: input.registryAuth } : {}),
      signal,
      log: ctx.log,
    });
    source = pulled.layout;
    hold(pulled.layout);
    pullMs = pulled.pullMs;
  }
  if (signal.aborted) throw new SandboxdError("gone", `template ${templateId} was deleted during its build`);
  // The RAM root goes with its last RAM file (agent/storage/chain.ts): make and claim it again.
  await claimShmRoot(ctx.shmRoot, ctx.stateDir);
  const tImport = performance.now();
  // Both are the tenant's: an upload, and a pull from a registry the tenant names, whose manifest
  // may pair another image's config (its digest is no secret) with layers of the tenant's own.
  // skopeo checks each blob against that manifest only, so the import scans every layer against
  // the config's diff ids before the cache may answer on the config digest.
  const image = await importImage({
    source,
    dataDir: ctx.cacheDir,
    log: ctx.log,
    trustedSource: false,
    signal,
    diskReserveBytes: ctx.host.diskReserveBytes,
  });
  hold(image.dir);
  const importMs = performance.now() - tImport;
  if (signal.aborted) throw new SandboxdError("gone", `template ${templateId} was deleted during its build`);
  const size = { ...ctx.defaultSize, ...input.size };
  ctx.building.add(id);
  let meta: TemplateMeta;
  try {
    const r = await buildTemplate({
      dataDir: ctx.stateDir,
      image,
      artifacts: ctx.artifacts,
      accel: ctx.accel,
      id,
      memMib: size.memMib,
      vcpus: size.vcpus,
      shmRoot: ctx.shmRoot,
      host: ctx.host,
      ...(input.readyCmd ? { readyCmd: input.readyCmd } : {}),
      ...(input.readyTimeoutMs || ctx.timeouts?.readyMs
        ? { readyTimeoutMs: input.readyTimeoutMs || ctx.timeouts?.readyMs }
        : {}),
      // A build's own wait_secs bounds its bring-up; otherwise the operator's boot timeout.
      ...(input.kind === "archive" && input.bringupTimeoutMs !== undefined
        ? { bringupTimeoutMs: input.bringupTimeoutMs }
        : ctx.timeouts?.bootMs
          ? { bringupTimeoutMs: ctx.timeouts.bootMs }
          : {}),
      ...(input.kind === "oci" && input.readyEnv ? { readyEnv: input.readyEnv } : {}),
      onDistributing: () => onPhase?.("Distributing"),
      log: ctx.log,
      signal,
    });
    if (!r.ok) throw r.error;
    meta = r.value;
  } finally {
    ctx.building.delete(id);
  }
  if (signal.aborted) {
    await deleteTemplate(ctx.stateDir, id);
    throw new SandboxdError("gone", `template ${templateId} was deleted during its build`);
  }
  return { meta, image, importMs, pullMs };
}
