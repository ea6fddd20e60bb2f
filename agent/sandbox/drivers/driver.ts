/**
 * What the sandbox manager needs from the VM layer, and nothing more. The manager owns states,
 * serialization, idle pause, records and accounting; a driver owns QEMU processes, disks and
 * snapshots. The agent's implementation is `SnapshotDriver` (snapshot.ts, on agent/snapshot/:
 * template snapshots, fast spawn, live fork, suspend/resume); the tests also run the manager on
 * `BootDriver` (tests/support/boot-driver.ts: cold boot from an imported image, no fork/suspend).
 *
 * Contract for implementations:
 * - Every method throws `SandboxdError`s; `unsupported` when the driver cannot do it at all,
 *   `spawn_failed` / `bringup_timeout` when a VM did not come up, anything else is a failure.
 * - A handle's `guest` is connected (HELLO answered) when the handle is returned.
 * - `onExit` fires at most once per handle, when its QEMU is gone for any reason other than
 *   `destroy` (kill -9, guest panic with -no-reboot, OOM killer). It may fire before or after the
 *   guest connection drops; the manager copes with either order.
 * - Each VM lives in `<stateDir>/vms/<vmId>/` (agent/vm/workdir.ts); `reap` removes what no record
 *   claims.
 */
import type { GuestClient, GuestTunnel, PtyOptions } from "../../guest/client.ts";
import type { ImageConfig } from "../../image/import.ts";
import type { RegistryAuth } from "../../image/pull.ts";

export interface VmSize {
  vcpus: number;
  memMib: number;
}

/** Why a QEMU went away, in words for `failed` reasons and logs. */
export interface VmExitInfo {
  reason: string;
}

/** A VM with a live QEMU and a connected guest. Opaque to the manager apart from these fields. */
export interface DriverVm {
  readonly vmId: string;
  readonly templateId: string;
  readonly guest: GuestClient;
  /** The image's config: Env, WorkingDir, User, Entrypoint, Cmd (exec runs as Docker would). */
  readonly image: ImageConfig;
  readonly size: VmSize;
  readonly qemuPid: number;
  /** The VM's directory (sockets, overlay, console log). */
  readonly dir: string;
  /** QEMU spawn (or restore) to the guest's first answer, ms. */
  readonly spawnMs: number;
}

/** What a template becomes once prepared: everything a spawn needs to know up front. */
export interface PreparedTemplate {
  image: ImageConfig;
  exposedPorts: number[];
}

export type TemplateInput =
  /**
   * An image archive or OCI layout on this host; the driver may move or delete it. `readyCmd`
   * (docs/templates.md "Rules of templates") runs before a snapshot driver freezes the template: it starts services detached
   * and exits 0 once they are healthy (non-zero or a timeout fails the build).
   */
  | {
      kind: "archive";
      path: string;
      size?: Partial<VmSize>;
      readyCmd?: string[];
      readyTimeoutMs?: number;
      /**
       * The sessions API `wait_secs`: how long the build waits for its VM to come up (QEMU start to the
       * guest agent's HELLO); the driver's default when absent. Past it the build fails.
       */
      bringupTimeoutMs?: number;
    }
  /**
   * A ready template copied from another agent (agent/snapshot/template-copy.ts): the bundle
   * staged at `path` on this host, which the driver deletes. Its size is the one it was frozen
   * with (`PreparedWithTelemetry.frozenSize`).
   */
  | { kind: "copy"; path: string; size?: Partial<VmSize> }
  /**
   * An OCI reference to pull (sandboxes API bake, agent/image/pull.ts), then as an archive. `exposedPorts`
   * (`ready.ports`) replace the image's ExposedPorts when given.
   */
  | {
      kind: "oci";
      image: string;
      /** Whose bake this is, for the log. */
      tenantId?: string;
      /** The bake's registry credentials: the pull uses them and nothing keeps them. */
      registryAuth?: RegistryAuth;
      size?: Partial<VmSize>;
      readyCmd?: string[];
      readyTimeoutMs?: number;
      readyEnv?: Record<string, string>;
      exposedPorts?: number[];
    };

/** Where a build is (docs/templates.md "Rules of templates"): the registry reports it as the template's bake phase. */
export type BuildPhase = "Converting" | "Distributing";

export interface SandboxDriver {
  /** Readable name for health output and logs, e.g. "boot (tcg)". */
  readonly name: string;
  /** How its VMs run: under TCG the VM boundary is software emulation (health says so). */
  readonly accel?: "kvm" | "tcg";
  /** Turns a template source into something `spawn` can start, e.g. import + bake. */
  prepareTemplate(
    templateId: string,
    input: TemplateInput,
    signal: AbortSignal,
    onPhase?: (phase: BuildPhase) => void,
  ): Promise<PreparedTemplate>;
  /** Frees a template's own files. Called only once no VM uses it. */
  dropTemplate(templateId: string): Promise<void>;
  /** Re-registers a template prepared before an agent restart (from the template record). */
  restoreTemplate(templateId: string, prepared: PreparedTemplate): Promise<void>;
  /**
   * The bundle of a ready template for another agent to copy (`TemplateInput` kind "copy");
   * absent on drivers that keep no frozen files (a boot driver's template is its image).
   */
  exportTemplate?(templateId: string, prepared: PreparedTemplate): Promise<AsyncIterable<Uint8Array>>;

  /**
   * A VM of the template. When this driver holds a QEMU pre-launched for `vmId` (`prelaunch`),
   * only the restore is left to do; otherwise the whole spawn runs. Either way the VM is `vmId`.
   */
  spawn(templateId: string, vmId: string, size: VmSize): Promise<DriverVm>;
  /**
   * Optional: launches the QEMU of a later `spawn(templateId, vmId, size)` now, in its jail and
   * waiting for the template's state, so that spawn only restores (agent/sandbox/prelaunch-pool.ts).
   * The VM is `vmId`'s like any other: `destroy(vmId, undefined)` frees it, `reap` sweeps it
   * after a restart (nothing records it).
   */
  prelaunch?(templateId: string, vmId: string, size: VmSize): Promise<void>;
  /** Copy-on-write children of a running VM; the parent keeps running. */
  fork(parent: DriverVm, childIds: string[]): Promise<DriverVm[]>;
  /**
   * Kept snapshots (docs/snapshots.md; agent/snapshot/keep.ts): absent on drivers that keep no
   * memory (the boot driver). `keep` copies the running VM's memory and disk as snapshot `ref`
   * (it runs on after a fork's stall), `spawnFromKept` starts VM `vmId` from one, `dropKept`
   * drops one (idempotent; files shared with running VMs go with the last of them).
   */
  keep?(vm: DriverVm, ref: string, ports: string[]): Promise<{ sizeBytes: number; stallMs: number }>;
  /** `ports`: the exposed guest ports `keep` was given (the source's endpoints). */
  spawnFromKept?(ref: string, vmId: string): Promise<{ vm: DriverVm; ports: string[] }>;
  dropKept?(ref: string): Promise<void>;
  /**
   * Rolls running `vm` back to kept snapshot `ref` in place (keep.ts `restoreInPlace`): same VM
   * id, a new QEMU, a new handle. A refusal before its QEMU stopped leaves `vm` running as it
   * was (`lost: false`); a failure after it leaves no VM (`lost: true` on the error's details).
   */
  restoreKept?(
    vm: DriverVm,
    ref: string,
  ): Promise<{ vm: DriverVm; restoreMs: number; downMs: number; standby: boolean }>;
  /** The refs of the kept snapshots this host holds (their records, reloaded at a start). */
  keptRefs?(): Promise<string[]>;
  /** The size of VMs started from kept snapshot `ref` (its source's), for admission; none kept: undefined. */
  keptSize?(ref: string): Promise<VmSize | undefined>;
  /** Saves the VM to disk and stops its QEMU; the handle is dead afterwards. */
  suspend(vm: DriverVm): Promise<{ memBytes: number; snapshotBytes: number }>;
  resume(vmId: string, templateId: string, size: VmSize): Promise<DriverVm>;
  /** Stops / restarts the vCPUs (QMP `stop` / `cont`); the guest connection stays open. */
  pause(vm: DriverVm): Promise<void>;
  unpause(vm: DriverVm): Promise<void>;
  /**
   * A byte tunnel to 127.0.0.1:`port` inside the running guest over the guest agent's channel
   * (OP CONNECT, docs/guest-protocol.md "Tunnels"); no guest network is involved. Throws the
   * guest's `guest_error` (errno ECONNREFUSED etc.) when nothing accepts the connection.
   */
  openTunnel(vm: DriverVm, port: number): Promise<GuestTunnel>;
  /** A shell on a new pseudo-terminal in the running guest (OP PTY), as a tunnel to its master. */
  openPty(vm: DriverVm, opts: PtyOptions): Promise<GuestTunnel>;
  /**
   * Who takes the tunnels guests open (connections to a guest's egress proxy port,
   * docs/guest-protocol.md "Egress"); until set, each is closed at once.
   */
  onGuestTunnel(handler: (vmId: string, t: GuestTunnel) => void): void;
  /**
   * Kills the QEMU (when a handle is given), and removes everything the VM owns on disk,
   * including a suspended VM's snapshot. Idempotent; never fires `onExit`.
   */
  destroy(vmId: string, vm: DriverVm | undefined): Promise<void>;
  onExit(vm: DriverVm, cb: (info: VmExitInfo) => void): void;
  /** Bytes of the VM's own writable disk (its overlay), for metering. */
  diskBytes(vmId: string): Promise<number>;
  /**
   * Bytes its RAM files on tmpfs (templates', forks') hold now: host memory that no VM's guest
   * RAM counts, which admission adds (capacity.ts). Synchronous: admission is, and it is one
   * listing of a tmpfs directory. None without the method.
   */
  ramFilesBytes?(): number;
  /**
   * QEMUs launched ahead of a rollback (snapshot/standby.ts), one at most per VM, each holding
   * QEMU's own overhead beside the VM's: admission counts them (capacity.ts). None without it.
   */
  standbyCount?(): number;
  /**
   * Free bytes on the filesystem holding the VMs' disks, the reserve kept there, and the running
   * VMs' room to grow there, which admission counts (capacity.ts DiskAccounting). Synchronous like admission: a statfs
   * and a stat per running VM. Disk growth is not counted without the method.
   */
  diskRoom?(): { freeBytes: number; reserveBytes: number; growBytes: number };
  /**
   * Bytes a new VM of the template may write to its overlay (its disk's virtual size), or, with
   * `resumeVmId`, what that suspended VM's overlay may still grow by; for admission.
   */
  newDiskBytes?(templateId: string, resumeVmId?: string): number;

  /**
   * Reconnects to a VM started before an agent restart: QEMU alive, QMP answers, guest answers
   * HELLO. Throws a `SandboxdError` whose message is the reason when it cannot.
   */
  adopt(ref: AdoptRef): Promise<DriverVm>;
  /** Kills and removes every VM directory whose id is not in `keep`. Returns the ids reaped. */
  reap(keep: ReadonlySet<string>): Promise<string[]>;
  /**
   * Closes this driver's connections WITHOUT killing any VM: what an agent process exit does.
   * Used to hand VMs over to a new manager (restart) and by tests that simulate a restart.
   * Resolves once what was only this process's (a rollback's standby QEMU) is gone.
   */
  detach(): Promise<void>;
}

export interface AdoptRef {
  vmId: string;
  templateId: string;
  size: VmSize;
  qemuPid: number;
  /** Whether the VM was idle-paused when the record was written. */
  paused: boolean;
}
