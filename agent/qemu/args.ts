/**
 * The command line of every QEMU of ours: the machine (microvm with the accelerator's options),
 * the kernel's command line, and the devices in their fixed order and ids (`DEVICE_IDS`), built
 * from a `LaunchOptions`. Also the names of the files QEMU makes in a VM's directory (`vmPaths`).
 * launch.ts starts the QEMU this describes, in its jail, and re-exports these names.
 */
import { readFileSync } from "node:fs";
import { basename, join } from "node:path";
import { SandboxdError } from "../../contracts/errors.ts";
import type { GuestArtifacts } from "../guest/artifacts.ts";
import { TCG_TB_MIB } from "./cgroup.ts";
import { consoleArgs } from "./console.ts";
import type { JailSettings } from "./jail-setup.ts";

/**
 * How QEMU runs the guest's CPU: hardware virtualization or the TCG emulator. A launch option;
 * which one works on this host is decided by the probe in accel.ts.
 */
export type Accel = "kvm" | "tcg";

/**
 * Fixed ids. A snapshot's device state names devices by id and by their position on the virtio
 * MMIO bus (which is the order of `-device` options), so every QEMU that saves or restores state
 * (template, its children, a forked parent and its children) must be started by THIS function
 * with the same ids in the same order. Never reorder the device options below; append new
 * devices at the end, and only together with a snapshot format bump.
 */
export const DEVICE_IDS = {
  memBackend: "mem",
  agentChardev: "agent0",
  serialBus: "vser0",
  agentPort: "agentport",
  diskFileNode: "disk0-file",
  diskNode: "disk0",
  disk: "vda",
  rngBackend: "rng0",
  rng: "rng",
} as const;

export interface MemBackend {
  /** A file on tmpfs/hugetlbfs holding guest RAM (the template snapshot's RAM image). */
  path: string;
  /**
   * true: writes go to the file (the template being frozen). false: private copy-on-write
   * mapping of the file (a child restoring from it; its writes never reach the file).
   */
  share: boolean;
}

export interface LaunchOptions {
  /** The VM's own directory; must exist. */
  dir: string;
  artifacts: GuestArtifacts;
  /** qcow2 overlay the guest sees as /dev/vda (agent/storage/qcow2.ts `createOverlayOn`). Omit for a diskless VM. */
  disk?: string;
  /**
   * The files the agent's own records say `disk` may be backed by. When given, a backing file
   * named by an image header that is not among them fails the jail (jail-setup.ts): an overlay a
   * jail has had could carry any name in its header, and each one is bound into the next jail.
   */
  backing?: ReadonlySet<string>;
  memMib: number;
  vcpus: number;
  accel: Accel;
  hostname?: string;
  memBackend?: MemBackend;
  /** Start with `-incoming defer`: the caller restores state with `migrate-incoming`, then `cont`. */
  incoming?: boolean;
  /**
   * Start paused (`-S`); the caller sends `cont`. With `incoming`, the guest also stays stopped
   * after the restore completes (without it QEMU autostarts the restored guest).
   */
  paused?: boolean;
  extraKernelArgs?: string[];
  /**
   * true (default): QEMU dies with the process that launched it (`setpriv --pdeathsig KILL`),
   * right for the one-shot `sandboxd run` CLI and for transient VMs (template builds). false: the
   * long-running agent's sandboxes, which must outlive an agent restart to be re-adopted; QEMU is
   * then started in its own session (a Ctrl-C or SIGTERM to the agent's process group does not
   * reach it), and the agent's reaper kills the VMs no record claims.
   */
  dieWithParent?: boolean;
  /** The operator's jail settings (uid range, `unshare`); default DEFAULT_JAIL. */
  jail?: JailSettings;
  log?: (msg: string) => void;
}

/** The files QEMU makes in a VM's directory: the names every owner of a VM agrees on. */
export function vmPaths(dir: string): {
  qmpSocket: string;
  agentSocket: string;
  consoleSocket: string;
  consoleLog: string;
  pidFile: string;
  hostPidFile: string;
} {
  return {
    qmpSocket: join(dir, "qmp.sock"),
    agentSocket: join(dir, "agent.sock"),
    consoleSocket: join(dir, "console.sock"),
    consoleLog: join(dir, "console.log"),
    // QEMU's own -pidfile (it also locks it: one QEMU per directory) holds its pid inside its pid
    // namespace; the jail writes QEMU's host pid beside it.
    pidFile: join(dir, "qemu.pid"),
    hostPidFile: join(dir, "qemu.hostpid"),
  };
}

/**
 * The host's TSC rate in kHz. Under TCG the guest's rdtsc reads the host TSC, and the guest's own
 * PIT calibration of it fails about one boot in six here ("tsc: Unable to calibrate against PIT"),
 * after which the kernel marks the TSC unstable and hangs before userspace. Passing the rate as
 * `tsc_early_khz` skips that calibration. /proc/cpuinfo's "cpu MHz" is the TSC rate on the
 * constant-TSC CPUs and VMs we run on; the guest clock is set from the host after boot anyway.
 */
let cachedTscKhz: number | undefined;
export function hostTscKhz(): number {
  if (cachedTscKhz !== undefined) return cachedTscKhz;
  // 2 GHz when cpuinfo says nothing usable: any plausible rate beats a hung calibration.
  let khz = 2_000_000;
  try {
    const m = /^cpu MHz\s*:\s*([\d.]+)/m.exec(readFileSync("/proc/cpuinfo", "utf8"));
    const mhz = m ? Number(m[1]) : Number.NaN;
    if (Number.isFinite(mhz) && mhz > 100) khz = Math.round(mhz * 1000);
  } catch {
    // keep the fallback
  }
  cachedTscKhz = khz;
  return khz;
}

/** An RFC 1123 label: what the guest may pass to sethostname and what DNS tools accept. */
export function isHostnameLabel(name: string): boolean {
  return /^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$/.test(name);
}

export function kernelCmdline(accel: Accel, hostname: string, extra: string[] = []): string {
  if (!isHostnameLabel(hostname))
    throw new SandboxdError("bad_request", `invalid hostname ${JSON.stringify(hostname)}`);
  const args = [
    "console=ttyS0",
    // Under TCG the guest otherwise stalls calibrating the TSC against the emulated PIT
    // (measured: the boot hangs there without these). Under KVM the kernel picks kvm-clock itself,
    // which survives migration.
    ...(accel === "tcg" ? ["tsc=reliable", "clocksource=tsc", `tsc_early_khz=${hostTscKhz()}`] : []),
    // A guest panic reboots at once (panic=-1), the triple-fault reboot (reboot=t) needs no
    // firmware, and -no-reboot turns that reboot into a QEMU exit the host sees.
    "panic=-1",
    "reboot=t",
    "quiet",
    "rdinit=/init",
    `sandboxd.hostname=${hostname}`,
    ...extra,
  ];
  return args.join(" ");
}

/**
 * `-M microvm` options. TCG needs the legacy PIT/PIC/RTC or the guest stalls at TSC calibration
 * (measured with QEMU 7.2 and Debian's 6.1 cloud kernel). Under KVM we follow QEMU's docs/system/i386/microvm.rst fast-boot setup: no PIT
 * and no PIC (the in-kernel LAPIC with the TSC-deadline timer and kvm-clock cover timekeeping;
 * Linux skips its PIT check when no PIC is found), saving their probe time. The RTC stays on so
 * the guest has a wall clock before the host's SET_CLOCK. `acpi=on` lets the kernel enumerate the
 * virtio-mmio devices without `virtio_mmio.device=` arguments (not compiled in this kernel).
 * `mem-merge=off`: QEMU's default marks guest RAM MADV_MERGEABLE, so on a host that runs KSM
 * (some distributions start it for VM hosts) one tenant's guest pages would be merged with
 * another's: a guest could then tell by the time of a write (a copy-on-write fault on a merged
 * page) whether another guest holds a page of given content, and tenants would share physical
 * pages (what Flip Feng Shui's Rowhammer attack needs). Shown in tests/vm/ram-file-readonly.test.ts
 * (no `mg` in the RAM mapping's VmFlags).
 */
export function machineOption(accel: Accel, memBackend: boolean): string {
  const legacy = accel === "tcg" ? "pit=on,pic=on,rtc=on" : "pit=off,pic=off,rtc=on";
  return `microvm,${legacy},acpi=on,mem-merge=off${memBackend ? `,memory-backend=${DEVICE_IDS.memBackend}` : ""}`;
}

/**
 * `-accel`/`-cpu`. KVM uses `-cpu host` (full host features, no emulation cost). TCG keeps QEMU's
 * default model (qemu64): Debian's userland targets the x86-64 baseline, and snapshots need every
 * QEMU in a family to present the same CPU, which a fixed model guarantees across hosts.
 *
 * TCG's translation buffer is bounded (`tb-size`, TCG_TB_MIB in cgroup.ts, where its choice is
 * measured): unset it is min(1 GiB, host RAM / 8), resident as far as code is translated, a
 * cost every VM's admission and cgroup would have to carry. Measured with `bench` (256 MiB guest
 * restored from a template, one `true` run, then idle): an idle VM's translated code is ~14 MiB
 * (32 and 16 MiB change nothing against the default); at 8 MiB exec p50 became 84-120 ms against
 * 3.7-7.6 ms because the guest's working set no longer fits and TCG flushes and retranslates.
 */
function accelArgs(accel: Accel): string[] {
  return accel === "kvm" ? ["-accel", "kvm", "-cpu", "host"] : ["-accel", `tcg,tb-size=${TCG_TB_MIB}`];
}

/**
 * The machine every QEMU of ours runs (sandboxes and the accelerator probe alike): microvm with
 * `accel`'s options and `memMib` of RAM; no default devices, no config files from /etc, no
 * display, no monitor on stdio (every device is named by the caller; -display none is
 * -nographic without its stdio multiplexing); a guest reboot exits QEMU instead.
 */
export function machineArgs(accel: Accel, memMib: number, memBackend = false): string[] {
  return [
    "-M",
    machineOption(accel, memBackend),
    ...accelArgs(accel),
    "-m",
    `${memMib}M`,
    "-nodefaults",
    "-no-user-config",
    "-display",
    "none",
    "-no-reboot",
  ];
}

export function buildQemuArgs(opts: LaunchOptions): string[] {
  const { dir } = opts;
  const paths = vmPaths(dir);
  const hostname = opts.hostname ?? "sandbox";
  const args: string[] = [
    "-name",
    `sandboxd-${basename(dir)}`,
    ...machineArgs(opts.accel, opts.memMib, opts.memBackend !== undefined),
    "-smp",
    String(opts.vcpus),
  ];
  if (opts.memBackend) {
    const mb = opts.memBackend;
    if (mb.path.includes(","))
      throw new SandboxdError("bad_request", `memory file path may not contain ',': ${mb.path}`);
    args.push(
      "-object",
      `memory-backend-file,id=${DEVICE_IDS.memBackend},size=${opts.memMib}M,mem-path=${mb.path},share=${mb.share ? "on" : "off"}`,
    );
  }
  args.push(
    "-kernel",
    opts.artifacts.vmlinux,
    "-initrd",
    opts.artifacts.initramfs,
    "-append",
    kernelCmdline(opts.accel, hostname, opts.extraKernelArgs),
    // The serial console goes to a socket the agent drains into a bounded log (console.ts). A
    // guest that runs at once (no -incoming, no -S) waits for that reader so its first boot
    // messages are kept; a restored guest is stopped until `cont`, after the drain connected.
    ...consoleArgs(paths.consoleSocket, !opts.incoming && !opts.paused),
    // The agent channel: a virtio-serial port named "agent" (the guest finds it by that name under
    // /sys/class/virtio-ports), backed by a unix socket QEMU listens on. wait=off: QEMU runs the
    // guest without waiting for us to connect, and we may reconnect after a restore.
    "-chardev",
    `socket,id=${DEVICE_IDS.agentChardev},path=${paths.agentSocket},server=on,wait=off`,
    "-device",
    `virtio-serial-device,id=${DEVICE_IDS.serialBus}`,
    "-device",
    `virtserialport,chardev=${DEVICE_IDS.agentChardev},name=agent,id=${DEVICE_IDS.agentPort}`,
  );
  if (opts.disk) {
    if (opts.disk.includes(","))
      throw new SandboxdError("bad_request", `disk path may not contain ',': ${opts.disk}`);
    args.push(
      // Node names and the device id are fixed (see DEVICE_IDS): blockdev-snapshot-sync in a
      // parent and the restore in its children refer to the same ids.
      "-blockdev",
      `driver=file,node-name=${DEVICE_IDS.diskFileNode},filename=${opts.disk}`,
      "-blockdev",
      `driver=qcow2,node-name=${DEVICE_IDS.diskNode},file=${DEVICE_IDS.diskFileNode}`,
      "-device",
      `virtio-blk-device,drive=${DEVICE_IDS.diskNode},id=${DEVICE_IDS.disk}`,
    );
  }
  args.push(
    // Entropy for the guest's CRNG from the host's; forks still need the agent's ENTROPY reseed,
    // since a restored CRNG state is identical in every child.
    "-object",
    `rng-random,id=${DEVICE_IDS.rngBackend},filename=/dev/urandom`,
    "-device",
    `virtio-rng-device,rng=${DEVICE_IDS.rngBackend},id=${DEVICE_IDS.rng}`,
    "-qmp",
    `unix:${paths.qmpSocket},server=on,wait=off`,
    "-pidfile",
    paths.pidFile,
  );
  if (opts.incoming) args.push("-incoming", "defer");
  // With -incoming, -S keeps the restored guest stopped until `cont` (else QEMU starts it the
  // moment the restore completes): snapshot restores need that to re-stage state first.
  if (opts.paused) args.push("-S");
  return args;
}
