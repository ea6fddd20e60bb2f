import { afterAll, expect, test } from "bun:test";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { ksmCheck } from "./doctor.ts";

const dirs: string[] = [];
/** A directory with KSM's two controls as the kernel shows them. */
function sysfs(run: string): string {
  const d = mkdtempSync(join(tmpdir(), "sbx-ksm-"));
  dirs.push(d);
  writeFileSync(join(d, "run"), `${run}\n`);
  writeFileSync(join(d, "pages_to_scan"), "100\n");
  return d;
}
afterAll(() => {
  for (const d of dirs) rmSync(d, { recursive: true, force: true });
});

test("doctor's KSM line: SANDBOXD_KSM=qemu on a host whose KSM is off, or absent, merges nothing and says so", () => {
  const on = sysfs("1");
  const off = sysfs("0");
  const missing = join(tmpdir(), "sbx-ksm-no-such-dir");
  expect(ksmCheck(true, on)).toMatchObject({
    ok: true,
    detail: expect.stringContaining("host KSM running (100 pages a scan)"),
  });
  expect(ksmCheck(true, on).warn).toBeUndefined();
  expect(ksmCheck(true, off)).toMatchObject({
    ok: true,
    warn: true,
    detail: expect.stringContaining(`${off}/run is 0`),
  });
  expect(ksmCheck(true, missing)).toMatchObject({
    ok: true,
    warn: true,
    detail: expect.stringContaining("this kernel has no KSM"),
  });
  // Off (the default): nothing to warn of, whatever the host does; guest RAM is never offered.
  for (const d of [on, off, missing]) {
    const c = ksmCheck(false, d);
    expect(c.warn).toBeUndefined();
    expect(c.detail).toStartWith("guest RAM never offered");
  }
});
