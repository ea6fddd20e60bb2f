/**
 * SnapshotDriver without VMs: typed errors for what it cannot do, template id mapping, and the
 * restart reaper (stray VM dirs, files the chain store does not know, interrupted builds).
 * The real-VM paths are in tests/agent-snapshot-*.test.ts.
 */
import { afterEach, describe, expect, test } from "bun:test";
import { existsSync } from "node:fs";
import { mkdir, mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { codeOf } from "../../../tests/support/real-vm.ts";
import { openChainStore } from "../../storage/chain.ts";
import { engineTemplateId, SnapshotDriver } from "./snapshot.ts";

const dirs: string[] = [];
afterEach(async () => {
  for (const d of dirs.splice(0)) await rm(d, { recursive: true, force: true });
});

async function driver() {
  const stateDir = await mkdtemp(join(tmpdir(), "sbx-snapdrv-"));
  const shmRoot = join(stateDir, "shm"); // not tmpfs: only names matter here
  dirs.push(stateDir);
  const d = await SnapshotDriver.create({
    cacheDir: stateDir,
    stateDir,
    shmRoot,
    accel: "tcg",
    artifacts: {
      vmlinux: "/nonexistent/vmlinux",
      initramfs: "/nonexistent/initrd",
      kernelVersion: "x",
      key: "k",
    },
  });
  return { d, stateDir, shmRoot };
}

const SIZE = { vcpus: 1, memMib: 256 };

describe("SnapshotDriver (no VMs)", () => {
  test("a malformed OCI reference is refused before skopeo; unknown templates and VMs are typed errors", async () => {
    const { d } = await driver();
    expect(d.name).toBe("snapshot (tcg)");
    const phases: string[] = [];
    const oci = d.prepareTemplate(
      "py",
      { kind: "oci", image: "--src-creds=a:b" },
      new AbortController().signal,
      (p) => phases.push(p),
    );
    expect(await codeOf(oci)).toBe("bad_request");
    expect(phases).toEqual(["Converting"]);
    expect(await codeOf(d.spawn("nope", "vm-0000000000000001", SIZE))).toBe("not_found");
    expect(await codeOf(d.resume("vm-0000000000000001", "nope", SIZE))).toBe("gone");
    expect(await codeOf(d.restoreTemplate("nope", { image: {} as never, exposedPorts: [] }))).toBe(
      "template_not_found",
    );
    expect(await codeOf(d.destroy("vm-0000000000000001", undefined))).toBe("ok"); // idempotent
    expect(await d.diskBytes("vm-0000000000000001")).toBe(0);
  });

  test("template ids the engine cannot take are mapped to a stable hash", () => {
    expect(engineTemplateId("busybox")).toBe("busybox");
    const odd = engineTemplateId("Team/Python_3.12");
    expect(odd).toMatch(/^t-[0-9a-f]{16}$/);
    expect(engineTemplateId("Team/Python_3.12")).toBe(odd);
    expect(engineTemplateId("x".repeat(60))).toMatch(/^t-/);
  });

  test("reap: unclaimed VM dirs, unregistered snapshot files and interrupted builds go; the rest stays", async () => {
    const { d, stateDir, shmRoot } = await driver();
    const vms = join(stateDir, "vms");
    const disks = join(stateDir, "storage", "disks");
    const suspended = join(stateDir, "storage", "suspended");
    for (const p of [join(vms, "vm-keep"), join(vms, "vm-stray"), disks, suspended, shmRoot])
      await mkdir(p, { recursive: true });
    await writeFile(join(vms, "vm-stray", "owner.json"), JSON.stringify({ ownerPid: 999_999_999 }));
    // Registered (held by the kept VM) vs. debris of a crash between create and register.
    const keptDisk = join(disks, "vm-keep-0.qcow2");
    const keptState = join(suspended, "vm-keep.state");
    const debris = [
      join(disks, "vm-gone-0.qcow2"),
      join(shmRoot, "vm-x-fabc.state"),
      join(shmRoot, "vm-x-fabc.mem"),
    ];
    for (const f of [keptDisk, keptState, ...debris]) await writeFile(f, "x");
    const chain = await openChainStore(stateDir);
    await chain.add(keptDisk, { kind: "overlay", holder: "vm:vm-keep" });
    await chain.add(keptState, { kind: "state", holder: "vm:vm-keep" });
    // A build the dead agent never finished.
    const tpl = join(stateDir, "templates", "half");
    await mkdir(tpl, { recursive: true });
    await writeFile(join(tpl, "disk.qcow2"), "x");
    await writeFile(join(shmRoot, "tpl-half.mem"), "x");
    await writeFile(
      join(tpl, "meta.json"),
      JSON.stringify({
        id: "half",
        state: "building",
        memPath: join(shmRoot, "tpl-half.mem"),
        disk: join(tpl, "disk.qcow2"),
      }),
    );

    expect(await d.reap(new Set(["vm-keep"]))).toEqual(["vm-stray"]);
    expect(existsSync(join(vms, "vm-keep"))).toBe(true);
    expect(existsSync(join(vms, "vm-stray"))).toBe(false);
    expect(existsSync(keptDisk)).toBe(true);
    expect(existsSync(keptState)).toBe(true);
    for (const f of debris) expect(existsSync(f)).toBe(false);
    expect(existsSync(tpl)).toBe(false);
    expect(existsSync(join(shmRoot, "tpl-half.mem"))).toBe(false);
  });
});
