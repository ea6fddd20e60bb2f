import { afterAll, expect, test } from "bun:test";
import { existsSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { claimShmRoot, ownerFileOf, sweepOrphanShmRoots } from "./shm.ts";

const scratch = mkdtempSync(join(tmpdir(), "shm-sweep-"));
afterAll(() => rmSync(scratch, { recursive: true, force: true }));

test("a RAM root whose data directory is gone is swept; live and unclaimed ones stay", async () => {
  const base = join(scratch, "base");
  const liveData = join(scratch, "data-live");
  const goneData = join(scratch, "data-gone");
  mkdirSync(liveData);
  mkdirSync(goneData);
  await claimShmRoot(join(base, "live"), liveData);
  await claimShmRoot(join(base, "gone"), goneData);
  writeFileSync(join(base, "gone", "tpl-x.mem"), "ram");
  mkdirSync(join(base, "unclaimed"));
  rmSync(goneData, { recursive: true });

  expect(await sweepOrphanShmRoots(base)).toEqual([join(base, "gone")]);
  expect(existsSync(join(base, "gone"))).toBe(false);
  expect(existsSync(ownerFileOf(join(base, "gone")))).toBe(false);
  expect(existsSync(ownerFileOf(join(base, "live")))).toBe(true);
  expect(existsSync(join(base, "unclaimed"))).toBe(true);
  expect(await sweepOrphanShmRoots(join(scratch, "no-such-base"))).toEqual([]);
});
