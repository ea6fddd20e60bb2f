import { afterAll, expect, test } from "bun:test";
import {
  chmodSync,
  chownSync,
  existsSync,
  mkdirSync,
  mkdtempSync,
  rmSync,
  statSync,
  symlinkSync,
  writeFileSync,
} from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { SandboxdError } from "../../contracts/errors.ts";
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

test("a RAM-file directory that is not the agent's alone is refused; a new one is made 0700", async () => {
  const fresh = join(scratch, "fresh", "sandboxd");
  await claimShmRoot(join(fresh, "root"), scratch);
  expect(statSync(fresh).mode & 0o777).toBe(0o700);
  expect(statSync(join(fresh, "root")).mode & 0o777).toBe(0o700);

  const open = join(scratch, "open");
  mkdirSync(open);
  chmodSync(open, 0o777);
  expect(await codeOf(claimShmRoot(join(open, "root"), scratch))).toBe("storage_error");
  expect(existsSync(join(open, "root"))).toBe(false);

  const theirs = join(scratch, "theirs");
  mkdirSync(theirs, { mode: 0o700 });
  chownSync(theirs, 12_345, 12_345);
  expect(await codeOf(claimShmRoot(join(theirs, "root"), scratch))).toBe("storage_error");

  const link = join(scratch, "link");
  symlinkSync(fresh, link);
  expect(await codeOf(claimShmRoot(join(link, "root"), scratch))).toBe("storage_error");

  // The root itself is checked too: one another user made inside our base.
  const planted = join(fresh, "planted");
  mkdirSync(planted, { mode: 0o700 });
  chownSync(planted, 12_345, 12_345);
  expect(await codeOf(claimShmRoot(planted, scratch))).toBe("storage_error");
});

async function codeOf(p: Promise<unknown>): Promise<string> {
  try {
    await p;
    return "ok";
  } catch (err) {
    return err instanceof SandboxdError ? err.code : `not a SandboxdError: ${String(err)}`;
  }
}
