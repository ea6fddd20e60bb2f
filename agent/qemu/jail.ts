/**
 * The jail every QEMU of ours runs in, built from util-linux alone (no setuid or compiled helper
 * of ours), on the model of Firecracker's jailer:
 *
 *   unshare --mount --pid --ipc --uts --net --fork --propagation private --kill-child=KILL
 *     -- /bin/sh -c SCRIPT
 *
 * SCRIPT (generated here, every path shell-quoted) runs as root in the new namespaces; the
 * namespace's pid 1 (the shell) waits for a subshell that:
 *   1. writes its own host pid (read through the host's /proc, before a new one is mounted) to
 *      the VM's `qemu.pid`: the shell execs QEMU, so that pid is QEMU's on the host; and makes
 *      itself, so QEMU, the OOM killer's preferred victim (`QEMU_OOM_SCORE_ADJ`, oom.ts);
 *   2. joins the VM's cgroups (agent/qemu/cgroup.ts), so QEMU's memory, pids and CPU are capped;
 *   3. mounts a tmpfs as the new root (`<vm dir>/root`) and recreates under it the SAME absolute
 *      paths QEMU's argv names, each a bind mount: /usr read-only (QEMU, its libraries and ROMs;
 *      Debian is merged-usr, so /bin, /lib, /lib64, /sbin are symlinks into it), the kernel, the
 *      initramfs and every backing file of the disk read-only, the VM's own overlay and RAM file
 *      and its directory (sockets, console, pid file) writable; /dev holds null, zero, random,
 *      urandom (the host's, bound) and, under KVM, a kvm node of the jail's own (jail-setup.ts
 *      makes it, owned by the VM's uid, mode 0600): the host's /dev/kvm is never bound, so its
 *      mode and group do not matter; a fresh /proc for the new pid namespace;
 *   4. pivot_root into it and detaches the old root: nothing else of the host is reachable;
 *   5. sets rlimits (file size, open files) and execs `setpriv` to the VM's own uid/gid with no
 *      supplementary groups, no capabilities (effective, permitted, inheritable, ambient and
 *      bounding set), no-new-privs and a parent-death signal, which execs QEMU with
 *      `-sandbox on,...` (seccomp: no spawning, no privilege changes, no obsolete syscalls, no
 *      resource control).
 *
 * The new net namespace holds only a down loopback: the guest has no NIC, QEMU needs no network.
 * QEMU is pid 1 of its pid namespace: when it ends, the namespace and every mount of the jail go.
 */
import { existsSync } from "node:fs";
import { SandboxdError } from "../../contracts/errors.ts";
import { QEMU_OOM_SCORE_ADJ } from "./oom.ts";
import { JAIL_KSM_SETTING, JAIL_LD_PRELOAD, JAIL_READONLY_RAM_LIST } from "./ram-shim.ts";

export const UNSHARE = "/usr/bin/unshare";
export const SETPRIV = "/usr/bin/setpriv";
export const PIVOT_ROOT = "/usr/sbin/pivot_root";
export const MOUNT = "/usr/bin/mount";
export const UMOUNT = "/usr/bin/umount";
export const SH = "/bin/sh";

/**
 * The whole environment of a jail and of the QEMU it execs (setpriv and the shell pass it on):
 * nothing of the agent's. The agent's own environment holds its secrets (the connect secret, the
 * key pepper, the database URL), and a process's environment sits in its memory, where a guest
 * that escaped into QEMU would read it. Every program the jail runs is named by its absolute path;
 * PATH is only for what util-linux's `mount` looks up by name (its `mount.<type>` helpers).
 */
export const JAIL_ENV: Readonly<Record<string, string>> = { PATH: "/usr/sbin:/usr/bin:/sbin:/bin" };

/**
 * QEMU's seccomp policy: deny obsolete syscalls, privilege changes, spawning processes (no
 * migration uses `exec:`: state streams through unix sockets the agent reads and writes) and
 * resource control (affinity, scheduler, rlimits).
 */
export function sandboxOption(): string {
  return "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny";
}

/** A jail's failure to be built: the VM does not start (never an unjailed QEMU). */
export class JailError extends SandboxdError {
  constructor(message: string, cause?: unknown) {
    super("vm_launch_failed", `cannot build the VM's jail: ${message}`, cause === undefined ? {} : { cause });
    this.name = "JailError";
  }
}

export interface JailSpec {
  /** The VM's directory: bound writable; the jail's root is a tmpfs mounted on `<dir>/root`. */
  dir: string;
  uid: number;
  gid: number;
  /** Files bound read-only at their own path (kernel, initramfs, backing files). */
  readOnly: readonly string[];
  /** Files bound writable at their own path (the VM's overlay, its RAM file). */
  readWrite: readonly string[];
  /** Under KVM the jail's own /dev/kvm node (JAIL_KVM_NODE) is mounted too. */
  kvm: boolean;
  /**
   * A RAM file others start from, bound read-only (it is in `readOnly`), and the library that lets
   * QEMU 7.2 open it read-only (ram-readonly.c), bound read-only but executable (the loader maps
   * it): the jail's root gets an /etc/ld.so.preload naming the library and the list naming the
   * file (ram-shim.ts).
   */
  readOnlyRam?: {
    path: string;
    shim: string;
    /**
     * SANDBOXD_KSM=qemu: the guest's RAM in bytes, written to the jail's JAIL_KSM_SETTING; the
     * shim then offers QEMU's own memory to KSM and keeps every mapping this large out of it.
     */
    ksmGuardBytes?: number;
  };
  /** `cgroup.procs` files the jail joins before it starts QEMU. */
  cgroupProcs: readonly string[];
  /** RLIMIT_FSIZE in bytes: the largest file QEMU may write (its overlay, RAM file, console). */
  maxFileBytes: number;
  /** RLIMIT_NOFILE. */
  maxOpenFiles: number;
  /** The pid file the script writes QEMU's host pid to (inside `dir`). */
  pidFile: string;
  /** `unshare` to run (an option so a missing one can be tested). */
  unshare?: string;
}

/** The root of the jail inside the VM directory (a mount point only inside the jail). */
export function jailRoot(dir: string): string {
  return `${dir.replace(/\/+$/, "")}/root`;
}

/** POSIX shell single-quoting. */
export function shq(s: string): string {
  return `'${s.replaceAll("'", `'\\''`)}'`;
}

function checkPath(p: string): void {
  if (!p.startsWith("/") || p.includes("\0") || p.split("/").includes(".."))
    throw new JailError(`not an absolute, normalised path: ${JSON.stringify(p)}`);
}

const DEVICES = ["null", "zero", "random", "urandom"] as const;

/** Where a KVM jail's own /dev/kvm node lives, relative to the jail's root. */
export const JAIL_KVM_NODE = "/dev/kvm";

/** coreutils' mknod: the agent makes a KVM jail's device node with it (Node has no mknod). */
export const MKNOD = "/usr/bin/mknod";

/** An fstab field: space, tab, newline and backslash as fstab's octal escapes. */
function fstabField(p: string): string {
  return p.replace(/[\\ \t\n]/g, (c) => `\\${c.charCodeAt(0).toString(8).padStart(3, "0")}`);
}

/** Where the fstab of the jail's mounts is written (by the agent, before the jail starts). */
export function jailFstabPath(dir: string): string {
  return `${dir.replace(/\/+$/, "")}/jail.fstab`;
}

/**
 * The jail's root, made on disk by the agent before QEMU starts (no process start per entry):
 * the directories and empty files its mounts go on, relative to the root, and the merged-usr
 * symlinks (/bin, /lib, /lib64, /sbin into /usr).
 */
export function jailSkeleton(spec: JailSpec): {
  dirs: string[];
  files: string[];
  links: [string, string][];
  contents: [string, string][];
} {
  const dirOf = (p: string) => p.slice(0, p.lastIndexOf("/")) || "/";
  // A KVM jail's /dev/kvm is no mount point but a node of its own, made by jail-setup.ts.
  const shim = spec.readOnlyRam ? [spec.readOnlyRam.shim] : [];
  const files = [...DEVICES.map((d) => `/dev/${d}`), ...spec.readOnly, ...shim, ...spec.readWrite];
  // Files with content, on the root that is then bound read-only: QEMU reads, never writes them.
  const contents: [string, string][] = spec.readOnlyRam
    ? [
        [JAIL_LD_PRELOAD, `${spec.readOnlyRam.shim}\n`],
        [JAIL_READONLY_RAM_LIST, `${spec.readOnlyRam.path}\n`],
        ...(spec.readOnlyRam.ksmGuardBytes !== undefined
          ? [[JAIL_KSM_SETTING, `${spec.readOnlyRam.ksmGuardBytes}\n`] as [string, string]]
          : []),
      ]
    : [];
  const dirs = [
    ...new Set([
      "/usr",
      "/proc",
      "/tmp",
      "/.old",
      spec.dir,
      ...[...files, ...contents.map(([f]) => f)].map(dirOf),
    ]),
  ];
  const links: [string, string][] = ["bin", "lib", "lib64", "sbin"].map((l) => [`/${l}`, `usr/${l}`]);
  return { dirs, files, links, contents };
}

/**
 * The jail's mounts, in order, as fstab lines for one `mount -a` (each util-linux `mount` is a
 * process start, and the jail is built on every spawn's critical path): the root bound onto itself
 * read-only (pivot_root needs a mount point), then /usr, the devices, /proc and the VM's files.
 */
export function jailFstab(spec: JailSpec): string[] {
  const r = jailRoot(spec.dir);
  const line = (src: string, dst: string, type: string, opts: string) =>
    `${fstabField(src)} ${fstabField(r + dst)} ${type} ${opts} 0 0`;
  const out = [`${fstabField(r)} ${fstabField(r)} none bind,ro,nosuid,nodev 0 0`];
  out.push(line("/usr", "/usr", "none", "bind,ro,nodev"));
  for (const d of DEVICES) out.push(line(`/dev/${d}`, `/dev/${d}`, "none", "bind,nosuid,noexec"));
  // The jail's own kvm node, bound onto itself: the root's mount is nodev, and a bind mount of the
  // node alone is the one place in the jail where a device opens (`dev` said outright, as the
  // bind would otherwise keep the root's nodev).
  if (spec.kvm) out.push(line(r + JAIL_KVM_NODE, JAIL_KVM_NODE, "none", "bind,rw,dev,nosuid,noexec"));
  out.push(line("proc", "/proc", "proc", "nosuid,nodev,noexec"));
  for (const p of spec.readOnly) out.push(line(p, p, "none", "bind,ro,nosuid,nodev,noexec"));
  // The one library of the jail outside /usr: on a noexec mount the loader could not map it.
  if (spec.readOnlyRam)
    out.push(line(spec.readOnlyRam.shim, spec.readOnlyRam.shim, "none", "bind,ro,nosuid,nodev"));
  for (const p of spec.readWrite) out.push(line(p, p, "none", "bind,nosuid,nodev,noexec"));
  out.push(line(spec.dir, spec.dir, "none", "bind,nosuid,nodev,noexec"));
  return out;
}

/** The script `sh -c` runs inside the new namespaces (see the header). */
export function jailScript(spec: JailSpec, qemuArgv: readonly string[]): string {
  const r = jailRoot(spec.dir);
  for (const p of [spec.dir, ...spec.readOnly, ...spec.readWrite, spec.pidFile, ...spec.cgroupProcs])
    checkPath(p);
  if (spec.readOnlyRam) for (const p of [spec.readOnlyRam.path, spec.readOnlyRam.shim]) checkPath(p);
  const L: string[] = ["set -eu"];
  // 1. QEMU's host pid: /proc is still the host's, so /proc/self/stat names this shell by its
  // host pid, and the shell becomes QEMU by exec.
  L.push("read -r hostpid rest < /proc/self/stat", `echo "$hostpid" > ${shq(spec.pidFile)}`);
  // Raising oom_score_adj needs no privilege; the agent's own (-900) is what it inherited.
  L.push(`echo ${QEMU_OOM_SCORE_ADJ} > /proc/self/oom_score_adj`);
  // 2. cgroups: writing 0 moves the writer itself.
  for (const procs of spec.cgroupProcs) L.push(`echo 0 > ${shq(procs)}`);
  // 3. every mount of the jail (jailFstab) at once, on the skeleton the agent made.
  L.push(`${MOUNT} -a -T ${shq(jailFstabPath(spec.dir))}`);
  // 4. pivot: the old root is detached; nothing of the host is reachable any more.
  L.push(`cd ${shq(r)}`, `${PIVOT_ROOT} . .old`, `${UMOUNT} -l /.old`, "cd /");
  // 5. rlimits (dash counts -f in 512-byte blocks), then drop every privilege and exec QEMU.
  L.push(`ulimit -f ${Math.ceil(spec.maxFileBytes / 512)}`, `ulimit -n ${spec.maxOpenFiles}`);
  // `cd` exported PWD and OLDPWD (the VM directory's host path): QEMU gets JAIL_ENV alone.
  L.push("unset PWD OLDPWD");
  L.push(
    [
      "exec",
      SETPRIV,
      `--reuid=${spec.uid}`,
      `--regid=${spec.gid}`,
      "--clear-groups",
      "--no-new-privs",
      "--inh-caps=-all",
      "--ambient-caps=-all",
      "--bounding-set=-all",
      "--pdeathsig=KILL",
      "--",
      ...qemuArgv.map(shq),
    ].join(" "),
  );
  // The jail runs in a child of the namespace's pid 1 (this shell), which waits for it and exits
  // with its status: unshare (util-linux 2.38) turns a child killed by a signal into a plain exit
  // 1, while the shell's `wait` reports 128 + the signal, which launch.ts reads back.
  return ["(", ...L.map((l) => `  ${l}`), ") &", 'wait "$!"', 'exit "$?"'].join("\n");
}

/**
 * The argv that starts QEMU (`qemuArgv`, program first) jailed. `unshare --kill-child` ties the
 * jail's pid 1 (QEMU) to unshare, and setpriv's parent-death signal keeps that tie after the
 * uid change (a credential change clears the one unshare set).
 */
export function jailArgv(spec: JailSpec, qemuArgv: readonly string[]): string[] {
  return [
    spec.unshare ?? UNSHARE,
    ...UNSHARE_FLAGS,
    "--kill-child=KILL",
    "--",
    SH,
    "-c",
    jailScript(spec, qemuArgv),
  ];
}

/** The namespaces of a jail: everything but user and cgroup, mounts private to it. */
export const UNSHARE_FLAGS = [
  "--mount",
  "--pid",
  "--ipc",
  "--uts",
  "--net",
  "--fork",
  "--propagation",
  "private",
] as const;

/** The util-linux tools a jail needs, each with what is missing when it is not there. */
export function missingJailTools(unshare = UNSHARE): string[] {
  return [unshare, SETPRIV, PIVOT_ROOT, MOUNT, UMOUNT, SH].filter((t) => !existsSync(t));
}
