import { spawnSync } from "node:child_process";
import { existsSync, readFileSync, statfsSync } from "node:fs";
import { mkdir } from "node:fs/promises";
import { ensureGuestArtifacts } from "../agent/guest/artifacts.ts";
import { type AccelChoice, probeAccelerator, probeJailedKvm } from "../agent/qemu/accel.ts";
import { jailChecks } from "../agent/qemu/jail-checks.ts";
import { ensureRamShim } from "../agent/qemu/ram-shim.ts";
import { TCG_BOUNDARY } from "../contracts/api/health.ts";
import { describeError } from "../contracts/errors.ts";
import type { MachineSettings } from "./settings.ts";

export interface Check {
  name: string;
  ok: boolean;
  detail: string;
  fix?: string;
  /** Passes, but must be read: printed as WARN. */
  warn?: boolean;
}

/** QEMU 7.2 (Debian 12) is what microvm snapshots were measured on; older lacks x-ignore-shared on microvm. */
const MIN_QEMU = [7, 2];
/** Images, overlays and snapshot files: below this a template build or a few forks fill the disk. */
const MIN_DISK_FREE_GIB = 4;
/** Template RAM files live in /dev/shm: one 256 MiB guest needs that much, plus room for a few. */
const MIN_SHM_FREE_GIB = 1;

/** The kernel's KSM controls (run: 1 while ksmd merges; absent on a kernel built without KSM). */
export const KSM_SYSFS = "/sys/kernel/mm/ksm";

/**
 * What KSM does to this host's VMs: guest RAM is never offered (QEMU runs with mem-merge=off);
 * with SANDBOXD_KSM=qemu QEMU's own memory is, which merges only while the host runs KSM, which
 * the agent leaves to the operator (docs/isolation.md "KSM: guest RAM never, QEMU's own memory by
 * choice"). A setting that merges nothing is a warning, not a failure: the VMs run either way.
 */
export function ksmCheck(ksmQemu: boolean, sysfs = KSM_SYSFS): Check {
  let run: string | undefined;
  let pages: string | undefined;
  try {
    run = readFileSync(`${sysfs}/run`, "utf8").trim();
    pages = readFileSync(`${sysfs}/pages_to_scan`, "utf8").trim();
  } catch {
    // a kernel without KSM (no sysfs controls) or a sysfs the agent cannot read
  }
  const running = run === "1";
  const host =
    run === undefined
      ? "this kernel has no KSM"
      : running
        ? `host KSM running (${pages} pages a scan)`
        : "host KSM off";
  if (!ksmQemu)
    return {
      name: "ksm",
      ok: true,
      detail: `guest RAM never offered; QEMU's own memory not offered (SANDBOXD_KSM=off); ${host}`,
    };
  if (running)
    return {
      name: "ksm",
      ok: true,
      detail: `QEMU's own memory offered, guest RAM never (SANDBOXD_KSM=qemu); ${host}`,
    };
  const start =
    run === undefined ? "" : ` (${sysfs}/run is ${run}; the operator starts it: echo 1 > ${sysfs}/run)`;
  return { name: "ksm", ok: true, warn: true, detail: `SANDBOXD_KSM=qemu merges nothing: ${host}${start}` };
}

function tool(name: string, args: string[]): { ok: boolean; out: string } {
  const r = spawnSync(name, args, { encoding: "utf8" });
  return { ok: r.status === 0, out: `${r.stdout ?? ""}${r.stderr ?? ""}`.trim() };
}

function freeGiB(path: string): number {
  const s = statfsSync(path);
  return (s.bavail * s.bsize) / 2 ** 30;
}

/** QEMU at its minimum version and the host tools the agent runs, each found and answering. */
function toolChecks(): Check[] {
  const checks: Check[] = [];
  const fixPkgs = "run any `bin/sandboxd` command: it installs missing Debian packages";

  const q = tool("qemu-system-x86_64", ["--version"]);
  const m = /version (\d+)\.(\d+)\.?(\d*)/.exec(q.out);
  const qemuOk =
    q.ok &&
    m !== null &&
    (Number(m[1]) > MIN_QEMU[0]! || (Number(m[1]) === MIN_QEMU[0] && Number(m[2]) >= MIN_QEMU[1]!));
  checks.push({
    name: "qemu",
    ok: qemuOk,
    detail: m ? `qemu-system-x86_64 ${m[1]}.${m[2]}.${m[3]}` : "qemu-system-x86_64 not found",
    fix: `install qemu-system-x86 >= ${MIN_QEMU.join(".")} (${fixPkgs})`,
  });
  for (const [bin, pkg, args] of [
    ["qemu-img", "qemu-utils", ["--version"]],
    ["mkfs.ext4", "e2fsprogs", ["-V"]],
    ["skopeo", "skopeo", ["--version"]],
    ["umoci", "umoci", ["--version"]],
    ["musl-gcc", "musl-tools", ["--version"]],
    ["lz4", "lz4", ["--version"]],
    ["cpio", "cpio", ["--version"]],
  ] as const) {
    const r = tool(bin, [...args]);
    checks.push({
      name: bin,
      ok: r.ok || (bin === "musl-gcc" && r.out.length > 0),
      detail: r.ok ? (r.out.split("\n")[0] ?? "") : "not found",
      fix: `apt-get install ${pkg}`,
    });
  }

  return checks;
}

export async function doctor(
  dataDir: string,
  opts: { build: boolean; machine: MachineSettings },
): Promise<number> {
  const checks: Check[] = toolChecks();

  let acc: AccelChoice | undefined;
  try {
    acc = await probeAccelerator({ setting: opts.machine.accel });
    checks.push({ name: "accelerator", ok: true, detail: `${acc.accel} (${acc.reason})` });
    if (acc.accel === "tcg") checks.push({ name: "boundary", ok: true, warn: true, detail: TCG_BOUNDARY });
  } catch (err) {
    checks.push({
      name: "accelerator",
      ok: false,
      detail: describeError(err),
      fix: "install qemu-system-x86",
    });
  }

  checks.push(...jailChecks(opts.machine.host.jail));
  checks.push(ksmCheck(opts.machine.host.jail.ksmQemu));
  try {
    const shim = await ensureRamShim();
    checks.push({
      name: "ram shim",
      ok: true,
      detail: `${shim}: a template's RAM file opens read-only in its children's jails`,
    });
  } catch (err) {
    checks.push({ name: "ram shim", ok: false, detail: describeError(err), fix: "apt-get install gcc" });
  }

  await mkdir(dataDir, { recursive: true });
  const disk = freeGiB(dataDir);
  checks.push({
    name: "disk",
    ok: disk >= MIN_DISK_FREE_GIB,
    detail: `${disk.toFixed(1)} GiB free in ${dataDir}`,
    fix: `free space or choose another --data-dir (need ${MIN_DISK_FREE_GIB} GiB)`,
  });
  const shm = freeGiB("/dev/shm");
  checks.push({
    name: "tmpfs",
    ok: shm >= MIN_SHM_FREE_GIB,
    detail: `${shm.toFixed(1)} GiB free in /dev/shm`,
    fix: `mount -o remount,size=4G /dev/shm (need ${MIN_SHM_FREE_GIB} GiB)`,
  });

  try {
    const a = await ensureGuestArtifacts({ dataDir, build: opts.build });
    checks.push({
      name: "guest",
      ok: true,
      detail: `kernel ${a.kernelVersion}, initramfs ${a.key.slice(0, 12)}`,
    });
    if (existsSync("/dev/kvm") && process.getuid?.() === 0) {
      // A jailed QEMU opens the jail's own /dev/kvm as its uid: a failure matters only when VMs
      // are to run under KVM; otherwise it is read as a warning.
      const k = await probeJailedKvm(a, opts.machine.host.jail);
      checks.push({
        name: "jail: kvm",
        ok: k.ok || acc?.accel !== "kvm",
        ...(k.ok ? {} : { warn: true }),
        detail: k.detail,
        fix: "check that the agent (root) can mknod and open /dev/kvm: VMs under KVM need it",
      });
    }
  } catch (err) {
    checks.push({
      name: "guest",
      ok: false,
      detail: describeError(err),
      fix: "run `bin/sandboxd doctor --build` (downloads the pinned Debian kernel, builds the initramfs)",
    });
  }

  let failed = 0;
  for (const c of checks) {
    process.stdout.write(`${c.ok ? (c.warn ? "WARN" : "ok  ") : "FAIL"}  ${c.name.padEnd(12)} ${c.detail}\n`);
    if (!c.ok) {
      failed++;
      if (c.fix) process.stdout.write(`      fix: ${c.fix}\n`);
    }
  }
  return failed === 0 ? 0 : 1;
}
