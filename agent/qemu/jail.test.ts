import { afterAll, describe, expect, test } from "bun:test";
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { machineArgs } from "./args.ts";
import {
  cgroupName,
  createVmCgroup,
  limitFiles,
  limitVmMemory,
  ownV1Path,
  TCG_TB_MIB,
  vmLimits,
  vmMemoryBytes,
  vmOverheadBytes,
} from "./cgroup.ts";
import {
  JailError,
  type JailSpec,
  jailArgv,
  jailFstab,
  jailScript,
  jailSkeleton,
  sandboxOption,
  shq,
} from "./jail.ts";
import { QEMU_OOM_SCORE_ADJ } from "./oom.ts";
import { allocateUid } from "./uids.ts";

const scratch = mkdtempSync(join(tmpdir(), "jail-test-"));
afterAll(() => rmSync(scratch, { recursive: true, force: true }));

const spec: JailSpec = {
  dir: "/data/vms/vm-1",
  uid: 900_123,
  gid: 900_123,
  readOnly: ["/data/guest/vmlinux", "/data/images/it's base.qcow2"],
  readWrite: ["/data/storage/disks/vm-1-0.qcow2", "/dev/shm/sbx/tpl-a.mem"],
  kvm: false,
  cgroupProcs: ["/sys/fs/cgroup/pids/sandboxd/vm-1-abc/cgroup.procs"],
  maxFileBytes: 512 * 1024 * 1024,
  maxOpenFiles: 1024,
  pidFile: "/data/vms/vm-1/qemu.hostpid",
};

describe("jail argv", () => {
  test("unshare makes every namespace, the script drops every privilege and execs QEMU", () => {
    const argv = jailArgv(spec, ["/usr/bin/qemu-system-x86_64", "-name", "x y"]);
    expect(argv[0]).toBe("/usr/bin/unshare");
    for (const ns of ["--mount", "--pid", "--ipc", "--uts", "--net"]) expect(argv).toContain(ns);
    expect(argv.join(" ")).toContain("--fork --propagation private --kill-child=KILL -- /bin/sh -c");
    const script = argv.at(-1) ?? "";
    // QEMU (the subshell that execs it) is the OOM killer's preferred victim, before the mounts.
    expect(script).toContain(`echo ${QEMU_OOM_SCORE_ADJ} > /proc/self/oom_score_adj`);
    expect(script).toContain("echo 0 > '/sys/fs/cgroup/pids/sandboxd/vm-1-abc/cgroup.procs'");
    expect(script).toContain("/usr/bin/mount -a -T '/data/vms/vm-1/jail.fstab'");
    expect(script).toContain("/usr/sbin/pivot_root . .old");
    expect(script).toContain("/usr/bin/umount -l /.old");
    expect(script).toContain("ulimit -f 1048576");
    expect(script).toContain("ulimit -n 1024");
    const exec = script.split("\n").find((l) => l.includes("exec /usr/bin/setpriv")) ?? "";
    // pid 1 waits for the jailed QEMU and exits with its status (128 + a signal that killed it).
    expect(script).toEndWith(') &\nwait "$!"\nexit "$?"');
    for (const flag of [
      "--reuid=900123",
      "--regid=900123",
      "--clear-groups",
      "--no-new-privs",
      "--inh-caps=-all",
      "--bounding-set=-all",
    ])
      expect(exec).toContain(flag);
    expect(exec).toEndWith("-- '/usr/bin/qemu-system-x86_64' '-name' 'x y'");
    // The pid is written before the host's /proc is replaced.
    expect(script.indexOf("/proc/self/stat")).toBeLessThan(script.indexOf("/usr/sbin/pivot_root"));
  });

  test("fstab binds backing files read-only, the VM's own files writable, /dev/kvm only under KVM", () => {
    const fstab = jailFstab(spec);
    // The root is bound onto itself read-only first (pivot_root needs a mount point).
    expect(fstab[0]).toBe("/data/vms/vm-1/root /data/vms/vm-1/root none bind,ro,nosuid,nodev 0 0");
    expect(fstab[1]).toBe("/usr /data/vms/vm-1/root/usr none bind,ro,nodev 0 0");
    expect(fstab).toContain(
      "/data/images/it's\\040base.qcow2 /data/vms/vm-1/root/data/images/it's\\040base.qcow2 none bind,ro,nosuid,nodev,noexec 0 0",
    );
    expect(fstab).toContain(
      "/data/storage/disks/vm-1-0.qcow2 /data/vms/vm-1/root/data/storage/disks/vm-1-0.qcow2 none bind,nosuid,nodev,noexec 0 0",
    );
    expect(fstab.some((l) => l.includes("/dev/kvm"))).toBe(false);
    // Under KVM: the jail's own node bound onto itself, devices allowed there only; the host's
    // /dev/kvm is never bound, nor a mount point in the skeleton.
    const kvm = jailFstab({ ...spec, kvm: true }).filter((l) => l.includes("/dev/kvm"));
    expect(kvm).toEqual([
      "/data/vms/vm-1/root/dev/kvm /data/vms/vm-1/root/dev/kvm none bind,rw,dev,nosuid,noexec 0 0",
    ]);
    expect(jailSkeleton({ ...spec, kvm: true }).files).not.toContain("/dev/kvm");
  });

  test("a child of a shared RAM file: the file bound read-only, the shim executable, both named in the read-only root", () => {
    const ram = "/dev/shm/sbx/tpl-a.mem";
    const shim = "/opt/sandboxd/build/host/ram-readonly-0123.so";
    const child: JailSpec = {
      ...spec,
      readOnly: [...spec.readOnly, ram],
      readWrite: ["/data/storage/disks/vm-1-0.qcow2"],
      readOnlyRam: { path: ram, shim },
    };
    const fstab = jailFstab(child);
    expect(fstab).toContain(`${ram} /data/vms/vm-1/root${ram} none bind,ro,nosuid,nodev,noexec 0 0`);
    // The loader maps the library executable: its bind alone allows exec, and it is read-only.
    expect(fstab).toContain(`${shim} /data/vms/vm-1/root${shim} none bind,ro,nosuid,nodev 0 0`);
    expect(fstab.filter((l) => l.includes(ram) && !l.includes(",ro,"))).toEqual([]);
    const sk = jailSkeleton(child);
    expect(sk.files).toContain(shim);
    expect(sk.contents).toEqual([
      ["/etc/ld.so.preload", `${shim}\n`],
      ["/etc/sandboxd/readonly-ram", `${ram}\n`],
    ]);
    expect(sk.dirs).toEqual(expect.arrayContaining(["/etc", "/etc/sandboxd"]));
    // SANDBOXD_KSM=qemu: the guest's RAM size for the shim, beside the list.
    const ksm = jailSkeleton({
      ...child,
      readOnlyRam: { path: ram, shim, ksmGuardBytes: 128 * 1024 * 1024 },
    });
    expect(ksm.contents).toContainEqual(["/etc/sandboxd/ksm", "134217728\n"]);
    // Without a shared RAM file nothing is preloaded.
    expect(jailSkeleton(spec).contents).toEqual([]);
    expect(() => jailScript({ ...child, readOnlyRam: { path: ram, shim: "lib.so" } }, ["q"])).toThrow(
      JailError,
    );
  });

  test("quoting and path checks", () => {
    expect(shq("it's")).toBe("'it'\\''s'");
    expect(() => jailScript({ ...spec, readOnly: ["relative/path"] }, ["q"])).toThrow(JailError);
    expect(() => jailScript({ ...spec, readOnly: ["/a/../etc/shadow"] }, ["q"])).toThrow(JailError);
    expect(sandboxOption()).toBe("on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny");
  });
});

describe("cgroups", () => {
  test("limits: guest RAM plus QEMU's overhead, QEMU's threads plus margin, vCPUs plus a core of CPU", () => {
    const l = vmLimits(256, 2, false);
    expect(l.memoryBytes).toBeGreaterThan(256 * 1024 * 1024);
    // Under TCG the translated-code buffer (`tb-size`, as args.ts passes it) is QEMU's memory too.
    expect(vmLimits(256, 2, true).memoryBytes - l.memoryBytes).toBe(TCG_TB_MIB * 1024 * 1024);
    expect(machineArgs("tcg", 256)).toContain(`tcg,tb-size=${TCG_TB_MIB}`);
    // The cgroup is exactly what admission counts for the VM.
    expect(vmLimits(256, 2, true).memoryBytes).toBe(vmMemoryBytes(256, true));
    expect(vmMemoryBytes(256, true)).toBe(256 * 1024 * 1024 + vmOverheadBytes(true));
    expect(l.pids).toBeGreaterThan(64);
    expect(limitFiles(1, l)).toContainEqual({ controller: "cpu", file: "cpu.cfs_quota_us", value: "300000" });
    expect(limitFiles(1, l)).toContainEqual({ controller: "pids", file: "pids.max", value: String(l.pids) });
    expect(limitFiles(2, l)).toContainEqual({ controller: "", file: "cpu.max", value: "300000 100000" });
    expect(limitFiles(2, l)).toContainEqual({
      controller: "",
      file: "memory.max",
      value: String(l.memoryBytes),
    });
  });

  test("v1 paths nest under the agent's own cgroup; names are stable and safe", () => {
    const self = "9:name=systemd:/\n4:memory:/process_api/abc\n2:cpu,cpuacct:/x\n1:pids:/\n0::/";
    expect(ownV1Path("memory", self)).toBe("/process_api/abc");
    expect(ownV1Path("cpu", self)).toBe("/x");
    expect(ownV1Path("pids", self)).toBe("/");
    expect(cgroupName("/d/vms/vm-1")).toBe(cgroupName("/d/vms/vm-1"));
    expect(cgroupName("/d/vms/vm-1")).not.toBe(cgroupName("/e/vms/vm-1"));
    expect(cgroupName("/d/vms/a b")).toMatch(/^a_b-[0-9a-f]{12}$/);
  });

  test("v2: enables the controllers in the sandboxd parent and writes the VM's limits", async () => {
    const root = mkdtempSync(join(scratch, "cgroup-v2-"));
    writeFileSync(join(root, "cgroup.controllers"), "cpuset cpu io memory pids\n");
    mkdirSync(join(root, "sandboxd"));
    writeFileSync(join(root, "sandboxd", "cgroup.subtree_control"), "");
    const cg = await createVmCgroup("/d/vms/vm-1", vmLimits(256, 1, true), root);
    expect(cg.version).toBe(2);
    expect(readFileSync(join(root, "sandboxd", "cgroup.subtree_control"), "utf8")).toBe("+memory +pids +cpu");
    const d = cg.dirs[0] ?? "";
    expect(readFileSync(join(d, "memory.max"), "utf8")).toBe(String(vmLimits(256, 1, true).memoryBytes));
    expect(readFileSync(join(d, "pids.max"), "utf8")).toBe(String(vmLimits(256, 1, true).pids));
    expect(readFileSync(join(d, "cpu.max"), "utf8")).toBe("200000 100000");
  });

  test("v2: the sandboxd parent carries the VMs' memory budget; lifted, it is max", async () => {
    const root = mkdtempSync(join(scratch, "cgroup-v2-"));
    writeFileSync(join(root, "cgroup.controllers"), "cpuset cpu io memory pids\n");
    const parent = await limitVmMemory(3 * 1024 * 1024 * 1024, root);
    expect(parent).toBe(join(root, "sandboxd"));
    expect(readFileSync(join(parent, "memory.max"), "utf8")).toBe(String(3 * 1024 * 1024 * 1024));
    await limitVmMemory(undefined, root);
    expect(readFileSync(join(parent, "memory.max"), "utf8")).toBe("max");
  });

  test("a host with neither layout is a JailError naming what is missing", async () => {
    const root = mkdtempSync(join(scratch, "cgroup-none-"));
    const err = await createVmCgroup("/d/vms/vm-1", vmLimits(256, 1, true), root).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(JailError);
    expect((err as JailError).code).toBe("vm_launch_failed");
    expect((err as JailError).message).toContain("no cgroup v2 or v1");
  });
});

test("an empty uid range is a JailError", async () => {
  const err = await allocateUid("/d/vms/vm-1", { base: 900_000, count: 0 }).catch((e: unknown) => e);
  expect(err).toBeInstanceOf(JailError);
  expect((err as JailError).message).toContain("uid range is empty");
});
