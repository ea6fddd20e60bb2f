import { spawn } from "node:child_process";
import { constants, existsSync } from "node:fs";
import { access, mkdtemp, open, readFile, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describeError } from "../../contracts/errors.ts";
import type { GuestArtifacts } from "../guest/artifacts.ts";
import { JAIL_ENV, sandboxOption } from "./jail.ts";
import type { JailSettings } from "./jail-setup.ts";
import { type Accel, launchVm, machineArgs, QEMU_BINARY } from "./launch.ts";

export interface AccelChoice {
  accel: Accel;
  /** Why: shown in logs and in health/doctor output. */
  reason: string;
}

export interface ProbeOptions {
  log?: (msg: string) => void;
  /**
   * Guest kernel + initramfs for the boot probe. Without them the probe only checks that a KVM
   * vCPU starts (cheaper, but it cannot see a kernel that hangs after the firmware).
   */
  artifacts?: GuestArtifacts;
  /**
   * The operator's `SANDBOXD_ACCEL` (from cli/settings/): `kvm` or `tcg` skip the probe; `auto`,
   * empty or unset probe.
   */
  setting?: string;
  /** Overrides for tests; default to the real host. */
  devKvm?: string;
  procModules?: string;
  sysModule?: string;
}

/**
 * How long the boot probe lets the guest kernel run under KVM before calling KVM broken. A real
 * KVM boots this kernel to /init in ~0.3 s; a nested host that can run it is a few times slower.
 * On the failing hosts (kvm_pvm) the guest hangs right after the firmware and never prints, so
 * the timeout IS the failure path: keep it short, it is paid once per agent process start there.
 */
const KVM_BOOT_PROBE_TIMEOUT_MS = 5_000;

/** The kernel prints this (KERN_INFO, so not hidden by loglevel) just before it execs /init. */
const INIT_REACHED = "Run /init as init process";

let cached: Promise<AccelChoice> | undefined;

/**
 * Picks the accelerator once per process. KVM only when all hold:
 *  1. /dev/kvm opens read-write;
 *  2. `kvm_intel` or `kvm_amd` is loaded. Other KVM providers, like `kvm_pvm` on the CI hosts,
 *     give a /dev/kvm on which stock guest kernels hang after the firmware, with no console
 *     output (`-cpu host` even aborts with "failed to set MSR 0x10a");
 *  3. a probe VM actually runs under `-accel kvm`: the guest kernel reaching /init when artifacts
 *     are given, else a KVM vCPU starting and running.
 * Otherwise TCG, with the reason. The setting `SANDBOXD_ACCEL=tcg|kvm` overrides the probe.
 */
export function probeAccelerator(opts: ProbeOptions = {}): Promise<AccelChoice> {
  // A forced accelerator is no probe; only the probe of the real host is worth keeping.
  const uncached =
    opts.setting === "kvm" ||
    opts.setting === "tcg" ||
    opts.devKvm !== undefined ||
    opts.procModules !== undefined;
  if (uncached) return probeUncached(opts);
  cached ??= probeUncached(opts).catch((err) => {
    cached = undefined; // A probe that threw (not "said TCG") may be retried.
    throw err;
  });
  return cached;
}

/** For tests: forget the per-process result. */
export function resetAcceleratorCache(): void {
  cached = undefined;
}

async function probeUncached(opts: ProbeOptions): Promise<AccelChoice> {
  const log = opts.log ?? (() => {});
  const choose = (c: AccelChoice) => {
    log(`accelerator: ${c.accel} (${c.reason})`);
    return c;
  };
  const forced = opts.setting;
  if (forced === "tcg" || forced === "kvm")
    return choose({ accel: forced, reason: `SANDBOXD_ACCEL=${forced}` });
  if (forced !== undefined && forced !== "" && forced !== "auto")
    log(`ignoring SANDBOXD_ACCEL=${forced} (want auto, tcg or kvm)`);

  const devKvm = opts.devKvm ?? "/dev/kvm";
  try {
    await access(devKvm, constants.R_OK | constants.W_OK);
    const fh = await open(devKvm, "r+");
    await fh.close();
  } catch (err) {
    return choose({
      accel: "tcg",
      reason: `${devKvm} cannot be opened read-write (${(err as NodeJS.ErrnoException).code ?? String(err)})`,
    });
  }

  const modules = await loadedKvmModules(
    opts.procModules ?? "/proc/modules",
    opts.sysModule ?? "/sys/module",
  );
  const vendor = modules.find((m) => m === "kvm_intel" || m === "kvm_amd");
  if (!vendor) {
    const others = modules.filter((m) => m.startsWith("kvm")).join(", ") || "none";
    return choose({
      accel: "tcg",
      reason: `neither kvm_intel nor kvm_amd is loaded (kvm modules: ${others})`,
    });
  }

  const probe = opts.artifacts ? await probeKvmBoot(opts.artifacts) : await probeKvmVcpu();
  if (!probe.ok)
    return choose({ accel: "tcg", reason: `${vendor} loaded but the KVM probe failed: ${probe.detail}` });
  return choose({ accel: "kvm", reason: `${vendor} loaded and ${probe.detail}` });
}

/** Module names from /proc/modules, or from /sys/module where /proc/modules is not readable. */
async function loadedKvmModules(procModules: string, sysModule: string): Promise<string[]> {
  try {
    const text = await readFile(procModules, "utf8");
    return text
      .split("\n")
      .map((l) => l.split(" ")[0] ?? "")
      .filter((n) => n.startsWith("kvm"));
  } catch {
    // Some containers hide /proc/modules; /sys/module/<name> exists for every loaded module.
    return ["kvm", "kvm_intel", "kvm_amd", "kvm_pvm"].filter((n) => existsSync(join(sysModule, n)));
  }
}

export interface ProbeResult {
  ok: boolean;
  detail: string;
}

/**
 * Boots the real guest kernel under KVM with the launch path's own machine options, watching the
 * serial console for the kernel's "Run /init" line. This is the failure that matters: on kvm_pvm
 * QEMU starts fine and the guest hangs silently after the firmware.
 */
export async function probeKvmBoot(
  artifacts: GuestArtifacts,
  timeoutMs = KVM_BOOT_PROBE_TIMEOUT_MS,
): Promise<ProbeResult> {
  const args = [
    ...machineArgs("kvm", 128),
    "-kernel",
    artifacts.vmlinux,
    "-initrd",
    artifacts.initramfs,
    // No `quiet`: the "Run /init" line is what we wait for. rdinit points at /init, which we stop
    // right there, so the agent never runs and no disk or socket is needed.
    "-append",
    "console=ttyS0 panic=-1 reboot=t rdinit=/init",
    "-serial",
    "stdio",
  ];
  const { ok, detail } = await runProbe(
    args,
    timeoutMs,
    (out) => out.includes(INIT_REACHED),
    "the guest kernel reached /init under KVM",
  );
  return { ok, detail };
}

/**
 * Cheaper check without a guest kernel: a paused-free KVM vCPU runs the microvm firmware for a
 * moment without QEMU aborting (on kvm_pvm `-cpu host` aborts with "failed to set MSR").
 * Weaker than the boot probe, used only when no artifacts are given.
 */
async function probeKvmVcpu(timeoutMs = 1_000): Promise<ProbeResult> {
  const args = machineArgs("kvm", 32);
  // Still running after the window means the vCPU runs; an early exit means KVM refused.
  const r = await runProbe(args, timeoutMs, () => false, "");
  return r.timedOut
    ? { ok: true, detail: "a KVM vCPU runs (no guest kernel was given to boot-probe)" }
    : { ok: false, detail: r.detail };
}

function runProbe(
  args: string[],
  timeoutMs: number,
  done: (out: string) => boolean,
  okDetail: string,
): Promise<ProbeResult & { timedOut: boolean }> {
  return new Promise((resolve) => {
    const t0 = Date.now();
    // The probe runs only our own kernel and initramfs, never tenant code, for a moment at agent
    // start, so it is not jailed; it still runs under QEMU's seccomp sandbox.
    const child = spawn(QEMU_BINARY, [...args, "-sandbox", sandboxOption()], {
      env: { ...JAIL_ENV },
      stdio: ["ignore", "pipe", "pipe"],
    });
    let out = "";
    let err = "";
    let settled = false;
    const finish = (r: ProbeResult, timedOut = false) => {
      if (settled) return;
      settled = true;
      clearTimeout(timer);
      child.kill("SIGKILL");
      resolve({ ...r, timedOut });
    };
    const timer = setTimeout(
      () => finish({ ok: false, detail: `no sign of life within ${timeoutMs} ms` }, true),
      timeoutMs,
    );
    child.stdout?.on("data", (d: Buffer) => {
      out = (out + d.toString("latin1")).slice(-65536);
      if (done(out)) finish({ ok: true, detail: `${okDetail} in ${Date.now() - t0} ms` });
    });
    child.stderr?.on("data", (d: Buffer) => {
      err = (err + d.toString()).slice(-2000);
    });
    child.on("error", (e) => finish({ ok: false, detail: `cannot run ${QEMU_BINARY}: ${e.message}` }));
    child.on("exit", (code, signal) =>
      finish({
        ok: false,
        detail: `qemu exited early (${signal ?? `code ${code}`}): ${err.trim().split("\n").slice(-3).join(" | ")}`,
      }),
    );
  });
}

/**
 * Whether a jailed QEMU initializes KVM on this host: one started the way every VM is (launch.ts:
 * its own uid, no groups, the jail's own /dev/kvm node) but paused under `-accel kvm`, in a scratch
 * VM directory, answers QMP `query-kvm` with KVM present and enabled. No guest runs: this checks
 * the jail's grant of KVM, not whether a guest boots (probeKvmBoot).
 */
export async function probeJailedKvm(artifacts: GuestArtifacts, jail?: JailSettings): Promise<ProbeResult> {
  // Under /tmp: the VM's unix sockets need a short path (under 108 bytes).
  const dir = await mkdtemp(join(tmpdir(), "sbx-kvm-probe-"));
  try {
    const vm = await launchVm({
      dir,
      artifacts,
      memMib: 32,
      vcpus: 1,
      accel: "kvm",
      paused: true,
      ...(jail ? { jail } : {}),
    });
    try {
      const kvm = await vm.qmp.execute<{ enabled: boolean; present: boolean }>("query-kvm");
      return kvm.enabled && kvm.present
        ? {
            ok: true,
            detail: `a jailed QEMU (uid ${vm.jailUid}) initializes KVM (query-kvm: present, enabled)`,
          }
        : {
            ok: false,
            detail: `a jailed QEMU started, but query-kvm says present=${kvm.present}, enabled=${kvm.enabled}`,
          };
    } finally {
      await vm.kill();
    }
  } catch (err) {
    return {
      ok: false,
      detail: `a jailed QEMU cannot initialize KVM: ${describeError(err).split("\n").slice(0, 3).join(" | ")}`,
    };
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
}
