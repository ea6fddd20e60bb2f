/**
 * A fork asks tmpfs for room before it touches its parent: with too little free (measured by an
 * injected statfs), it fails with `insufficient_storage` and writes nothing; with enough, it goes
 * on to the parent (here a stand-in whose `begin` stops it, so no VM is needed). Real VMs on a
 * tiny tmpfs: tests/vm/shm-full.test.ts.
 */
import { afterAll, expect, test } from "bun:test";
import { existsSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { DEFAULT_VM_HOST } from "../vm/host-settings.ts";
import { SnapshotError } from "./errors.ts";
import { forkShmBytes, forkVm } from "./fork.ts";
import { migrationByteCap } from "./stream.ts";
import type { SandboxVm } from "./vm.ts";

const MIB = 1024 * 1024;
const RESERVE = 32 * MIB;
const MEM_MIB = 128;
const scratch = mkdtempSync(join(tmpdir(), "fork-shm-"));
const shmRoot = join(scratch, "shm");
afterAll(() => {
  rmSync(scratch, { recursive: true, force: true });
});

/** A parent that records whether the fork got as far as touching it. */
function standInParent() {
  const touched: string[] = [];
  const parent = {
    id: "vm-parent",
    shape: {
      shmRoot,
      memMib: MEM_MIB,
      dataDir: join(scratch, "data"),
      host: { ...DEFAULT_VM_HOST, diskReserveBytes: RESERVE },
    },
    begin: (_from: string[], to: string) => {
      touched.push(to);
      return new SnapshotError("invalid_state", "stand-in parent: stop here");
    },
  } as unknown as SandboxVm;
  return { parent, touched };
}

/** A statfs stand-in: `free` bytes everywhere; records the paths asked about. */
function measuring(free: number) {
  const asked: string[] = [];
  return {
    asked,
    freeBytes: async (path: string) => {
      asked.push(path);
      return free;
    },
  };
}

test("what a fork needs on tmpfs: the fork point's RAM file and device state, whatever the method", () => {
  expect(forkShmBytes(MEM_MIB, "stop-copy")).toBe(migrationByteCap(MEM_MIB));
  expect(forkShmBytes(MEM_MIB, "stop-copy")).toBeGreaterThan(MEM_MIB * MIB);
  // A live precopy's resent pages overwrite their first copy in the RAM file: no second pass.
  expect(forkShmBytes(MEM_MIB, "precopy")).toBe(migrationByteCap(MEM_MIB));
  // A background snapshot reads the RAM file's holes in (populate.ts), which allocates them.
  expect(forkShmBytes(MEM_MIB, "snapshot", 5 * MIB)).toBe(migrationByteCap(MEM_MIB) + 5 * MIB);
  expect(forkShmBytes(MEM_MIB, "stop-copy", 5 * MIB)).toBe(migrationByteCap(MEM_MIB));
});

for (const count of [1, 4]) {
  test(`fork of ${count}: one byte short is 507 with nothing written; enough goes on`, async () => {
    const need = forkShmBytes(MEM_MIB, "stop-copy") + RESERVE;

    const short = standInParent();
    const m = measuring(need - 1);
    const r = await forkVm(short.parent, { count, method: "stop-copy", freeBytes: m.freeBytes });
    expect(r.ok).toBe(false);
    const err = (r as { error: SnapshotError }).error;
    expect(err.code).toBe("insufficient_storage");
    expect(err.message).toContain("the fork's memory files on tmpfs");
    expect(m.asked).toEqual([shmRoot]);
    // The parent was never asked to change state, and nothing was created.
    expect(short.touched).toEqual([]);
    expect(existsSync(shmRoot)).toBe(false);

    const room = standInParent();
    const r2 = await forkVm(room.parent, {
      count,
      method: "stop-copy",
      freeBytes: measuring(need).freeBytes,
    });
    expect((r2 as { error: SnapshotError }).error.code).toBe("invalid_state");
    expect(room.touched).toEqual(["forking"]);
  });
}
