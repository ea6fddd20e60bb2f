import { afterAll, describe, expect, test } from "bun:test";
import {
  mkdirSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  rmSync,
  symlinkSync,
  writeFileSync,
} from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import type { ImageConfig } from "../image/import.ts";
import { openChainStore } from "../storage/chain.ts";
import { vmRecordsDir } from "../vm/records-dir.ts";
import {
  checkVmRecord,
  readVmRecord,
  restoreVm,
  saveVm,
  VM_RECORD_FILE,
  type VmRecord,
  writeVmRecord,
} from "./persist.ts";
import { SandboxVm, type VmShape } from "./vm.ts";

const root = mkdtempSync(join(tmpdir(), "persist-test-"));
afterAll(() => rmSync(root, { recursive: true, force: true }));

const shape: VmShape = {
  dataDir: root,
  shmRoot: join(root, "shm"),
  artifacts: { vmlinux: "/k/vmlinux", initramfs: "/k/initrd", kernelVersion: "6.1", key: "abc" },
  accel: "tcg",
  memMib: 256,
  vcpus: 1,
  baseDisk: "/images/x/rootfs.qcow2",
  diskBytes: 1 << 30,
  dieWithParent: false,
};
const image: ImageConfig = {
  env: ["PATH=/bin"],
  workingDir: "/",
  entrypoint: [],
  cmd: ["sh"],
  user: { uid: 0, gid: 0, name: "root" },
  digest: "sha256:00",
  exposedPorts: [8080],
};
const notes = { templateId: "tpl", size: { vcpus: 1, memMib: 256 }, image };

let n = 0;
function vmDir(): string {
  const dir = join(root, "vms", `vm-${n++}`);
  mkdirSync(dir, { recursive: true });
  mkdirSync(vmRecordsDir(dir), { recursive: true });
  return dir;
}

/** Where the agent keeps the record of the VM in `dir`. */
const rec = (dir: string) => join(vmRecordsDir(dir), VM_RECORD_FILE);

async function invalidMessage(dir: string): Promise<string> {
  const r = await readVmRecord(dir);
  if (r.ok) throw new Error("expected vm_record_invalid");
  expect(r.error.code).toBe("vm_record_invalid");
  return r.error.message;
}

describe("save / restore", () => {
  test("a running VM round-trips through its record on disk", async () => {
    const dir = vmDir();
    const vm = new SandboxVm("vm-0123", dir, shape, "/s/vm-0123-2.qcow2", "/shm/tpl.mem");
    vm.topNode = "fork-3";
    vm.generation = 2;
    const saved = saveVm(vm, notes);
    await writeVmRecord(dir, saved);
    expect(readdirSync(vmRecordsDir(dir))).toEqual([VM_RECORD_FILE]); // no temp file left behind
    const r = await readVmRecord(dir);
    if (!r.ok) throw r.error;
    expect(r.value).toEqual(saved);
    const back = restoreVm(r.value as VmRecord, dir);
    expect(back.id).toBe("vm-0123");
    expect(back.dir).toBe(dir);
    expect(back.shape).toEqual(shape);
    expect(back.disk).toBe(vm.disk);
    expect(back.memPath).toBe(vm.memPath);
    expect(back.topNode).toBe("fork-3");
    expect(back.generation).toBe(2);
    expect(back.suspendState).toBeUndefined();
    expect(back.process).toBeUndefined();
    expect(back.state).toBe("starting");
  });

  test("a suspended VM keeps its state file and size", async () => {
    const dir = vmDir();
    const vm = new SandboxVm("vm-susp", dir, shape, "/s/d.qcow2", "/shm/m.mem");
    vm.suspendState = "/s/suspended/vm-susp.state";
    await writeVmRecord(dir, saveVm(vm, { ...notes, memBytes: 12345 }));
    const r = await readVmRecord(dir);
    if (!r.ok) throw r.error;
    expect(r.value?.suspendState).toBe(vm.suspendState);
    expect(r.value?.memBytes).toBe(12345);
    expect(restoreVm(r.value as VmRecord, dir).suspendState).toBe(vm.suspendState);
  });

  test("no record is not an error", async () => {
    expect(await readVmRecord(vmDir())).toEqual({ ok: true, value: undefined });
  });
});

describe("what is read back is checked", () => {
  test("a torn file is vm_record_invalid, not a crash", async () => {
    const dir = vmDir();
    const vm = new SandboxVm("vm-torn", dir, shape, "/s/d.qcow2", "/shm/m.mem");
    await writeVmRecord(dir, saveVm(vm, notes));
    const full = readFileSync(rec(dir), "utf8");
    writeFileSync(rec(dir), full.slice(0, full.length / 2));
    expect(await invalidMessage(dir)).toContain("is not JSON");
  });

  test("an unknown version is refused by name", async () => {
    const dir = vmDir();
    const vm = new SandboxVm("vm-v2", dir, shape, "/s/d.qcow2", "/shm/m.mem");
    writeFileSync(rec(dir), JSON.stringify({ ...saveVm(vm, notes), version: 2 }));
    expect(await invalidMessage(dir)).toContain("has version 2; this agent reads version 1");
    writeFileSync(rec(dir), "[1,2]");
    expect(await invalidMessage(dir)).toContain("has version undefined");
  });

  test("a foreign or damaged record names the bad field", async () => {
    const dir = vmDir();
    const vm = new SandboxVm("vm-bad", dir, shape, "/s/d.qcow2", "/shm/m.mem");
    const good = saveVm(vm, notes);
    writeFileSync(
      rec(dir),
      JSON.stringify({ ...good, shape: { ...good.shape, accel: "hvf", memMib: "256" } }),
    );
    const msg = await invalidMessage(dir);
    expect(msg).toContain("is not a VM record");
    expect(msg).toContain("shape.accel");
    expect(msg).toContain("shape.memMib");
    writeFileSync(rec(dir), JSON.stringify({ ...good, image: { env: "PATH=/bin" } }));
    expect(await invalidMessage(dir)).toContain("image.env");
    writeFileSync(rec(dir), JSON.stringify({ ...good, generation: -1 }));
    expect(await invalidMessage(dir)).toContain("generation");
  });
});

describe("a record is not taken on its word", () => {
  test("a record only in the VM directory (an older agent's, the jail could write it) is refused", async () => {
    const dir = vmDir();
    const vm = new SandboxVm("vm-old", dir, shape, "/s/d.qcow2", "/shm/m.mem");
    writeFileSync(join(dir, VM_RECORD_FILE), JSON.stringify(saveVm(vm, notes)));
    expect(await invalidMessage(dir)).toContain("older agent's record");
  });

  test("the id must be its directory's and every path a registered file under its root, with no symlink", async () => {
    const id = "vm-00112233445566aa";
    const dir = join(root, "vms", id);
    mkdirSync(dir, { recursive: true });
    const disks = join(root, "storage", "disks");
    mkdirSync(disks, { recursive: true });
    mkdirSync(shape.shmRoot, { recursive: true });
    const disk = join(disks, `${id}.qcow2`);
    const mem = join(shape.shmRoot, "tpl.mem");
    writeFileSync(disk, "");
    writeFileSync(mem, "");
    const chain = await openChainStore(root);
    await chain.add(mem, { kind: "ram", holder: `vm:${id}` });
    await chain.add(disk, { kind: "overlay", holder: `vm:${id}` });
    // The image store and the artifacts, as the agent lays them out under its cache dir.
    const cache = join(root, "cache");
    const imagesRoot = join(cache, "images");
    const guestRoot = join(cache, "guest");
    const baseDisk = join(imagesRoot, "ab".repeat(32), "rootfs.qcow2");
    const kernelDir = join(guestRoot, "key-1");
    for (const d of [dirname(baseDisk), kernelDir]) mkdirSync(d, { recursive: true });
    for (const f of [baseDisk, join(kernelDir, "vmlinux"), join(kernelDir, "initramfs.cpio.gz")])
      writeFileSync(f, "");
    const artifacts = {
      vmlinux: join(kernelDir, "vmlinux"),
      initramfs: join(kernelDir, "initramfs.cpio.gz"),
      kernelVersion: "6.1",
      key: "key-1",
    };
    const placed = { ...shape, baseDisk, artifacts };
    const at = { dir, stateDir: root, shmRoot: shape.shmRoot, chain, imagesRoot, guestRoot };
    const good = saveVm(new SandboxVm(id, dir, placed, disk, mem), notes);
    const why = async (r: VmRecord) => {
      const c = await checkVmRecord(r, at);
      return c.ok ? "ok" : c.error.message;
    };
    expect(await why(good)).toBe("ok");
    expect(await why({ ...good, vmId: "../../../etc" })).toContain('names VM "../../../etc"');
    expect(await why({ ...good, vmId: "vm-0011223344556677" })).toContain("names VM");
    expect(await why({ ...good, memPath: "/etc/passwd" })).toContain("/etc/passwd as its RAM file");
    expect(await why({ ...good, disk: join(disks, "other.qcow2") })).toContain("as its disk");
    const link = join(disks, "link.qcow2");
    symlinkSync("/etc/passwd", link);
    await chain.add(link, { kind: "overlay", holder: `vm:${id}` });
    expect(await why({ ...good, disk: link })).toContain("as its disk");
    expect(await why({ ...good, suspendState: join(disks, `${id}.qcow2`) })).toContain("as its state file");
    expect(await why({ ...good, shape: { ...good.shape, dataDir: "/" } })).toContain("another data dir");
    // The paths the jail is built from: base disk, kernel, initramfs.
    const withShape = (sh: Partial<VmShape>) => why({ ...good, shape: { ...good.shape, ...sh } });
    expect(await withShape({ baseDisk: "/etc/passwd" })).toContain("/etc/passwd as its base disk");
    const otherImage = join(imagesRoot, "cd".repeat(32), "other.img");
    mkdirSync(dirname(otherImage), { recursive: true });
    writeFileSync(otherImage, "");
    expect(await withShape({ baseDisk: otherImage })).toContain("as its base disk");
    const linkedImage = join(imagesRoot, "ef".repeat(32));
    symlinkSync("/etc", linkedImage);
    expect(await withShape({ baseDisk: join(linkedImage, "rootfs.qcow2") })).toContain("as its base disk");
    expect(await withShape({ artifacts: { ...artifacts, vmlinux: "/etc/passwd" } })).toContain(
      "/etc/passwd as its kernel",
    );
    const wrongKey = { ...artifacts, key: "key-2" };
    expect(await withShape({ artifacts: wrongKey })).toContain("as its kernel");
    const climbing = { ...artifacts, initramfs: join(guestRoot, "..", "images", "x"), key: ".." };
    expect(await withShape({ artifacts: climbing })).toContain("as its kernel");
    const missing = join(guestRoot, "key-3");
    const gone = { vmlinux: join(missing, "vmlinux"), initramfs: join(missing, "initramfs.cpio.gz") };
    expect(await withShape({ artifacts: { ...artifacts, ...gone, key: "key-3" } })).toContain(
      "as its kernel",
    );
  });
});
