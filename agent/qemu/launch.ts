import { type ChildProcess, spawn } from "node:child_process";
import { readFileSync } from "node:fs";
import { readFile, rm } from "node:fs/promises";
import { constants as osConstants } from "node:os";
import { basename, join } from "node:path";
import { SandboxdError } from "../../contracts/errors.ts";
import type { GuestArtifacts } from "../guest/artifacts.ts";
import { type ConsoleDrain, consoleArgs, consoleTail, startConsoleDrain } from "./console.ts";
import { jailArgv, sandboxOption } from "./jail.ts";
import { type JailSettings, prepareJail, releaseJail } from "./jail-setup.ts";
import { QmpClient } from "./qmp/client.ts";

/**
 * Starts one QEMU `microvm` for one sandbox. Everything the VM owns on the host lives in its own
 * directory (`dir`): the QMP, agent and console sockets, the console log (console.ts) and `qemu.pid`, so that
 * killing the process and removing the directory frees it all (agent/vm/workdir.ts reclaims the
 * directories of a crashed agent through `qemu.pid`).
 */

export const QEMU_BINARY = "qemu-system-x86_64";

/**
 * How QEMU runs the guest's CPU: hardware virtualization or the TCG emulator. A launch option;
 * which one works on this host is decided by the probe in accel.ts.
 */
export type Accel = "kvm" | "tcg";

/**
 * Budget from spawn to a negotiated QMP connection. QEMU reaches its greeting in ~25-35 ms on
 * 2-core TCG hosts; 10 s only absorbs a badly overloaded CI machine. Past it, QEMU is
 * stuck, and the launch fails (and kills it) instead of hanging the caller.
 */
const QMP_CONNECT_TIMEOUT_MS = 10_000;

/** How long to wait for QEMU's exit status after its QMP socket hung up during start. */
const EXIT_AFTER_HANGUP_MS = 1_000;

/** How much of QEMU's stderr and of the console we keep for error messages. */
const STDERR_TAIL_BYTES = 8192;
const CONSOLE_TAIL_BYTES = 4096;

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
 * Removes what a QEMU leaves in its directory once it is gone (its sockets and pid file): stale
 * sockets would make the next QEMU's connect reach nothing, a stale pid file names a dead pid.
 */
export async function removeQemuFiles(dir: string): Promise<void> {
  const { qmpSocket, agentSocket, consoleSocket, pidFile, hostPidFile } = vmPaths(dir);
  await Promise.all(
    [qmpSocket, agentSocket, consoleSocket, pidFile, hostPidFile].map((p) => rm(p, { force: true })),
  );
}

export interface VmExit {
  code: number | null;
  signal: NodeJS.Signals | null;
}

export interface VmProcess {
  pid: number;
  dir: string;
  qmp: QmpClient;
  agentSocket: string;
  consoleLog: string;
  pidFile: string;
  /** Resolves when QEMU has exited (never rejects). */
  exited: Promise<VmExit>;
  /** SIGKILL, wait for the exit, close QMP, remove the sockets and pid file. Idempotent. */
  kill(): Promise<void>;
  isAlive(): boolean;
  /** Last bytes QEMU wrote to stderr (for diagnostics). */
  stderrTail(): string;
  /** The uid its jail runs it as (recorded in the VM's owner record for adoption). */
  jailUid?: number;
  /**
   * How a migration socket the agent listens on must be made for this QEMU to connect to it:
   * owned by its jail's uid (agent/snapshot/stream.ts).
   */
  migrationSocket?: { mode: number; uid: number; gid: number };
}

/** QEMU exited or never answered while starting. Carries what QEMU and the guest said last. */
export class VmLaunchError extends SandboxdError {
  constructor(
    message: string,
    details: { stderrTail: string; consoleTail: string; exit?: VmExit },
    cause?: unknown,
  ) {
    const tails = [
      details.stderrTail.trim() && `qemu stderr:\n${details.stderrTail.trim()}`,
      details.consoleTail.trim() && `console:\n${details.consoleTail.trim()}`,
    ]
      .filter(Boolean)
      .join("\n");
    super("vm_launch_failed", tails ? `${message}\n${tails}` : message, { cause, details });
    this.name = "VmLaunchError";
  }
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
 */
export function machineOption(accel: Accel, memBackend: boolean): string {
  const legacy = accel === "tcg" ? "pit=on,pic=on,rtc=on" : "pit=off,pic=off,rtc=on";
  return `microvm,${legacy},acpi=on${memBackend ? `,memory-backend=${DEVICE_IDS.memBackend}` : ""}`;
}

/**
 * `-accel`/`-cpu`. KVM uses `-cpu host` (full host features, no emulation cost). TCG keeps QEMU's
 * default model (qemu64): Debian's userland targets the x86-64 baseline, and snapshots need every
 * QEMU in a family to present the same CPU, which a fixed model guarantees across hosts.
 *
 * TCG keeps QEMU's default translation-buffer size (`tb-size`, 1 GiB of address space, resident
 * only as far as code is translated). Measured with `bench` (256 MiB guest restored from a
 * template, one `true` run, then idle; 2-core host shared with other builds, two runs each):
 * idle PSS 39.4-40 MiB and exec p50 3.7-7.6 ms with the default; 32 and 16 MiB change nothing
 * (an idle VM's translated code is ~14 MiB); 12 MiB saves 3-4 MiB (35.6-37) and 8 MiB saves 7
 * (32.4-32.9), but at 8 MiB exec p50 became 84-120 ms because the guest's working set no longer
 * fits and TCG flushes and retranslates; a busy guest (Python, Chromium) translates far more than
 * busybox does. The buffer is not worth bounding for idle memory: the cost sits elsewhere in
 * QEMU (docs/benchmarks.md, "Idle memory"), and a VM's code cache is its CPU speed under TCG.
 */
function accelArgs(accel: Accel): string[] {
  return accel === "kvm" ? ["-accel", "kvm", "-cpu", "host"] : ["-accel", "tcg"];
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

/**
 * QEMU 7.2 has no `-run-with` to tie its life to ours, so the jail is started through `setpriv
 * --pdeathsig KILL` (util-linux): the kernel SIGKILLs it when the process that spawned it dies,
 * even by SIGKILL, and the jail's own parent-death signal takes QEMU with it. `dieWithParent:
 * false` skips it (the agent's sandboxes, re-adopted after a restart).
 */
const SETPRIV = "/usr/bin/setpriv";

/** How long unshare may take to exit after its QEMU was killed (it follows within milliseconds). */
const UNSHARE_EXIT_WAIT_MS = 5_000;

/** How long the jail may take to write QEMU's host pid after QMP answered (it writes it first). */
const HOST_PID_WAIT_MS = 2_000;

/** The argv (program first) of QEMU with the seccomp sandbox every jailed QEMU runs under. */
export function sandboxedQemuArgv(opts: LaunchOptions): string[] {
  return [QEMU_BINARY_PATH, ...buildQemuArgs(opts), "-sandbox", sandboxOption()];
}

/** The absolute path of QEMU: the jail has no PATH search to rely on. */
export const QEMU_BINARY_PATH = `/usr/bin/${QEMU_BINARY}`;

/**
 * Readies the jail of `opts`'s VM (uid, cgroup, file ownership) and returns the argv that starts
 * its QEMU in it, wrapped for `dieWithParent`. Throws JailError (`vm_launch_failed`) when an
 * ingredient is missing; `release` frees what it took once QEMU is gone.
 */
export async function jailedLaunchArgv(
  opts: LaunchOptions,
): Promise<{ argv: string[]; uid: number; release: () => Promise<void> }> {
  const { dir } = opts;
  const jail = await prepareJail({
    dir,
    vmlinux: opts.artifacts.vmlinux,
    initramfs: opts.artifacts.initramfs,
    ...(opts.disk ? { disk: opts.disk } : {}),
    ...(opts.memBackend ? { mem: opts.memBackend } : {}),
    memMib: opts.memMib,
    vcpus: opts.vcpus,
    kvm: opts.accel === "kvm",
    hostPidFile: vmPaths(dir).hostPidFile,
    ...(opts.jail ? { settings: opts.jail } : {}),
  });
  const argv = jailArgv(jail.spec, sandboxedQemuArgv(opts));
  const dieWithParent = opts.dieWithParent ?? true;
  return {
    argv: dieWithParent ? [SETPRIV, "--pdeathsig", "KILL", "--", ...argv] : argv,
    uid: jail.uid,
    release: () => releaseJail(dir, jail.uid),
  };
}

/** QEMU's host pid as the jail wrote it; undefined when it is not there (yet). */
export async function readHostPid(dir: string, waitMs = 0): Promise<number | undefined> {
  const deadline = performance.now() + waitMs;
  for (;;) {
    try {
      const text = (await readFile(vmPaths(dir).hostPidFile, "utf8")).trim();
      if (/^\d+$/.test(text) && Number(text) > 0) return Number(text);
    } catch {
      // not written yet
    }
    if (performance.now() >= deadline) return undefined;
    await Bun.sleep(5);
  }
}

export async function launchVm(opts: LaunchOptions): Promise<VmProcess> {
  const log = opts.log ?? (() => {});
  const { dir } = opts;
  const { qmpSocket, consoleSocket, consoleLog } = vmPaths(dir);
  // Left by an earlier QEMU in this directory.
  await removeQemuFiles(dir);

  const dieWithParent = opts.dieWithParent ?? true;
  const jail = await jailedLaunchArgv(opts);
  const [cmd, ...argv] = jail.argv as [string, ...string[]];
  log(
    `starting ${QEMU_BINARY} jailed as uid ${jail.uid} (${opts.accel}, ${opts.memMib} MiB, ${opts.vcpus} vCPU) in ${dir}`,
  );
  let child: ChildProcess;
  try {
    child = spawn(cmd, argv, {
      cwd: dir,
      detached: !dieWithParent,
      stdio: ["ignore", "ignore", "pipe"],
    });
  } catch (err) {
    await jail.release();
    throw err;
  }
  let qemuPid: number | undefined;
  // Connects while QMP does: a cold boot's QEMU waits for this reader before it goes on.
  const consoleDrain = startConsoleDrain(consoleSocket, consoleLog, log);

  let stderr = "";
  child.stderr?.on("data", (d: Buffer) => {
    stderr = (stderr + d.toString()).slice(-STDERR_TAIL_BYTES);
  });
  const started = new AbortController();
  let exitInfo: VmExit | undefined;
  const exited = new Promise<VmExit>((resolve) => {
    child.on("exit", (code, signal) => {
      exitInfo = jailExit(code, signal);
      started.abort(new Error(`qemu exited (${signal ?? `code ${code}`})`));
      resolve(exitInfo);
    });
    child.on("error", (err) => {
      // spawn itself failed (binary missing): there will be no exit event.
      stderr += `\n${err.message}`;
      exitInfo = { code: null, signal: null };
      started.abort(err);
      resolve(exitInfo);
    });
  });
  const isAlive = () => exitInfo === undefined;

  const stop = async () => {
    qemuPid ??= await readHostPid(dir);
    if (isAlive() && qemuPid !== undefined) {
      // QEMU only: unshare, its parent, reaps it and then exits. Killing unshare too would leave
      // QEMU's exit status to whoever adopts orphans, and the pid visible until they collect it.
      killQuietly(qemuPid);
      await Promise.race([exited, Bun.sleep(UNSHARE_EXIT_WAIT_MS)]);
    }
    if (isAlive()) child.kill("SIGKILL"); // QEMU never started, or unshare did not follow it
    await exited;
    await jail.release();
  };
  const launchError = async (message: string, cause?: unknown) => {
    await stop();
    // Let the stderr pipe drain after the exit so the tail holds QEMU's last words.
    await new Promise((r) => setTimeout(r, 20));
    await consoleDrain.close();
    await removeQemuFiles(dir);
    return new VmLaunchError(
      message,
      {
        stderrTail: stderr,
        consoleTail: await consoleTail(consoleLog, CONSOLE_TAIL_BYTES),
        ...(exitInfo ? { exit: exitInfo } : {}),
      },
      cause,
    );
  };

  let qmp: QmpClient;
  try {
    qmp = await QmpClient.connect(qmpSocket, {
      timeoutMs: QMP_CONNECT_TIMEOUT_MS,
      signal: started.signal,
      log,
    });
  } catch (err) {
    // QEMU dying closes the QMP socket, which may reach us before its exit status does; give
    // the exit a moment (it follows within milliseconds) so the error says what happened.
    await Promise.race([exited, new Promise((r) => setTimeout(r, EXIT_AFTER_HANGUP_MS))]);
    const why = exitInfo
      ? `qemu exited during start (${exitInfo.signal ?? `code ${exitInfo.code}`})`
      : "qemu did not answer on QMP";
    throw await launchError(why, err);
  }
  qemuPid = await readHostPid(dir, HOST_PID_WAIT_MS);
  if (qemuPid === undefined) {
    qmp.close();
    throw await launchError("the jail did not report QEMU's host pid");
  }
  const pid = qemuPid;
  log(`qemu pid ${pid} (uid ${jail.uid}) up, QMP connected`);
  // QMP answering means every chardev exists: the drain is connected (or the QEMU has none),
  // before a restored guest is let run.
  await consoleDrain.ready;

  return vmProcess(
    pid,
    dir,
    qmp,
    exited,
    { stop, isAlive, stderrTail: () => stderr, consoleDrain },
    jail.uid,
  );
}

/**
 * QEMU's exit as the jail reports it: its pid 1 exits with 128 + the signal that killed QEMU
 * (jail.ts), which reads back as that signal.
 */
export function jailExit(code: number | null, signal: NodeJS.Signals | null): VmExit {
  if (code !== null && code > 128 && code < 128 + 65) {
    const name = Object.entries(osConstants.signals).find(([, n]) => n === code - 128)?.[0];
    if (name) return { code: null, signal: name as NodeJS.Signals };
  }
  return { code, signal };
}

function killQuietly(pid: number): void {
  try {
    process.kill(pid, "SIGKILL");
  } catch {
    // already gone
  }
}

/**
 * The `VmProcess` of a running QEMU, ours (launchVm) or adopted (agent/vm/process.ts): `stop`
 * kills it and waits for it; `kill` runs that once, then closes QMP and the console drain and
 * removes QEMU's files. An adopted QEMU's console is drained from here on (`consoleDrain` omitted:
 * a drain is started), so a VM that outlived its agent keeps a bounded console under the next one.
 */
export function vmProcess(
  pid: number,
  dir: string,
  qmp: QmpClient,
  exited: Promise<VmExit>,
  o: {
    stop: () => Promise<void>;
    isAlive: () => boolean;
    stderrTail: () => string;
    consoleDrain?: ConsoleDrain;
  },
  jailUid?: number,
): VmProcess {
  const { agentSocket, consoleSocket, consoleLog, pidFile } = vmPaths(dir);
  const consoleDrain = o.consoleDrain ?? startConsoleDrain(consoleSocket, consoleLog);
  // The console is drained while this process holds the QEMU's QMP: every way of letting go of a
  // QEMU (kill, its death, a detach that leaves it to the next agent) closes QMP, and a drain left
  // connected would keep QEMU's one console client slot from the agent that adopts it.
  void qmp.closed.then(() => consoleDrain.close());
  let killing: Promise<void> | undefined;
  const kill = () => {
    killing ??= (async () => {
      await o.stop();
      qmp.close();
      await consoleDrain.close();
      await removeQemuFiles(dir);
    })();
    return killing;
  };
  const { isAlive, stderrTail } = o;
  return {
    pid,
    dir,
    qmp,
    agentSocket,
    consoleLog,
    pidFile,
    exited,
    kill,
    isAlive,
    stderrTail,
    ...(jailUid === undefined
      ? {}
      : { jailUid, migrationSocket: { mode: 0o600, uid: jailUid, gid: jailUid } }),
  };
}
