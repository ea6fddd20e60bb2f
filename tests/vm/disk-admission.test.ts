/**
 * Admission counts disk growth: the agent's data dir on a small loop-mounted ext4, REAL VMs under
 * TCG through SandboxManager + SnapshotDriver. With free space (less the reserve) short of the
 * running VM's room to grow plus a new VM's full disk, a second create is refused `at_capacity`
 * naming the disk figures, which match the host's statfs; the first sandbox still runs commands;
 * once the space is back the same create succeeds; two creates at once with room for one admit
 * exactly one.
 *
 * Needs root (loop mounts); skipped otherwise.
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { execFileSync } from "node:child_process";
import { mkdir, rm } from "node:fs/promises";
import { join } from "node:path";
import type { SandboxManager } from "../../agent/sandbox/manager.ts";
import { defaultShmRoot } from "../../agent/snapshot/template.ts";
import { freeBytes } from "../../contracts/disk-space.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { canLoopMount, type LoopDisk, mountLoopDisk } from "../support/loop-disk.ts";
import { managerWithBusybox, qemuPidsUnder, removeBusyboxArchive, shellIn } from "../support/real-vm.ts";

const MIB = 1024 * 1024;
/** Room for the busybox template (its disk's virtual size is 256 MiB) and one VM's growth. */
const DISK_MIB = 768;
const RESERVE = 8 * MIB;
const MEM_MIB = 128;
const VM_TEST_TIMEOUT_MS = 300_000;

const enabled = canLoopMount();
let disk: LoopDisk | undefined;
let mnt: string;
let stateDir: string;
let m: SandboxManager;

beforeAll(async () => {
  if (!enabled) return;
  disk = await mountLoopDisk("sbx-diskadm-", DISK_MIB);
  mnt = disk.mnt;
  stateDir = join(mnt, "state");
  await mkdir(stateDir);
  m = await managerWithBusybox({
    stateDir,
    cacheDir: join(mnt, "cache"),
    memMib: MEM_MIB,
    diskReserveBytes: RESERVE,
  });
}, VM_TEST_TIMEOUT_MS);

afterAll(async () => {
  if (!enabled) return;
  try {
    if (m) {
      for (const s of m.list()) await m.destroy(s.id, { force: true });
      await m.deleteTemplate("bb").catch(() => {}); // the mount goes next either way
      expect(await qemuPidsUnder(stateDir)).toEqual([]);
    }
  } finally {
    await disk?.remove();
    await rm(defaultShmRoot(stateDir), { recursive: true, force: true });
    await removeBusyboxArchive();
  }
});

test.skipIf(!enabled)(
  "a create whose disk could not grow is at_capacity with the disk figures; the running sandbox keeps working",
  async () => {
    const first = (await m.create("bb", { kind: "sandbox" })).vmId;
    expect((await shellIn(m, first, "echo hi")).trim()).toBe("hi");
    // A new VM's room: the template disk's virtual size, read on the host.
    const info = execFileSync("qemu-img", [
      "info",
      "--output=json",
      join(stateDir, "templates", "bb", "disk.qcow2"),
    ]);
    const newDisk = (JSON.parse(info.toString()) as { "virtual-size": number })["virtual-size"];
    expect(newDisk).toBeGreaterThan(0);

    // Leave free (less the reserve) one and a half new VMs' disks: by memory, slots and vCPUs a
    // second VM fits; by disk it does not (the first VM's room is its disk less the little it
    // wrote, the second's its whole disk).
    const filler = join(mnt, "filler");
    const want = newDisk * 1.5 + RESERVE;
    execFileSync("fallocate", ["-l", String((await freeBytes(mnt)) - want), filler]);
    const usableMib = Math.floor(((await freeBytes(mnt)) - RESERVE) / MIB);

    let refused: unknown;
    await m.create("bb", { kind: "sandbox" }).catch((e) => {
      refused = e;
    });
    expect(refused).toBeInstanceOf(SandboxdError);
    const err = refused as SandboxdError;
    expect(err.code).toBe("at_capacity");
    const figures = /VM disk growth (\d+) MiB > (\d+) MiB free/.exec(err.message);
    console.log(`DISK_ADMISSION ${JSON.stringify({ message: err.message, usable_mib_statfs: usableMib })}`);
    expect(figures).not.toBeNull();
    // What the agent saw is what the host's statfs says (the first VM writes a little meanwhile).
    expect(Math.abs(Number(figures?.[2]) - usableMib)).toBeLessThanOrEqual(2);
    expect(Number(figures?.[1])).toBeGreaterThan(Math.ceil((newDisk * 1.5) / MIB));
    expect(Number(figures?.[1])).toBeLessThanOrEqual(Math.ceil((newDisk * 2) / MIB));
    expect(err.message).not.toContain("VM memory");
    expect(m.list().filter((s) => s.state !== "failed")).toHaveLength(1);

    // The first sandbox still runs commands and writes its disk.
    expect(
      (
        await shellIn(m, first, "dd if=/dev/zero of=/f bs=1024 count=1024 2>/dev/null && sync && wc -c < /f")
      ).trim(),
    ).toBe("1048576");

    // Space back: the same create is admitted.
    await rm(filler);
    const second = (await m.create("bb", { kind: "sandbox" })).vmId;
    expect((await shellIn(m, second, "echo two")).trim()).toBe("two");

    // Two creates at once with room for one: the first admitted holds its disk room until its VM
    // runs, so the other, admitted meanwhile, cannot be promised the same space.
    for (const id of [first, second]) await m.destroy(id, { force: true });
    execFileSync("fallocate", ["-l", String((await freeBytes(mnt)) - (newDisk * 1.5 + RESERVE)), filler]);
    const racing = await Promise.allSettled([0, 1].map(() => m.create("bb", { kind: "sandbox" })));
    const won = racing.filter((r) => r.status === "fulfilled");
    const lost = racing.filter((r): r is PromiseRejectedResult => r.status === "rejected");
    console.log(
      `DISK_ADMISSION_RACE ${JSON.stringify({ admitted: won.length, refused: lost.map((r) => String(r.reason)) })}`,
    );
    expect(won).toHaveLength(1);
    expect(lost).toHaveLength(1);
    expect((lost[0]?.reason as SandboxdError | undefined)?.code).toBe("at_capacity");
    expect(String(lost[0]?.reason)).toMatch(/VM disk growth \d+ MiB > \d+ MiB free/);
    await rm(filler);
  },
  VM_TEST_TIMEOUT_MS,
);
