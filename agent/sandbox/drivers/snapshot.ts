/**
 * A `SandboxDriver` on the snapshot engine (agent/snapshot/): templates are booted once and
 * frozen (RAM file on tmpfs + ~60 KB device state), `spawn` restores one (~200 ms under TCG
 * instead of a ~3 s cold boot), `fork` is a live fork of a running VM, `suspend`/`resume` save
 * the whole VM to disk and back.
 *
 * Resource owners. Every VM belongs to exactly one sandbox record (vmId = record id):
 * - its QEMU, sockets, console log and `snapshot-vm.json` live in `<stateDir>/vms/<id>/`;
 * - its overlays, suspend state file and the RAM files it maps are in the chain store
 *   (agent/storage/chain.ts) held by `vm:<id>`; files shared with a template or a fork family
 *   are refcounted and freed with their last holder.
 * `destroy` kills the QEMU, releases `vm:<id>` and removes the directory; `reap` (agent start)
 * kills and removes every VM directory no record claims, releases the holders whose directory is
 * gone (`reclaimSnapshotStorage`), and sweeps files the chain store does not know (left by a
 * crash between creating a file and registering it).
 *
 * Restarts. QEMUs are launched with `dieWithParent: false`: they outlive the agent process.
 * The VM's record `snapshot-vm.json` (agent/snapshot/persist.ts; written after every spawn, fork,
 * suspend and resume) holds what a new agent process needs to drive the VM again: its disk chain
 * top and QEMU node name, RAM file, overlay generation, the template's shape, the image config,
 * and while suspended the state file. So
 * `adopt` re-attaches to a running VM (QMP + guest HELLO), and `resume` works from the record
 * alone after a restart (snapshot-restart.ts: the record, the re-attach, the reap's file sweep).
 *
 * The templates this driver restores from, and their builds, are in snapshot-templates.ts.
 */
import { lstatSync, readdirSync } from "node:fs";
import { rm, stat } from "node:fs/promises";
import { dirname, join, resolve } from "node:path";
import { bestEffort } from "../../../contracts/best-effort.ts";
import { freeBytesSync } from "../../../contracts/disk-space.ts";
import { describeError, SandboxdError } from "../../../contracts/errors.ts";
import { checkDestination, defaultFence, type EgressFence } from "../../egress/fence.ts";
import { ensureGuestArtifacts, type GuestArtifacts } from "../../guest/artifacts.ts";
import type { GuestClient, GuestTunnel, PtyOptions } from "../../guest/client.ts";
import { imageCacheBudgetFromEnv } from "../../image/evict.ts";
import type { ImageConfig } from "../../image/import.ts";
import { type DestinationCheck, type RegistryConfig, registryConfigFromEnv } from "../../image/pull.ts";
import { probeAccelerator } from "../../qemu/accel.ts";
import type { Accel, VmExit, VmProcess } from "../../qemu/launch.ts";
import { refuseTakenUidRange } from "../../qemu/uids.ts";
import type { SnapshotError } from "../../snapshot/errors.ts";
import { forkVm } from "../../snapshot/fork.ts";
import { DEFAULT_FORK_METHOD, type ForkMethod, readyForkMethod } from "../../snapshot/fork-method.ts";
import {
  dropKept,
  type KeptRecord,
  keepVm,
  listKept,
  restoreInPlace,
  startFromKept,
} from "../../snapshot/keep.ts";
import { VM_RECORD_FILE, type VmRecord, writeVmRecord } from "../../snapshot/persist.ts";
import { claimShmRoot, sweepOrphanShmRoots } from "../../snapshot/shm.ts";
import { type Prelaunched, prelaunchFromTemplate, spawnFromTemplate } from "../../snapshot/spawn.ts";
import { armStandby, dropStandbyFor } from "../../snapshot/standby.ts";
import { pauseVm, resumeVm, suspendVm, unpauseVm } from "../../snapshot/suspend.ts";
import { defaultShmRoot } from "../../snapshot/template.ts";
import type { SandboxVm } from "../../snapshot/vm.ts";
import { openChainStore } from "../../storage/chain.ts";
import { DEFAULT_VM_HOST, type VmHostSettings } from "../../vm/host-settings.ts";
import { killRecordedQemu } from "../../vm/process.ts";
import { reapVmDirs, removeVmDir, vmsRoot } from "../../vm/workdir.ts";
import type {
  AdoptRef,
  BuildPhase,
  DriverVm,
  PreparedTemplate,
  SandboxDriver,
  TemplateInput,
  VmExitInfo,
  VmSize,
} from "./driver.ts";
import {
  attachRunning,
  loadRecord,
  reapSnapshotFiles,
  recordOf,
  restoreRecord,
  saveRecord,
} from "./snapshot-restart.ts";
import { SnapshotTemplates, type Template } from "./snapshot-templates.ts";

// Importers name the template id mapping by the driver.
export { engineTemplateId } from "./snapshot-templates.ts";

export interface SnapshotDriverOptions {
  /** Guest artifacts and imported images are cached here (shared between agents and tests). */
  cacheDir: string;
  /** The agent's state dir (the manager's): records, `vms/`, `templates/`, `storage/`. */
  stateDir: string;
  /** Reuse artifacts already ensured (tests); default: `ensureGuestArtifacts(cacheDir)`. */
  artifacts?: GuestArtifacts;
  /** Override the probe (tests); default: probe KVM, else TCG. */
  accel?: Accel;
  /** The operator's `SANDBOXD_ACCEL` (auto, kvm, tcg), for the probe when `accel` is not given. */
  accelSetting?: string;
  /** The operator's jail and disk-reserve settings; default DEFAULT_VM_HOST. */
  host?: VmHostSettings;
  /** tmpfs directory for RAM and fork state files; default `/dev/shm/sandboxd/<hash>`. */
  shmRoot?: string;
  /** Size of a template whose input says none (the manager passes its own default). */
  defaultSize?: VmSize;
  /** Registry credentials and insecure registries for OCI pulls (the agent's settings); default: none. */
  registry?: RegistryConfig;
  /** Budget of the image caches in `cacheDir` (image/evict.ts); default `DEFAULT_IMAGE_CACHE_BYTES` (the agent passes SANDBOXD_IMAGE_CACHE_BYTES). */
  imageCacheBytes?: number;
  /**
   * Bring-up deadlines (operator settings; each defaults to the engine's constant):
   * `bootMs` a template build's cold boot to the guest's HELLO (template.ts), `readyMs` its ready
   * command when the template names no timeout, `restoreMs` a restore (spawn, fork child, resume)
   * to the guest's first answer (vm.ts).
   */
  timeouts?: { bootMs?: number; readyMs?: number; restoreMs?: number };
  /**
   * How forks copy the parent's memory (operator setting; agent/snapshot/fork-method.ts). `create`
   * settles it once: a background snapshot falls back to stop-and-copy where the host cannot.
   */
  forkMethod?: ForkMethod;
  log?: (msg: string) => void;
}

/** The manager's default (manager.ts): 1 vCPU, 256 MiB. */
const DEFAULT_SIZE: VmSize = { vcpus: 1, memMib: 256 };

interface Live {
  sbx: SandboxVm;
  proc: VmProcess;
  handle: DriverVm;
  destroying: boolean;
  exitFired: boolean;
}

export class SnapshotDriver implements SandboxDriver {
  readonly name: string;
  private readonly stateDir: string;
  private readonly shmRoot: string;
  private readonly defaultSize: VmSize;
  private readonly registry: RegistryConfig;
  private readonly templates: SnapshotTemplates;
  private readonly live = new Map<string, Live>();
  private readonly imageCacheBytes: number;
  private readonly host: VmHostSettings;
  private kept: Promise<Map<string, KeptRecord>> | undefined;
  /** What forks use, settled by `create` (readyForkMethod). */
  forkMethod: ForkMethod = "stop-copy";
  /** QEMUs launched ahead of their spawn (`prelaunch`), by VM id. */
  private readonly prelaunched = new Map<string, { templateId: string; pre: Prelaunched }>();
  /** Suspended VMs this process knows; after a restart they are read from their VM file. */
  private readonly suspended = new Map<string, { sbx: SandboxVm; record: VmRecord }>();
  private detached = false;
  private guestTunnelHandler: ((vmId: string, t: GuestTunnel) => void) | undefined;
  private readonly log: (msg: string) => void;

  private constructor(
    private readonly opts: SnapshotDriverOptions,
    private readonly artifacts: GuestArtifacts,
    readonly accel: Accel,
  ) {
    this.name = `snapshot (${accel})`;
    this.log = opts.log ?? (() => {});
    this.stateDir = resolve(opts.stateDir);
    this.shmRoot = opts.shmRoot ?? defaultShmRoot(this.stateDir);
    this.defaultSize = opts.defaultSize ?? DEFAULT_SIZE;
    // The agent passes its settings (cli/settings/); without them, the defaults behind the fence.
    this.registry = opts.registry ?? {
      ...registryConfigFromEnv({}),
      checkDestination: fencedRegistry(),
      fence: defaultFence(),
    };
    this.imageCacheBytes = opts.imageCacheBytes ?? imageCacheBudgetFromEnv({});
    this.host = opts.host ?? DEFAULT_VM_HOST;
    this.templates = new SnapshotTemplates({
      stateDir: this.stateDir,
      cacheDir: opts.cacheDir,
      registry: this.registry,
      shmRoot: this.shmRoot,
      defaultSize: this.defaultSize,
      artifacts,
      accel,
      host: this.host,
      timeouts: opts.timeouts,
      log: this.log,
      imageCacheBytes: this.imageCacheBytes,
    });
  }

  static async create(opts: SnapshotDriverOptions): Promise<SnapshotDriver> {
    // Before any VM: a uid range a user holds would hand that user the jails' identity.
    refuseTakenUidRange((opts.host ?? DEFAULT_VM_HOST).jail.uidRange);
    const [artifacts, accel] = await Promise.all([
      opts.artifacts ?? ensureGuestArtifacts({ dataDir: opts.cacheDir, log: opts.log }),
      opts.accel
        ? Promise.resolve(opts.accel)
        : probeAccelerator({
            log: opts.log,
            ...(opts.accelSetting !== undefined ? { setting: opts.accelSetting } : {}),
          }).then((a) => a.accel),
    ]);
    const driver = new SnapshotDriver(opts, artifacts, accel);
    driver.forkMethod = await readyForkMethod(opts.forkMethod ?? DEFAULT_FORK_METHOD, driver.log);
    // RAM files live on tmpfs, outside the data dir: claim ours and drop those whose data dir was
    // removed (agent/snapshot/shm.ts), so an `rm -rf` of a data dir does not strand its RAM files.
    await claimShmRoot(driver.shmRoot, driver.stateDir);
    const swept = await sweepOrphanShmRoots(dirname(driver.shmRoot));
    for (const root of swept) driver.log(`removed RAM files of a deleted data dir: ${root}`);
    return driver;
  }

  // ---- templates -----------------------------------------------------------------------------

  prepareTemplate(
    templateId: string,
    input: TemplateInput,
    signal: AbortSignal,
    onPhase?: (phase: BuildPhase) => void,
  ): Promise<PreparedTemplate> {
    return this.templates.prepare(templateId, input, signal, onPhase);
  }

  restoreTemplate(templateId: string, prepared: PreparedTemplate): Promise<void> {
    return this.templates.restore(templateId, prepared);
  }

  dropTemplate(templateId: string): Promise<void> {
    return this.templates.drop(templateId);
  }

  exportTemplate(templateId: string, prepared: PreparedTemplate): Promise<AsyncIterable<Uint8Array>> {
    return this.templates.export(templateId, prepared);
  }

  // ---- VMs -----------------------------------------------------------------------------------

  async spawn(templateId: string, vmId: string, size: VmSize): Promise<DriverVm> {
    const held = this.prelaunched.get(vmId);
    this.prelaunched.delete(vmId);
    let t: Template;
    try {
      t = this.templates.sized(templateId, size);
    } catch (err) {
      await held?.pre.discard();
      throw err;
    }
    // One launched for another template (or a rebuilt one) is discarded by spawnFromTemplate.
    const r = await spawnFromTemplate({
      dataDir: this.stateDir,
      template: t.meta,
      id: vmId,
      dieWithParent: false,
      host: this.host,
      log: this.log,
      ...(held ? { prelaunched: held.pre } : {}),
      ...this.restoreDeadline(),
    });
    if (!r.ok) throw spawnError(r.error, `VM ${vmId} did not start from template ${templateId}`);
    return this.track(r.value.vm, templateId, t.image, size, r.value.timings.readyMs);
  }

  async prelaunch(templateId: string, vmId: string, size: VmSize): Promise<void> {
    const t = this.templates.sized(templateId, size);
    if (this.prelaunched.has(vmId) || this.live.has(vmId))
      throw new SandboxdError("conflict", `VM ${vmId} already exists`);
    // Outlives the agent process like every sandbox's QEMU (it becomes one); a stop of the agent
    // destroys it (the pool's close) and a crash leaves it to the next agent's reap.
    const r = await prelaunchFromTemplate({
      dataDir: this.stateDir,
      template: t.meta,
      id: vmId,
      dieWithParent: false,
      host: this.host,
      log: this.log,
    });
    if (!r.ok) throw spawnError(r.error, `VM ${vmId} did not launch for template ${templateId}`);
    this.prelaunched.set(vmId, { templateId, pre: r.value });
  }

  /** The operator's restore deadline, when set, as the engine's spawn/fork/resume take it. */
  private restoreDeadline(): { readyTimeoutMs?: number } {
    const ms = this.opts.timeouts?.restoreMs;
    return ms ? { readyTimeoutMs: ms } : {};
  }

  async fork(parent: DriverVm, childIds: string[]): Promise<DriverVm[]> {
    const l = this.mustLive(parent);
    const r = await forkVm(l.sbx, {
      count: childIds.length,
      ids: childIds,
      method: this.forkMethod,
      log: this.log,
      ...this.restoreDeadline(),
    });
    // The parent moved onto a new overlay (also when only the children failed): record it.
    if (l.sbx.state !== "dead")
      await bestEffort(this.log, `recording VM ${l.sbx.id} on its new overlay`, saveRecord(l.sbx, l.handle));
    if (!r.ok) throw r.error;
    this.log(
      `fork of ${parent.vmId} into ${childIds.length}: parent stalled ${r.value.timings.parentStallMs.toFixed(1)} ms, children ready after ${r.value.timings.childrenReadyMs.toFixed(0)} ms`,
    );
    const out: DriverVm[] = [];
    try {
      for (const [i, id] of childIds.entries()) {
        const child = r.value.children.find((c) => c.id === id);
        if (!child) throw new SandboxdError("internal", `fork returned no child ${id}`);
        const ms = r.value.timings.children[i]?.readyMs ?? r.value.timings.childrenReadyMs;
        out.push(await this.track(child, parent.templateId, parent.image, parent.size, ms));
      }
    } catch (err) {
      for (const c of r.value.children) await this.destroy(c.id, this.live.get(c.id)?.handle);
      throw err;
    }
    return out;
  }

  async keep(vm: DriverVm, ref: string, ports: string[]): Promise<{ sizeBytes: number; stallMs: number }> {
    const l = this.mustLive(vm);
    // `source`: a rollback of this same VM to it keeps the VM's boot id (keep.ts restoreInPlace).
    const notes = { templateId: vm.templateId, size: vm.size, image: vm.image, ports, source: vm.vmId };
    const r = await keepVm(l.sbx, ref, { method: this.forkMethod, notes, log: this.log });
    // The parent moved onto a new overlay (also when keeping failed after that): record it.
    if (l.sbx.state !== "dead")
      await bestEffort(this.log, `recording VM ${l.sbx.id} on its new overlay`, saveRecord(l.sbx, l.handle));
    if (!r.ok) throw r.error;
    (await this.keptRecords()).set(ref, r.value.record);
    // The next rollback of this VM to it takes a QEMU launched now (docs/snapshots.md).
    armStandby(l.sbx, r.value.record);
    this.log(`kept snapshot ${ref} of ${vm.vmId}: stalled ${r.value.parentStallMs.toFixed(1)} ms`);
    return { sizeBytes: r.value.record.sizeBytes, stallMs: r.value.parentStallMs };
  }

  async spawnFromKept(ref: string, vmId: string): Promise<{ vm: DriverVm; ports: string[] }> {
    const record = (await this.keptRecords()).get(ref);
    if (!record) throw new SandboxdError("not_found", `snapshot ${ref} is not kept on this agent`);
    const r = await startFromKept(record, vmId, {
      host: this.host,
      log: this.log,
      ...this.restoreDeadline(),
    });
    if (!r.ok) throw spawnError(r.error, `VM ${vmId} did not start from snapshot ${ref}`);
    const n = record.notes as { templateId: string; size: VmSize; image: ImageConfig; ports: string[] };
    const vm = await this.track(r.value.vm, n.templateId, n.image, n.size, r.value.timings.readyMs);
    return { vm, ports: n.ports };
  }

  async restoreKept(
    vm: DriverVm,
    ref: string,
  ): Promise<{ vm: DriverVm; restoreMs: number; downMs: number; standby: boolean }> {
    const l = this.mustLive(vm);
    const record = (await this.keptRecords()).get(ref);
    if (!record) throw new SandboxdError("not_found", `snapshot ${ref} is not kept on this agent`);
    const n = record.notes as { templateId: string; source?: string };
    if (n.templateId !== vm.templateId)
      throw new SandboxdError(
        "conflict",
        `snapshot ${ref} is of template ${n.templateId}; sandbox ${vm.vmId} runs ${vm.templateId}`,
      );
    const r = await restoreInPlace(l.sbx, record, {
      sameMachine: n.source === vm.vmId,
      ...this.restoreDeadline(),
    });
    if (!r.ok) {
      const lost = l.sbx.state === "dead";
      if (lost) {
        l.destroying = true;
        this.live.delete(vm.vmId);
      }
      const e = r.error;
      throw new SandboxdError(
        e.code === "bad_request" ? "conflict" : e.code === "bringup_timeout" ? e.code : "spawn_failed",
        e.message,
        {
          cause: e,
          details: { ...(e.details ?? {}), lost },
        },
      );
    }
    // The old QEMU is gone (its exit was an intended one: the VM no longer points at it).
    this.live.delete(vm.vmId);
    const handle = await this.track(l.sbx, vm.templateId, vm.image, vm.size, r.value.timings.readyMs);
    armStandby(l.sbx, record);
    const t = r.value.timings;
    this.log(
      `rolled ${vm.vmId} back to ${ref}${r.value.standby ? " (standby)" : ""}: ${r.value.totalMs.toFixed(0)} ms, down ${r.value.downMs.toFixed(0)} ms (launch ${t.launchMs.toFixed(0)}, load ${t.incomingMs.toFixed(0)}, hello ${t.helloMs.toFixed(0)}, identity ${t.identityMs.toFixed(0)})`,
    );
    return { vm: handle, restoreMs: r.value.totalMs, downMs: r.value.downMs, standby: r.value.standby };
  }

  async keptSize(ref: string): Promise<VmSize | undefined> {
    return ((await this.keptRecords()).get(ref)?.notes as { size?: VmSize } | undefined)?.size;
  }

  async dropKept(ref: string): Promise<void> {
    (await this.keptRecords()).delete(ref);
    // Standbys for rolling back to it hold its files: they go first.
    await Promise.all([...this.live.values()].map((l) => dropStandbyFor(l.sbx, ref)));
    await dropKept(this.stateDir, ref);
  }

  async keptRefs(): Promise<string[]> {
    return [...(await this.keptRecords()).keys()].sort();
  }

  /** The kept snapshots, read from their records once per process (they survive restarts). */
  private keptRecords(): Promise<Map<string, KeptRecord>> {
    this.kept ??= listKept(this.stateDir).then(({ kept, bad }) => {
      for (const b of bad) this.log(`kept snapshot record unreadable: ${b}`);
      return new Map(kept.map((k) => [k.ref, k]));
    });
    return this.kept;
  }

  async suspend(vm: DriverVm): Promise<{ memBytes: number; snapshotBytes: number }> {
    const l = this.mustLive(vm);
    const r = await suspendVm(l.sbx);
    if (!r.ok) throw r.error;
    this.live.delete(vm.vmId);
    const record = recordOf(l.sbx, vm, r.value.memBytes);
    this.suspended.set(vm.vmId, { sbx: l.sbx, record });
    await writeVmRecord(l.sbx.dir, record);
    const diskBytes = await allocatedBytes(l.sbx.disk);
    this.log(`suspended ${vm.vmId}: ${r.value.memBytes} B of state in ${r.value.suspendMs.toFixed(0)} ms`);
    return { memBytes: r.value.memBytes, snapshotBytes: r.value.memBytes + diskBytes };
  }

  async resume(vmId: string, templateId: string, size: VmSize): Promise<DriverVm> {
    let s = this.suspended.get(vmId);
    if (!s) {
      const r = await loadRecord(this.recordPlaces(), vmId, this.log);
      const record = r.ok ? r.value : undefined;
      if (!record?.suspendState)
        throw new SandboxdError(
          "gone",
          `VM ${vmId} has no suspended state on this agent`,
          r.ok ? undefined : { cause: r.error },
        );
      const sbx = restoreRecord(this.stateDir, record, this.host, this.log);
      sbx.state = "suspended";
      s = { sbx, record };
      this.suspended.set(vmId, s);
    }
    const r = await resumeVm(s.sbx, this.restoreDeadline());
    if (!r.ok) throw spawnError(r.error, `VM ${vmId} did not resume`);
    this.suspended.delete(vmId);
    return this.track(s.sbx, templateId, s.record.image, size, r.value.readyMs);
  }

  async pause(vm: DriverVm): Promise<void> {
    const r = await pauseVm(this.mustLive(vm).sbx);
    if (!r.ok) throw r.error;
  }

  async unpause(vm: DriverVm): Promise<void> {
    const r = await unpauseVm(this.mustLive(vm).sbx);
    if (!r.ok) throw r.error;
  }

  onGuestTunnel(handler: (vmId: string, t: GuestTunnel) => void): void {
    this.guestTunnelHandler = handler;
  }

  private guestTunnels(vmId: string, t: GuestTunnel): void {
    if (this.guestTunnelHandler) this.guestTunnelHandler(vmId, t);
    else t.close();
  }

  async openTunnel(vm: DriverVm, port: number): Promise<GuestTunnel> {
    return this.liveGuest(vm).openTunnel(port);
  }

  async openPty(vm: DriverVm, opts: PtyOptions): Promise<GuestTunnel> {
    return this.liveGuest(vm).openPty(opts);
  }

  /** The live guest connection (a fork or restore reconnects it; the handle's may be stale). */
  private liveGuest(vm: DriverVm): GuestClient {
    return this.mustLive(vm).sbx.guest ?? vm.guest;
  }

  async destroy(vmId: string, vm: DriverVm | undefined): Promise<void> {
    const id = vm?.vmId ?? vmId;
    const l = this.live.get(id);
    const s = this.suspended.get(id);
    const p = this.prelaunched.get(id);
    if (p) {
      this.prelaunched.delete(id);
      await p.pre.discard();
    }
    if (l) {
      l.destroying = true;
      await l.sbx.destroy();
      this.live.delete(id);
    } else if (s) {
      await s.sbx.destroy();
      this.suspended.delete(id);
    }
    // Whatever this process does not hold (a VM of an earlier agent, a lost one): its QEMU by
    // owner.json, its chain holds, its directory.
    const dir = join(vmsRoot(this.stateDir), id);
    await killRecordedQemu(dir);
    const chain = await openChainStore(this.stateDir);
    await chain.release(`vm:${id}`);
    await removeVmDir(dir);
    await rm(join(this.stateDir, "storage", "suspended", `${id}.state`), { force: true });
  }

  onExit(vm: DriverVm, cb: (info: VmExitInfo) => void): void {
    const l = this.live.get(vm.vmId);
    if (!l || l.handle !== vm) return;
    l.proc.exited
      .then((exit) => {
        // Not an unexpected exit: a destroy, a suspend (which detaches the QEMU first), a detach.
        if (this.detached || l.destroying || l.exitFired || l.sbx.process !== l.proc) return;
        l.exitFired = true;
        if (this.live.get(vm.vmId) === l) this.live.delete(vm.vmId);
        cb({ reason: exitReason(exit, l.proc.pid) });
      })
      .catch((err) => this.log(`vm ${vm.vmId}: handling its QEMU's exit failed: ${describeError(err)}`));
  }

  /** Where this agent keeps a VM's files, what a record read back is held to (checkVmRecord). */
  private recordPlaces() {
    return {
      stateDir: this.stateDir,
      shmRoot: this.shmRoot,
      imagesRoot: join(resolve(this.opts.cacheDir), "images"),
      guestRoot: dirname(dirname(this.artifacts.vmlinux)),
    };
  }

  diskRoom(): { freeBytes: number; reserveBytes: number; growBytes: number } {
    let growBytes = 0;
    for (const l of this.live.values()) growBytes += roomToGrow(l.sbx.shape.diskBytes, l.sbx.disk);
    const freeBytes = freeBytesSync(vmsRoot(this.stateDir));
    return { freeBytes, reserveBytes: this.host.diskReserveBytes, growBytes };
  }

  newDiskBytes(templateId: string, resumeVmId?: string): number {
    const s = resumeVmId === undefined ? undefined : this.suspended.get(resumeVmId);
    // A suspended VM read back after a restart is not in the map: its full room, from above.
    return s ? roomToGrow(s.sbx.shape.diskBytes, s.sbx.disk) : this.templates.diskBytes(templateId);
  }

  standbyCount(): number {
    let n = 0;
    for (const l of this.live.values()) if (l.sbx.standby !== undefined) n++;
    return n;
  }

  ramFilesBytes(): number {
    let names: string[];
    try {
      names = readdirSync(this.shmRoot);
    } catch {
      return 0; // no RAM file made yet: the directory comes with the first template
    }
    let bytes = 0;
    for (const name of names) {
      try {
        // Allocated blocks, not the size: a RAM file is sparse until its pages are written.
        bytes += lstatSync(join(this.shmRoot, name)).blocks * 512;
      } catch {
        // removed between the listing and here: it holds nothing any more
      }
    }
    return bytes;
  }

  async diskBytes(vmId: string): Promise<number> {
    const disk =
      this.live.get(vmId)?.sbx.disk ??
      this.suspended.get(vmId)?.sbx.disk ??
      (await loadRecord(this.recordPlaces(), vmId, this.log).then((r) => (r.ok ? r.value?.disk : undefined)));
    return disk ? allocatedBytes(disk) : 0;
  }

  // ---- restart -------------------------------------------------------------------------------

  async adopt(ref: AdoptRef): Promise<DriverVm> {
    const started = performance.now();
    const r = await loadRecord(this.recordPlaces(), ref.vmId, this.log);
    if (!r.ok) throw new SandboxdError("vm_lost", `VM ${ref.vmId}: ${r.error.message}`, { cause: r.error });
    const file = r.value;
    if (!file) throw new SandboxdError("vm_lost", `VM ${ref.vmId} has no ${VM_RECORD_FILE}`);
    if (file.suspendState) throw new SandboxdError("vm_lost", `VM ${ref.vmId} was being suspended`);
    const dir = join(vmsRoot(this.stateDir), ref.vmId);
    const pid = ref.qemuPid;
    const { proc, guest } = await attachRunning(dir, pid);
    const sbx = restoreRecord(this.stateDir, file, this.host, this.log);
    sbx.state = "running";
    sbx.attach(proc, guest);
    const handle = await this.track(sbx, ref.templateId, file.image, ref.size, performance.now() - started);
    this.log(`adopted ${ref.vmId} (QEMU pid ${pid}) in ${(performance.now() - started).toFixed(0)} ms`);
    return handle;
  }

  async reap(keep: ReadonlySet<string>): Promise<string[]> {
    const reaped = await reapVmDirs(
      this.stateDir,
      (id) =>
        keep.has(id) ||
        this.live.has(id) ||
        this.suspended.has(id) ||
        this.prelaunched.has(id) ||
        [...this.templates.building].some((t) => id === `${t}-build`),
      this.host.jail.uidRange,
    );
    await reapSnapshotFiles({
      stateDir: this.stateDir,
      shmRoot: this.shmRoot,
      templates: this.templates,
      log: this.log,
    });
    return reaped;
  }

  async detach(): Promise<void> {
    this.detached = true;
    // Standbys (snapshot/standby.ts) are this process's, not their VMs': they go before it does,
    // a launch still in flight included, so none outlives the agent (a crash leaves them to the
    // next agent's start: vm/process.ts killRecordedStandby).
    const standbys = [...this.live.values()].map((l) =>
      l.sbx
        .dropStandby()
        .catch((err) => this.log(`vm ${l.sbx.id}: dropping its standby: ${describeError(err)}`)),
    );
    for (const l of this.live.values()) {
      // Forget the QEMU without killing it (SandboxVm.detach would kill it).
      l.sbx.process = undefined;
      l.sbx.guest?.close();
      l.sbx.guest = undefined;
      l.proc.qmp.close();
    }
    this.live.clear();
    this.suspended.clear();
    // Pre-launched QEMUs have no record: the next agent's reap kills them.
    for (const p of this.prelaunched.values()) p.pre.process.qmp.close();
    this.prelaunched.clear();
    await Promise.all(standbys);
  }

  // ---- internals -----------------------------------------------------------------------------

  /** Registers a running VM and records what a later agent needs to drive it. */
  private async track(
    sbx: SandboxVm,
    templateId: string,
    image: ImageConfig,
    size: VmSize,
    spawnMs: number,
  ): Promise<DriverVm> {
    const proc = sbx.process;
    const guest = sbx.guest;
    if (!proc || !guest) {
      await sbx.destroy();
      throw new SandboxdError("spawn_failed", `VM ${sbx.id} has no QEMU after its start`);
    }
    const handle: DriverVm = {
      vmId: sbx.id,
      templateId,
      guest,
      image,
      size,
      qemuPid: proc.pid,
      dir: sbx.dir,
      spawnMs,
    };
    const l: Live = { sbx, proc, handle, destroying: false, exitFired: false };
    this.live.set(sbx.id, l);
    // SandboxVm.attach routes every guest connection's tunnels here from now on; one opened
    // before this point (between restore and here) found no taker and was closed at once.
    sbx.onGuestTunnel = (t) => this.guestTunnels(sbx.id, t);
    try {
      await saveRecord(sbx, handle);
    } catch (err) {
      l.destroying = true;
      this.live.delete(sbx.id);
      await sbx.destroy();
      throw new SandboxdError("spawn_failed", `VM ${sbx.id}: cannot write ${VM_RECORD_FILE}`, { cause: err });
    }
    return handle;
  }

  private mustLive(vm: DriverVm): Live {
    const l = this.live.get(vm.vmId);
    if (!l) throw new SandboxdError("gone", `VM ${vm.vmId} has no QEMU`);
    return l;
  }
}

/**
 * Registry pulls go through the same egress fence as sandboxes (agent/egress/fence.ts): a registry
 * on loopback, a private range, link-local or metadata, or one of the host's own addresses is
 * refused unless the operator allows its range for pulls (`SANDBOXD_REGISTRY_ALLOW_INTERNAL`).
 */
export function fencedRegistry(fence: EgressFence = defaultFence()): DestinationCheck {
  return async (host, port) => {
    const d = await checkDestination(host, port, fence);
    if (!d.ok) throw new SandboxdError("forbidden", `registry ${host}:${port}: ${d.reason}`);
  };
}

/** A restore that did not produce a VM is the contract's `spawn_failed` (unless it timed out). */
function spawnError(e: SnapshotError, message: string): SandboxdError {
  if (e.code === "spawn_failed" || e.code === "bringup_timeout" || e.code === "template_not_ready") return e;
  return new SandboxdError("spawn_failed", `${message}: ${e.message}`, {
    cause: e,
    ...(e.details ? { details: e.details } : {}),
  });
}

function exitReason(exit: VmExit, pid: number): string {
  if (exit.signal) return `QEMU exited (signal ${exit.signal})`;
  if (exit.code !== null) return `QEMU exited (code ${exit.code})`;
  return `QEMU pid ${pid} exited (adopted VM: no exit status)`;
}

async function allocatedBytes(path: string): Promise<number> {
  try {
    return (await stat(path)).blocks * 512;
  } catch {
    return 0;
  }
}

/** What an overlay of `virtualBytes` may still grow by: its virtual size less its allocated blocks. */
function roomToGrow(virtualBytes: number, disk: string): number {
  let allocated = 0;
  try {
    allocated = lstatSync(disk).blocks * 512;
  } catch {
    // not made yet (a restore in flight) or removed meanwhile: all of its room counts
  }
  return Math.max(0, virtualBytes - allocated);
}
