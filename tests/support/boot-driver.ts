/**
 * A `SandboxDriver` that cold-boots every VM from an imported image (agent/vm/boot.ts): no
 * snapshots, so fork, suspend and resume throw `unsupported`. It is the driver of the tests that
 * use REAL VMs, and of hosts where the snapshot engine is not available. Spawn is a full boot
 * (~2-3 s under TCG on a 2-core host), not the ~200 ms of a snapshot restore.
 */
import { rm, stat } from "node:fs/promises";
import { join } from "node:path";
import { ensureGuestArtifacts, type GuestArtifacts } from "../../agent/guest/artifacts.ts";
import type { GuestClient, GuestTunnel, PtyOptions } from "../../agent/guest/client.ts";
import { type ImportedImage, importImage } from "../../agent/image/import.ts";
import { probeAccelerator } from "../../agent/qemu/accel.ts";
import type { Accel } from "../../agent/qemu/launch.ts";
import type { QmpClient } from "../../agent/qemu/qmp/client.ts";
import type {
  AdoptRef,
  DriverVm,
  PreparedTemplate,
  SandboxDriver,
  TemplateInput,
  VmExitInfo,
  VmSize,
} from "../../agent/sandbox/drivers/driver.ts";
import { bootVm, connectGuest } from "../../agent/vm/boot.ts";
import { adoptQemu, claimVm, pidGone } from "../../agent/vm/process.ts";
import { reapVmDirs, vmsRoot } from "../../agent/vm/workdir.ts";
import { describeError, SandboxdError } from "../../contracts/errors.ts";

export interface BootDriverOptions {
  /** Where guest artifacts and imported images are cached (shared between agents and tests). */
  cacheDir: string;
  /** The agent's own state: `<stateDir>/vms/<id>/` per VM. */
  stateDir: string;
  log?: (msg: string) => void;
  /** Override the probe (tests); default: probe KVM, else TCG. */
  accel?: Accel;
}

/**
 * Bring-up deadline for a cold boot: TCG boots in ~3 s on these hosts; 60 s leaves room for a
 * loaded CI machine running several boots at once (same budget as `sandboxd run`).
 */
const COLD_BOOT_TIMEOUT_MS = 60_000;
/**
 * HELLO budget on adoption: a running guest answers in ~50 ms under TCG; the guest agent may
 * first have to notice the old connection's hang-up, so allow a few retry rounds.
 */
const ADOPT_HELLO_TIMEOUT_MS = 10_000;

interface Live {
  handle: DriverVm;
  qmp: QmpClient;
  /** Resolves once QEMU is gone (process exit, or for adopted VMs the QMP hang-up + pid gone). */
  exited: Promise<VmExitInfo>;
  kill(): Promise<void>;
  destroying: boolean;
}

export class BootDriver implements SandboxDriver {
  readonly name: string;
  private readonly templates = new Map<string, ImportedImage>();
  /** A template's `wait_secs` (TemplateInput.bringupTimeoutMs): this driver boots at every spawn. */
  private readonly bringupMs = new Map<string, number>();
  private readonly live = new Map<string, Live>();
  private detached = false;
  private readonly log: (msg: string) => void;

  private constructor(
    private readonly opts: BootDriverOptions,
    private readonly artifacts: GuestArtifacts,
    readonly accel: Accel,
  ) {
    this.name = `boot (${accel})`;
    this.log = opts.log ?? (() => {});
  }

  static async create(opts: BootDriverOptions): Promise<BootDriver> {
    const [artifacts, accel] = await Promise.all([
      ensureGuestArtifacts({ dataDir: opts.cacheDir, log: opts.log }),
      opts.accel ? Promise.resolve(opts.accel) : probeAccelerator({ log: opts.log }).then((a) => a.accel),
    ]);
    return new BootDriver(opts, artifacts, accel);
  }

  async prepareTemplate(
    templateId: string,
    input: TemplateInput,
    signal?: AbortSignal,
  ): Promise<PreparedTemplate> {
    if (input.kind !== "archive") {
      throw new SandboxdError("unsupported", "this agent builds templates from image archives only");
    }
    const image = await importImage({
      source: input.path,
      dataDir: this.opts.cacheDir,
      log: this.log,
      ...(signal ? { signal } : {}),
    });
    this.templates.set(templateId, image);
    if (input.bringupTimeoutMs !== undefined) this.bringupMs.set(templateId, input.bringupTimeoutMs);
    return { image: image.config, exposedPorts: image.config.exposedPorts };
  }

  async restoreTemplate(templateId: string, prepared: PreparedTemplate): Promise<void> {
    // The image cache is content-addressed (agent/image/import.ts): the digest finds the disk.
    const dir = join(this.opts.cacheDir, "images", prepared.image.digest.slice("sha256:".length));
    const disk = join(dir, "rootfs.qcow2");
    await stat(disk);
    this.templates.set(templateId, {
      digest: prepared.image.digest,
      dir,
      disk,
      config: prepared.image,
      cached: true,
      format: "docker-archive",
    });
  }

  async dropTemplate(templateId: string): Promise<void> {
    // The image stays in the content-addressed cache: other templates may share it.
    this.templates.delete(templateId);
    this.bringupMs.delete(templateId);
  }

  async spawn(templateId: string, vmId: string, size: VmSize): Promise<DriverVm> {
    const image = this.templates.get(templateId);
    if (!image) throw new SandboxdError("not_found", `template ${templateId} is not prepared on this agent`);
    let booted: Awaited<ReturnType<typeof bootVm>>;
    try {
      booted = await bootVm({
        dataDir: this.opts.stateDir,
        image,
        artifacts: this.artifacts,
        accel: this.accel,
        memMib: size.memMib,
        vcpus: size.vcpus,
        bringupTimeoutMs: this.bringupMs.get(templateId) ?? COLD_BOOT_TIMEOUT_MS,
        id: vmId,
        log: this.log,
      });
    } catch (err) {
      if (err instanceof SandboxdError && (err.code === "spawn_failed" || err.code === "bringup_timeout"))
        throw err;
      throw new SandboxdError("spawn_failed", `VM ${vmId} did not start`, { cause: err });
    }
    const handle: DriverVm = {
      vmId,
      templateId,
      guest: booted.guest,
      image: image.config,
      size,
      qemuPid: booted.vm.pid,
      dir: booted.dir,
      spawnMs: booted.bootMs,
    };
    const exited = booted.vm.exited.then((e) => ({
      reason: `QEMU exited (${e.signal ? `signal ${e.signal}` : `code ${e.code}`})`,
    }));
    this.live.set(vmId, {
      handle,
      qmp: booted.vm.qmp,
      exited,
      kill: () => booted.destroy(),
      destroying: false,
    });
    return handle;
  }

  async fork(): Promise<DriverVm[]> {
    throw new SandboxdError("unsupported", "fork needs the snapshot driver; this agent cold-boots VMs");
  }

  async suspend(): Promise<{ memBytes: number; snapshotBytes: number }> {
    throw new SandboxdError("unsupported", "suspend needs the snapshot driver; this agent cold-boots VMs");
  }

  async resume(): Promise<DriverVm> {
    throw new SandboxdError("unsupported", "resume needs the snapshot driver; this agent cold-boots VMs");
  }

  async pause(vm: DriverVm): Promise<void> {
    await this.mustLive(vm).qmp.execute("stop");
  }

  async unpause(vm: DriverVm): Promise<void> {
    await this.mustLive(vm).qmp.execute("cont");
  }

  /** Cold-booted VMs (`sandboxd run`, tests) have no egress: their guests' tunnels are closed. */
  onGuestTunnel(_handler: (vmId: string, t: GuestTunnel) => void): void {}

  async openTunnel(vm: DriverVm, port: number): Promise<GuestTunnel> {
    return this.mustLive(vm).handle.guest.openTunnel(port);
  }

  async openPty(vm: DriverVm, opts: PtyOptions): Promise<GuestTunnel> {
    return this.mustLive(vm).handle.guest.openPty(opts);
  }

  async destroy(vmId: string, vm: DriverVm | undefined): Promise<void> {
    const l = this.live.get(vm?.vmId ?? vmId);
    if (l) {
      l.destroying = true;
      l.handle.guest.close();
      await l.kill();
      this.live.delete(vmId);
    }
    await rm(join(vmsRoot(this.opts.stateDir), vmId), { recursive: true, force: true });
  }

  onExit(vm: DriverVm, cb: (info: VmExitInfo) => void): void {
    const l = this.live.get(vm.vmId);
    if (!l) return;
    l.exited
      .then((info) => {
        if (this.detached || l.destroying) return;
        this.live.delete(vm.vmId);
        l.qmp.close();
        l.handle.guest.close();
        cb(info);
      })
      .catch((err) => this.log(`vm ${vm.vmId}: handling its QEMU's exit failed: ${describeError(err)}`));
  }

  async diskBytes(vmId: string): Promise<number> {
    try {
      const st = await stat(join(vmsRoot(this.opts.stateDir), vmId, "disk.qcow2"));
      return st.blocks * 512;
    } catch {
      return 0;
    }
  }

  async adopt(ref: AdoptRef): Promise<DriverVm> {
    const image = this.templates.get(ref.templateId);
    if (!image) throw new SandboxdError("not_found", `template ${ref.templateId} is gone`);
    const dir = join(vmsRoot(this.opts.stateDir), ref.vmId);
    const started = performance.now();
    const proc = await adoptQemu(ref.qemuPid, dir);
    const exited = proc.exited.then(
      (): VmExitInfo => ({
        reason: pidGone(ref.qemuPid) ? "QEMU exited (adopted VM)" : "QMP connection to the adopted VM closed",
      }),
    );
    let guest: GuestClient;
    try {
      const status = await proc.qmp.execute<{ running: boolean; status: string }>("query-status");
      // A paused guest cannot answer HELLO: wake it; the manager re-arms its idle pause.
      if (!status.running) await proc.qmp.execute("cont");
      guest = await connectGuest(proc, ADOPT_HELLO_TIMEOUT_MS);
    } catch (err) {
      proc.qmp.close();
      throw new SandboxdError("vm_lost", "guest agent does not answer HELLO", { cause: err });
    }
    // The new owner of the directory is this process (reap uses it to tell live agents apart).
    await claimVm(dir, ref.qemuPid);
    const handle: DriverVm = {
      vmId: ref.vmId,
      templateId: ref.templateId,
      guest,
      image: image.config,
      size: ref.size,
      qemuPid: ref.qemuPid,
      dir,
      spawnMs: performance.now() - started,
    };
    const kill = async () => {
      guest.close();
      await proc.kill();
      await rm(dir, { recursive: true, force: true });
    };
    this.live.set(ref.vmId, { handle, qmp: proc.qmp, exited, kill, destroying: false });
    return handle;
  }

  reap(keep: ReadonlySet<string>): Promise<string[]> {
    return reapVmDirs(this.opts.stateDir, (id) => keep.has(id) || this.live.has(id));
  }

  async detach(): Promise<void> {
    this.detached = true;
    for (const l of this.live.values()) {
      l.handle.guest.close();
      l.qmp.close();
    }
    this.live.clear();
  }

  private mustLive(vm: DriverVm): Live {
    const l = this.live.get(vm.vmId);
    if (!l) throw new SandboxdError("gone", `VM ${vm.vmId} has no QEMU`);
    return l;
  }
}
