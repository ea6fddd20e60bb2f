import { afterAll, describe, expect, test } from "bun:test";
import { mkdtempSync, readdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { GuestArtifacts } from "../guest/artifacts.ts";
import { buildQemuArgs, kernelCmdline, launchVm, VmLaunchError } from "./launch.ts";

const dir = mkdtempSync(join(tmpdir(), "launch-test-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const fakeArtifacts: GuestArtifacts = {
  vmlinux: join(dir, "no-vmlinux"),
  initramfs: join(dir, "no-initrd"),
  kernelVersion: "x",
  key: "k",
};

function optionValues(args: string[], flag: string): string[] {
  return args.flatMap((a, i) => (a === flag ? [args[i + 1] ?? ""] : []));
}

describe("buildQemuArgs", () => {
  test("TCG: legacy timers, TSC cmdline, fixed device ids, memory backend, incoming", () => {
    const args = buildQemuArgs({
      dir: "/vms/a",
      artifacts: fakeArtifacts,
      disk: "/vms/a/disk.qcow2",
      memMib: 256,
      vcpus: 1,
      accel: "tcg",
      hostname: "box-1",
      memBackend: { path: "/dev/shm/t1", share: false },
      incoming: true,
    });
    expect(optionValues(args, "-M")).toEqual([
      "microvm,pit=on,pic=on,rtc=on,acpi=on,mem-merge=off,memory-backend=mem",
    ]);
    expect(optionValues(args, "-object")).toContain(
      "memory-backend-file,id=mem,size=256M,mem-path=/dev/shm/t1,share=off",
    );
    expect(optionValues(args, "-append")[0]).toContain("tsc=reliable clocksource=tsc");
    expect(optionValues(args, "-append")[0]).toContain("sandboxd.hostname=box-1");
    // Device order is part of the snapshot format: serial, port, disk, rng.
    expect(optionValues(args, "-device")).toEqual([
      "virtio-serial-device,id=vser0",
      "virtserialport,chardev=agent0,name=agent,id=agentport",
      "virtio-blk-device,drive=disk0,id=vda",
      "virtio-rng-device,rng=rng0,id=rng",
    ]);
    expect(optionValues(args, "-incoming")).toEqual(["defer"]);
    expect(args).not.toContain("-S");
    expect(optionValues(args, "-pidfile")).toEqual(["/vms/a/qemu.pid"]);
  });

  test("KVM: host CPU, no PIT/PIC, no TSC workaround", () => {
    const args = buildQemuArgs({
      dir: "/vms/b",
      artifacts: fakeArtifacts,
      memMib: 512,
      vcpus: 2,
      accel: "kvm",
      paused: true,
    });
    expect(optionValues(args, "-M")).toEqual(["microvm,pit=off,pic=off,rtc=on,acpi=on,mem-merge=off"]);
    expect(optionValues(args, "-cpu")).toEqual(["host"]);
    expect(optionValues(args, "-append")[0]).not.toContain("tsc=");
    expect(args).toContain("-S");
  });

  test("rejects hostnames the guest could not set", () => {
    expect(() => kernelCmdline("tcg", "Bad_Name")).toThrow();
    expect(() => kernelCmdline("tcg", "a b")).toThrow();
    expect(kernelCmdline("tcg", "ok-1")).toContain("sandboxd.hostname=ok-1");
  });
});

describe("launchVm failures", () => {
  test("QEMU dying at start is a VmLaunchError with its stderr, and leaves no sockets", async () => {
    const vmDir = mkdtempSync(join(dir, "vm-"));
    const err = await launchVm({
      dir: vmDir,
      artifacts: fakeArtifacts,
      memMib: 64,
      vcpus: 1,
      accel: "tcg",
    }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(VmLaunchError);
    const e = err as VmLaunchError;
    expect(e.code).toBe("vm_launch_failed");
    expect(e.message).toContain("qemu exited during start");
    expect(e.message).toContain("no-vmlinux"); // QEMU's own "could not load kernel" line
    expect(readdirSync(vmDir).filter((f) => f.endsWith(".sock") || f.endsWith(".pid"))).toEqual([]);
  });
});

test("a jail's exit 128 + N reads back as QEMU killed by signal N", async () => {
  const { jailExit } = await import("./launch.ts");
  expect(jailExit(137, null)).toEqual({ code: null, signal: "SIGKILL" });
  expect(jailExit(1, null)).toEqual({ code: 1, signal: null });
  expect(jailExit(null, "SIGTERM")).toEqual({ code: null, signal: "SIGTERM" });
});
