import { afterAll, expect, test } from "bun:test";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { FORK_METHODS, isForkMethod, readyForkMethod } from "./fork-method.ts";

const dir = mkdtempSync(join(tmpdir(), "fork-method-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

test("snapshot sets unprivileged userfaultfd to 1 where it is 0, and keeps the method", async () => {
  const sysctl = join(dir, "uffd");
  writeFileSync(sysctl, "0\n");
  expect(await readyForkMethod("snapshot", () => {}, sysctl)).toBe("snapshot");
  expect(readFileSync(sysctl, "utf8").trim()).toBe("1");
  // Already 1: nothing to write (a read-only file would refuse a write).
  expect(await readyForkMethod("snapshot", () => {}, sysctl)).toBe("snapshot");
});

test("where the sysctl cannot be set, forks fall back to stop-and-copy and the log says why", async () => {
  const logs: string[] = [];
  expect(await readyForkMethod("snapshot", (m) => logs.push(m), join(dir, "no", "such", "sysctl"))).toBe(
    "stop-copy",
  );
  expect(logs.join("\n")).toMatch(/could not be set.*stop/);
});

test("the other methods leave the sysctl alone", async () => {
  const sysctl = join(dir, "untouched");
  writeFileSync(sysctl, "0\n");
  for (const m of ["stop-copy", "precopy"] as const)
    expect(await readyForkMethod(m, () => {}, sysctl)).toBe(m);
  expect(readFileSync(sysctl, "utf8").trim()).toBe("0");
});

test("isForkMethod accepts exactly the methods", () => {
  for (const m of FORK_METHODS) expect(isForkMethod(m)).toBe(true);
  for (const v of ["", "live", "SNAPSHOT", 1, undefined]) expect(isForkMethod(v)).toBe(false);
});
