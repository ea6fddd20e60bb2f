/**
 * A fork on a full tmpfs: the agent's RAM directory (`shmRoot`) on a tmpfs mounted small for the
 * test, REAL VMs under TCG through SandboxManager + SnapshotDriver. The tmpfs holds the template's
 * RAM file but not a fork's RAM stream: the fork is refused with `insufficient_storage` before the
 * parent is touched, no child and no file is left, and the parent keeps working; once the tmpfs
 * is grown (remount) the same fork succeeds and the child has the parent's files.
 *
 * Needs root (mount); skipped otherwise.
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { execFileSync } from "node:child_process";
import { readdirSync } from "node:fs";
import { mkdir, mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { SandboxManager } from "../../agent/sandbox/manager.ts";
import { forkShmBytes } from "../../agent/snapshot/fork.ts";
import { freeBytes } from "../../contracts/disk-space.ts";
import {
  codeOf,
  managerWithBusybox,
  qemuPidsUnder,
  removeBusyboxArchive,
  shellIn,
} from "../support/real-vm.ts";

const MIB = 1024 * 1024;
const RESERVE = 8 * MIB;
const MEM_MIB = 128;
/** Room for the template's RAM file and the reserve (what its build asks), not for a fork too. */
const SHM_MIB = MEM_MIB + 48;
const VM_TEST_TIMEOUT_MS = 300_000;

function canMountTmpfs(): boolean {
  return process.getuid?.() === 0;
}

const enabled = canMountTmpfs();
let root: string;
let shmMount: string;
let shmRoot: string;
let stateDir: string;
let m: SandboxManager;

beforeAll(async () => {
  if (!enabled) return;
  root = await mkdtemp(join(tmpdir(), "sbx-shm-"));
  shmMount = join(root, "shm");
  await mkdir(shmMount);
  execFileSync("mount", ["-t", "tmpfs", "-o", `size=${SHM_MIB}M,mode=0700`, "tmpfs", shmMount]);
  shmRoot = join(shmMount, "ram");
  stateDir = join(root, "state");
  await mkdir(stateDir);
  m = await managerWithBusybox({
    stateDir,
    cacheDir: join(root, "cache"),
    shmRoot,
    memMib: MEM_MIB,
    diskReserveBytes: RESERVE,
  });
}, VM_TEST_TIMEOUT_MS);

afterAll(async () => {
  if (!enabled) return;
  try {
    if (m) {
      for (const s of m.list()) await m.destroy(s.id, { force: true });
      await m.deleteTemplate("bb").catch(() => {});
      expect(await qemuPidsUnder(stateDir)).toEqual([]);
    }
  } finally {
    execFileSync("umount", ["-l", shmMount]);
    await rm(root, { recursive: true, force: true });
    await removeBusyboxArchive();
  }
});

const sh = (id: string, command: string) => shellIn(m, id, command);

test.skipIf(!enabled)(
  "a fork the tmpfs cannot hold is 507 with nothing made; the parent runs on; grown, the fork succeeds",
  async () => {
    const id = (await m.create("bb", { kind: "sandbox" })).vmId;
    await sh(id, "echo parent-data > /marker");
    const filesBefore = readdirSync(shmRoot).sort();
    const free = await freeBytes(shmRoot);
    const need = forkShmBytes(MEM_MIB, "stop-copy") + RESERVE;
    console.log(
      `SHM_FULL ${JSON.stringify({ tmpfs_mib: SHM_MIB, free_mib: Math.round(free / MIB), fork_needs_mib: Math.round(need / MIB) })}`,
    );
    expect(free).toBeLessThan(need);

    expect(await codeOf(m.fork(id, 1))).toBe("insufficient_storage");
    // Nothing made: no child, no file on tmpfs, the tmpfs as full as before; the parent runs.
    expect(m.list().map((s) => s.id)).toEqual([id]);
    expect(readdirSync(shmRoot).sort()).toEqual(filesBefore);
    expect(Math.abs((await freeBytes(shmRoot)) - free)).toBeLessThan(MIB);
    expect(m.info(id).state).toBe("running");
    expect((await sh(id, "cat /marker")).trim()).toBe("parent-data");

    // Room again: the same fork succeeds.
    execFileSync("mount", ["-o", `remount,size=${SHM_MIB + 512}M`, shmMount]);
    const [child] = await m.fork(id, 1);
    expect((await sh(child!.vmId, "cat /marker")).trim()).toBe("parent-data");
    expect((await sh(id, "cat /marker")).trim()).toBe("parent-data");
  },
  VM_TEST_TIMEOUT_MS,
);
