import { afterAll, expect, test } from "bun:test";
import { spawnSync } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { BUILD_STAMP_FILE, buildCommit, buildVersion } from "./build-stamp.ts";
import { REPO_ROOT } from "./config.ts";

const dirs: string[] = [];
const scratch = () => {
  const d = mkdtempSync(join(tmpdir(), "sbx-stamp-"));
  dirs.push(d);
  return d;
};
afterAll(() => {
  for (const d of dirs) rmSync(d, { recursive: true, force: true });
});

test("in a checkout: the package version and the commit git names", () => {
  const head = spawnSync("git", ["-C", REPO_ROOT, "rev-parse", "--short=12", "HEAD"], { encoding: "utf8" });
  if (head.status !== 0) throw new Error(`this test runs in a git checkout: ${head.stderr}`);
  expect(buildVersion(REPO_ROOT, "1.2.3")).toBe(`1.2.3+${head.stdout.trim()}`);
});

test("a copy without .git reads the stamp bin/sandboxd wrote; without one the commit is unknown", () => {
  const copy = scratch();
  expect(buildCommit(copy)).toBe("unknown");
  writeFileSync(join(copy, BUILD_STAMP_FILE), "0123456789ab\n");
  expect(buildVersion(copy, "0.1.0")).toBe("0.1.0+0123456789ab");
  // Whatever else is in the file is not reported as a commit.
  writeFileSync(join(copy, BUILD_STAMP_FILE), "<script>\n");
  expect(buildCommit(copy)).toBe("unknown");
});

test("bin/sandboxd writes the stamp of the commit it reports", async () => {
  const stamp = join(REPO_ROOT, BUILD_STAMP_FILE);
  rmSync(stamp, { force: true });
  const r = spawnSync(join(REPO_ROOT, "bin", "sandboxd"), ["--version"], { encoding: "utf8" });
  expect(r.status).toBe(0);
  const commit = buildCommit(REPO_ROOT);
  expect(r.stdout.trim()).toEndWith(`+${commit}`);
  expect((await Bun.file(stamp).text()).trim()).toBe(commit);
});
