import { afterAll, expect, test } from "bun:test";
import { chmodSync, mkdirSync, mkdtempSync, rmSync, statSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { lockDownDataDir } from "./data-dir.ts";

const scratch = mkdtempSync(join(tmpdir(), "data-dir-"));
const umaskBefore = process.umask();
afterAll(() => {
  process.umask(umaskBefore);
  rmSync(scratch, { recursive: true, force: true });
});

test("a serving command's data dir is made 0700 and what it then writes has no group or other bits", async () => {
  process.umask(0o022);
  const logs: string[] = [];
  const dir = join(scratch, "new", "data");
  await lockDownDataDir(dir, (m) => logs.push(m));
  expect(statSync(dir).mode & 0o777).toBe(0o700);
  expect(logs).toEqual([]);
  expect(process.umask()).toBe(0o077);
  writeFileSync(join(dir, "db"), "x");
  mkdirSync(join(dir, "images"));
  expect(statSync(join(dir, "db")).mode & 0o077).toBe(0);
  expect(statSync(join(dir, "images")).mode & 0o077).toBe(0);
});

test("an existing looser data dir is tightened to 0700, and the log says so", async () => {
  process.umask(0o022);
  const dir = join(scratch, "old");
  mkdirSync(dir);
  chmodSync(dir, 0o755);
  const logs: string[] = [];
  await lockDownDataDir(dir, (m) => logs.push(m));
  expect(statSync(dir).mode & 0o777).toBe(0o700);
  expect(logs).toEqual([`data dir ${dir} was mode 755: tightened to 700`]);
});
