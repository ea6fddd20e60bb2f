/**
 * The sandbox manager: every live VM on this host, its state (states.ts, one table), its
 * records on disk (records.ts), idle pause and metering; the sandbox table and the one path a
 * state changes by are table.ts's. It carries out what exec.ts plans, has creates carried out by
 * create.ts and fork, suspend and resume by fork-suspend.ts, and admits VMs by capacity.ts. It sits
 * on a narrow `SandboxDriver` (drivers/driver.ts) and never sees HTTP: agent/api/app.ts parses
 * requests into typed actions (agent/api/actions.ts) that call the methods below.
 *
 * Rules carried out here:
 * - Execs are serialized per sandbox; a second exec, or a fork, while one is in flight fails at
 *   once with `busy` (docs/sessions.md "Rules of the sessions API"; docs/limits.md "Public API limits"): never queued.
 * - Idle VMs have their vCPUs stopped after `idlePauseMs` and are restarted transparently by the
 *   next call (docs/idle-lifetimes.md "Idle pause of the VM after 2 s": "Between calls the VM uses no scheduled CPU").
 * - A normal destroy lets the in-flight exec finish; `force` aborts it (CANCEL) and kills the VM
 *   at once (docs/sessions.md "Rules of the sessions API" "Delete session").
 * - A QEMU that dies marks its sandbox `failed` with the reason, and in-flight callers get a
 *   `gone` error saying so as soon as the guest connection drops.
 * - Records are written on every state change; `SandboxManager.open` re-adopts VMs that still run
 *   after an agent restart, marks the others `lost`, and reaps every VM no record claims.
 */

import { Duplex } from "node:stream";
import type {
  AgentCapacity,
  CreatedVm,
  CreateVmOpts,
  OneShotResult,
  ResumeResult,
  SnapshotRestored,
  SnapshotTaken,
  SuspendResult,
} from "../../contracts/agent/api.ts";
import type { PtyOpen } from "../../contracts/agent/pty.ts";
import { settled } from "../../contracts/best-effort.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { defaultFence, type EgressFence } from "../egress/fence.ts";
import { EgressPolicy } from "../egress/policy.ts";
import type { GuestTunnel } from "../guest/client.ts";
import { STANDBY_HELD_BYTES, vmOverheadBytes } from "../qemu/cgroup.ts";
import { newVmId } from "../vm/ids.ts";
import type { UsageReport } from "./accounting.ts";
import { Capacity, hostCapacity } from "./capacity.ts";
import { type CreateHost, createSandbox } from "./create.ts";
import type { SandboxDriver, TemplateInput, VmSize } from "./drivers/driver.ts";
import type { ExecRequest } from "./exec.ts";
import { type ExecHost, runExec } from "./exec-action.ts";
import type { OutputSink } from "./exec-run.ts";
import { type ForkSuspendHost, forkSandbox, resumeSandbox, suspendSandbox } from "./fork-suspend.ts";
import { GuestAccess } from "./guest-access.ts";
import { IdlePause } from "./idle.ts";
import { createFromKept, dropKeptSnapshot, type KeptHost, keepSandbox, restoreSandbox } from "./kept.ts";
import { LiveMetrics, type MetricsSample } from "./live-metrics.ts";
import { infoOf, type ManagerOptions, type SandboxInfo } from "./manager-types.ts";
import { PrelaunchPool } from "./prelaunch-pool.ts";
import { sandboxRecords, templateRecords } from "./records.ts";
import { type RestartHost, readoptAll } from "./restart.ts";
import { SandboxTable } from "./table.ts";
import { TemplateRegistry } from "./templates.ts";
import { WarmPool } from "./warm-pool.ts";

/**
 * Idle grace before the vCPUs are stopped. 2 s: calls of one client come in bursts (an agent loop
 * issues its next exec within a few hundred ms), and `stop`/`cont` cost ~1 ms each, so a short
 * grace saves CPU without adding latency to a burst. Under TCG an idle guest still burns host CPU
 * on timer interrupts, which is what the pause removes.
 */
export const DEFAULT_IDLE_PAUSE_MS = 2_000;
/**
 * How often every VM's disk overlay is measured again (besides after each exec): a `stat` per VM,
 * cheap; a minute keeps disk GB-hours within a minute's growth of the truth.
 */
const DISK_REFRESH_MS = 60_000;
const MIB = 1024 * 1024;

export class SandboxManager {
  /** Every sandbox of this agent, and the one path its state changes by (table.ts). */
  private readonly table: SandboxTable;
  private readonly records;
  readonly templates: TemplateRegistry;
  /** Pre-spawned, paused VMs per template (docs/sandboxes.md "Rules of the sandboxes API" expect/release; warm-pool.ts). */
  readonly warm: WarmPool;
  /** QEMUs launched in their jail ahead of a create, per template (prelaunch-pool.ts). */
  readonly prelaunch: PrelaunchPool;
  private readonly driver: SandboxDriver;
  private readonly defaultSize: VmSize;
  private readonly egressDefault: EgressPolicy;
  private readonly fence: EgressFence;
  readonly capacity: Capacity;
  private readonly log: (msg: string) => void;
  private readonly access: GuestAccess;
  private readonly idle: IdlePause;
  private readonly execHost: ExecHost;
  private readonly forkSuspendHost: ForkSuspendHost;
  private readonly createHost: CreateHost;
  private diskTimer: ReturnType<typeof setInterval> | undefined;
  /** Every sandbox's CPU, memory and disk, sampled from the host (live-metrics.ts). */
  readonly liveMetrics: LiveMetrics;

  private constructor(opts: ManagerOptions) {
    this.driver = opts.driver;
    this.log = opts.log ?? (() => {});
    this.records = sandboxRecords(opts.stateDir);
    this.templates = new TemplateRegistry(
      opts.driver,
      templateRecords(opts.stateDir),
      this.log,
      opts.buildSlots,
    );
    this.warm = new WarmPool({
      driver: opts.driver,
      templates: this.templates,
      admit: (size, templateId) => {
        // A warm VM runs (restored, paused): its overlay's room to grow is the template disk's.
        const diskBytes = this.driver.newDiskBytes?.(templateId) ?? 0;
        return this.capacity.fits(size, 1, diskBytes) ? this.capacity.reserveDisk(diskBytes) : undefined;
      },
      sizeOf: (id) => ({ ...this.defaultSize, ...this.templates.sizeOf(id) }),
      log: this.log,
    });
    this.prelaunch = new PrelaunchPool({
      driver: opts.driver,
      templates: this.templates,
      width: opts.prelaunch ?? 0,
      fits: (size) => this.capacity.fits(size, 1),
      sizeOf: (id) => ({ ...this.defaultSize, ...this.templates.sizeOf(id) }),
      log: this.log,
    });
    this.egressDefault = EgressPolicy.byDefault(opts.egressDefault ?? "deny");
    this.table = new SandboxTable({
      driver: this.driver,
      records: this.records,
      templates: this.templates,
      log: this.log,
      egressDefault: this.egressDefault,
      opts,
      warm: this.warm,
      prelaunch: this.prelaunch,
      idle: { arm: (sb) => this.idle.arm(sb), clear: (sb) => this.idle.clear(sb) },
    });
    this.idle = new IdlePause({
      driver: this.driver,
      idlePauseMs: opts.idlePauseMs ?? DEFAULT_IDLE_PAUSE_MS,
      log: this.log,
      setState: (sb, to) => this.table.setState(sb, to),
      detached: () => this.table.detached,
    });
    this.execHost = { wake: (sb) => this.idle.wake(sb), goneError: (sb) => this.table.goneError(sb) };
    // 1 vCPU / 256 MiB: enough for a shell or an interpreter, the python fixture's size.
    this.defaultSize = opts.defaultSize ?? { vcpus: 1, memMib: 256 };
    this.fence = opts.fence ?? defaultFence();
    const diskRoom = this.driver.diskRoom?.bind(this.driver);
    this.capacity = new Capacity(
      hostCapacity(opts.capacity),
      () => this.table.used(),
      {
        // A driver that names no accelerator runs no QEMU of ours (a test's fake): guest RAM alone.
        overheadMib: this.driver.accel === undefined ? 0 : vmOverheadBytes(this.driver.accel === "tcg") / MIB,
        filesMib: () => Math.ceil((this.driver.ramFilesBytes?.() ?? 0) / MIB),
        standbyMib: STANDBY_HELD_BYTES / MIB,
        standbys: () => this.driver.standbyCount?.() ?? 0,
      },
      diskRoom ? { room: diskRoom } : undefined,
    );
    this.access = new GuestAccess({
      driver: this.driver,
      fence: this.fence,
      log: this.log,
      get: (id) => this.table.mustGet(id),
      find: (id) => this.table.sandboxes.get(id),
      setState: (sb, to) => this.table.setState(sb, to),
      wake: (sb) => this.idle.wake(sb),
      goneError: (sb) => this.table.goneError(sb),
      tunnelsChanged: (sb) => this.idle.tunnelsChanged(sb),
      armIdle: (sb) => this.idle.arm(sb),
      clearIdle: (sb) => this.idle.clear(sb),
      persist: (sb) => this.table.persist(sb),
    });
    this.forkSuspendHost = {
      driver: this.driver,
      capacity: this.capacity,
      records: this.records,
      log: this.log,
      setState: (sb, to) => this.table.setState(sb, to),
      newSandbox: (o) => this.table.newSandbox(o),
      forget: (id) => this.table.sandboxes.delete(id),
      persist: (sb) => this.table.persist(sb),
      watchVm: (sb, vm) => this.table.watchVm(sb, vm),
      refreshDisk: (sb) => this.table.refreshDisk(sb),
      goneError: (sb) => this.table.goneError(sb),
      closeTunnels: (sb, why) => this.table.closeTunnels(sb, why),
      wake: (sb) => this.idle.wake(sb),
    };
    this.liveMetrics = new LiveMetrics({
      targets: () => [...this.table.sandboxes.values()].map((sb) => ({ id: sb.id, pid: sb.vm?.qemuPid })),
      diskBytes: (id) => this.driver.diskBytes(id),
    });
    this.createHost = {
      driver: this.driver,
      templates: this.templates,
      warm: this.warm,
      prelaunch: this.prelaunch,
      capacity: this.capacity,
      table: this.table,
      records: this.records,
      log: this.log,
      defaultSize: this.defaultSize,
      egressDefault: this.egressDefault,
    };
  }

  /**
   * Opens the manager over a state dir: loads templates, then every sandbox record. A `running`
   * record whose QEMU is alive, whose QMP answers and whose guest answers HELLO is adopted and
   * running again; any other becomes `lost` with the reason. Then every VM directory that no
   * record claims is killed and removed.
   */
  static async open(opts: ManagerOptions): Promise<SandboxManager> {
    const m = new SandboxManager(opts);
    const ranges = m.fence.allowedRanges;
    if (ranges.length > 0) m.log(`egress: the operator opens internal ranges ${ranges.join(", ")}`);
    // Connections guest programs make to their egress proxy port, checked against the sandbox's
    // allow-list (agent/egress). Set before any VM is adopted or spawned.
    m.driver.onGuestTunnel((vmId, t) => {
      void m.egressConnection(vmId, Duplex.fromWeb({ readable: t.readable, writable: t.writable }));
    });
    await m.templates.load();
    const { records, bad } = await m.records.list();
    for (const b of bad) m.log(`sandbox record ${b.file} unreadable: ${b.error}`);
    const keep = await readoptAll(m.restartHost(), records);
    const reaped = await m.driver.reap(keep);
    if (reaped.length > 0) m.log(`reaped VMs no record claims: ${reaped.join(", ")}`);
    m.table.reclaimTemplates(); // deleted before the restart, and no VM of theirs came back

    // After the reap, which would take them for a dead agent's.
    for (const id of m.templates.ids()) m.prelaunch.fill(id);
    m.diskTimer = setInterval(() => {
      for (const sb of m.table.sandboxes.values())
        if (sb.vm || sb.state === "suspended") void m.table.refreshDisk(sb);
    }, DISK_REFRESH_MS);
    m.diskTimer.unref?.(); // never keeps the agent process alive
    // Drivers that run no QEMU of ours (a test's fake) have no process to sample.
    if (m.driver.accel !== undefined) m.liveMetrics.start();
    return m;
  }

  // ---- sandboxes -----------------------------------------------------------------------------

  create(templateId: string, opts: CreateVmOpts): Promise<CreatedVm> {
    return createSandbox(this.createHost, templateId, opts);
  }

  /** With `stream`, output goes to its sink uncapped; its signal (consumer gone) cancels. */
  async exec(id: string, req: ExecRequest, stream?: { sink: OutputSink; signal: AbortSignal }) {
    const sb = this.table.mustGet(id);
    this.table.setState(sb, "busy");
    const abort = new AbortController();
    const signal = stream ? AbortSignal.any([abort.signal, stream.signal]) : abort.signal;
    const done = runExec(this.execHost, sb, req, signal, stream?.sink);
    sb.inflight = { abort, done };
    try {
      return await done;
    } finally {
      sb.inflight = undefined;
      sb.execCount++;
      sb.lastUsedAtMs = Date.now();
      if (sb.state === "busy") this.table.setState(sb, "running");
      else void this.table.persist(sb);
      void this.table.refreshDisk(sb);
    }
  }

  /** One throwaway VM per call (sessions API /v1/exec): create, exec, destroy. */
  async execOnce(templateId: string, req: ExecRequest): Promise<OneShotResult> {
    const created = await this.create(templateId, { kind: "session" });
    const sb = this.table.sandboxes.get(created.vmId);
    if (sb) sb.oneShot = true;
    try {
      const r = await this.exec(created.vmId, req);
      return {
        ...r,
        forkTimeMs: created.forkTimeMs,
        totalTimeMs: r.totalTimeMs + created.createTimeMs,
        resources: created.resources,
      };
    } finally {
      await this.destroy(created.vmId, { force: true });
    }
  }

  /** Kept snapshots (kept.ts, docs/snapshots.md). */
  takeSnapshot(id: string, ref: string): Promise<SnapshotTaken> {
    return keepSandbox(this.keptHost(), this.table.mustGet(id), ref);
  }

  restoreSnapshot(id: string, ref: string): Promise<SnapshotRestored> {
    return restoreSandbox(this.keptHost(), this.table.mustGet(id), ref);
  }

  createFromSnapshot(ref: string, opts: CreateVmOpts): Promise<CreatedVm> {
    return createFromKept(this.keptHost(), ref, newVmId(), opts);
  }

  deleteSnapshot(ref: string): Promise<void> {
    return dropKeptSnapshot(this.keptHost(), ref);
  }

  /**
   * The kept snapshots on this host, for the gateway's reconciliation (a host back from lost
   * tells which of its snapshots still have their files); none on a driver that keeps none.
   */
  async listSnapshots(): Promise<string[]> {
    return (await this.driver.keptRefs?.()) ?? [];
  }

  private keptHost(): KeptHost {
    return { ...this.forkSuspendHost, egressDefault: this.egressDefault };
  }

  fork(id: string, count: number): Promise<CreatedVm[]> {
    return forkSandbox(this.forkSuspendHost, this.table.mustGet(id), count);
  }

  suspend(id: string): Promise<SuspendResult> {
    return suspendSandbox(this.forkSuspendHost, this.table.mustGet(id));
  }

  resume(id: string): Promise<ResumeResult> {
    return resumeSandbox(this.forkSuspendHost, this.table.mustGet(id));
  }

  /** Idempotent: an unknown id is already destroyed. */
  async destroy(id: string, opts: { force: boolean }): Promise<void> {
    const sb = this.table.sandboxes.get(id);
    if (!sb || sb.state === "destroyed") return;
    if (sb.destroying) {
      if (opts.force) sb.inflight?.abort.abort();
      return sb.destroying;
    }
    // `destroying` already: an earlier destroy failed (a full disk) and this one tries again.
    if (sb.state !== "destroying") this.table.setState(sb, "destroying");
    this.idle.clear(sb);
    this.table.closeTunnels(sb, "is being destroyed");
    void sb.procs?.killAll();
    const attempt = (async () => {
      if (sb.inflight) {
        if (opts.force) sb.inflight.abort.abort();
        else await settled(sb.inflight.done); // the exec's caller gets its outcome
      }
      await settled(sb.op); // the operation's caller gets its outcome
      await this.driver.destroy(sb.id, sb.vm);
      sb.vm = undefined;
      this.table.setState(sb, "destroyed");
      this.table.sandboxes.delete(sb.id);
      await this.records.remove(sb.id);
    })();
    sb.destroying = attempt;
    // A failed attempt is not kept: the next destroy of this sandbox runs again instead of
    // answering the old failure for ever.
    attempt.catch(() => {
      if (sb.destroying === attempt) sb.destroying = undefined;
    });
    return attempt;
  }

  info(id: string): SandboxInfo {
    return infoOf(this.table.mustGet(id));
  }

  list(): SandboxInfo[] {
    return [...this.table.sandboxes.keys()].map((id) => this.info(id));
  }

  usage(id: string): UsageReport {
    return this.table.mustGet(id).meter.report(Date.now());
  }

  /**
   * A sandbox's live metrics (docs/metrics.md): its state, size and the last samples, oldest
   * first. A suspended sandbox answers the figures of its last minutes running.
   */
  metrics(id: string): {
    state: string;
    vcpus: number;
    memLimitBytes: number;
    intervalMs: number;
    samples: MetricsSample[];
  } {
    const sb = this.table.mustGet(id);
    return {
      state: sb.state,
      vcpus: sb.size.vcpus,
      memLimitBytes: sb.size.memMib * MIB,
      intervalMs: this.liveMetrics.intervalMs,
      samples: this.liveMetrics.history(id),
    };
  }

  // ---- beside the exec (guest-access.ts) -----------------------------------------------------

  holdGuest(id: string): ReturnType<GuestAccess["holdGuest"]> {
    return this.access.holdGuest(id);
  }

  openTunnel(id: string, port: number): Promise<GuestTunnel> {
    return this.access.openTunnel(id, port);
  }

  openPty(id: string, opts: PtyOpen): Promise<GuestTunnel> {
    return this.access.openPty(id, opts);
  }

  processTable(id: string, awake: boolean): ReturnType<GuestAccess["processTable"]> {
    return this.access.processTable(id, awake);
  }

  egressConnection(id: string, stream: Duplex): Promise<void> {
    return this.access.egressConnection(id, stream);
  }

  /** A new egress allow-list for a sandbox, in force at once (guest-access.ts `setEgress`). */
  setEgress(id: string, allow: readonly string[]): Promise<{ egressAllow: string[] }> {
    return this.access.setEgress(id, allow);
  }

  // ---- templates and host --------------------------------------------------------------------

  buildTemplate(id: string, input: TemplateInput, size?: Partial<VmSize>, extraSizes: VmSize[] = []): void {
    // The driver learns the size the VMs of this template will get: a snapshot driver freezes
    // RAM and vCPUs into the template, so it must build it at the size `create` asks for.
    const want: Partial<VmSize> = { ...input.size, ...size };
    const own = { ...this.defaultSize, ...want };
    // Each other size class once, never the default one again (docs/templates.md "Size classes").
    const extras = extraSizes.filter(
      (x, i) =>
        !(x.vcpus === own.vcpus && x.memMib === own.memMib) &&
        extraSizes.findIndex((y) => y.vcpus === x.vcpus && y.memMib === x.memMib) === i,
    );
    this.templates.build(id, { ...input, size: own }, want, extras);
    this.prelaunch.fill(id);
  }

  /**
   * The bundle of ready template `id` for another agent to copy (docs/templates.md "Agents that
   * join later"); `unsupported` on a driver that keeps no frozen files.
   */
  exportTemplate(id: string): Promise<AsyncIterable<Uint8Array>> {
    const t = this.templates.ready(id);
    if (!this.driver.exportTemplate)
      throw new SandboxdError("unsupported", `the ${this.driver.name} driver has no template files to copy`);
    return this.driver.exportTemplate(id, t.prepared);
  }

  /**
   * docs/templates.md "Rules of templates": in-flight VMs finish, then the template's resources are reclaimed. Its idle pools
   * (warm and pre-launched VMs, which run nothing) go now; with sandboxes still running on it
   * the template is marked deleting (nothing new spawns from it) and `reclaimTemplates` removes
   * it when the last of them ends.
   */
  async deleteTemplate(id: string): Promise<void> {
    await Promise.all([this.warm.release(id), this.prelaunch.drain(id)]);
    const done = await this.templates.delete(id, this.table.templateInUse(id));
    if (done === "deferred") this.log(`template ${id}: deleting once the VMs still running on it end`);
  }

  /** docs/sandboxes.md "Rules of the sandboxes API" expect: keep `width` warm VMs of the template (bounded by capacity); idempotent. */
  expectWidth(id: string, width: number): void {
    this.warm.expect(id, width);
  }

  /** docs/sandboxes.md "Rules of the sandboxes API" release: drop the template's warm VMs now; idempotent. */
  async releaseTemplate(id: string): Promise<void> {
    this.templates.status(id); // not_found for a template this agent does not know
    await this.warm.release(id);
  }

  /** Templates ready to start VMs from here (reported in heartbeats for placement). */
  readyTemplates(): string[] {
    return this.templates.ids().filter((id) => this.templates.status(id).status === "ready");
  }

  capacityNow(): AgentCapacity {
    return this.capacity.free(this.defaultSize);
  }

  get driverName(): string {
    return this.driver.name;
  }

  get accel(): "kvm" | "tcg" | undefined {
    return this.driver.accel;
  }

  /**
   * Lets go of every VM WITHOUT killing it, as an agent process exit does: timers stop, the
   * driver closes its sockets, records stay. A new manager over the same state dir re-adopts.
   */
  async detach(): Promise<void> {
    this.table.detached = true;
    clearInterval(this.diskTimer);
    this.liveMetrics.stop();
    // Warm VMs have no record (a restart would reap them): they go now rather than linger.
    await Promise.all([this.warm.close(), this.prelaunch.close()]);
    for (const sb of this.table.sandboxes.values()) this.idle.clear(sb);
    await this.records.flush();
    await this.driver.detach();
    this.table.sandboxes.clear();
  }

  // ---- internals -----------------------------------------------------------------------------

  /** What re-adopting the records after a restart needs of the manager (restart.ts). */
  private restartHost(): RestartHost {
    return {
      driver: this.driver,
      records: this.records,
      log: this.log,
      fromRecord: (r) => this.table.fromRecord(r),
      watchVm: (sb, vm) => this.table.watchVm(sb, vm),
      markLost: (sb, reason) => this.table.markLost(sb, reason),
      armIdle: (sb) => this.idle.arm(sb),
      forget: (id) => this.table.sandboxes.delete(id),
    };
  }
}
