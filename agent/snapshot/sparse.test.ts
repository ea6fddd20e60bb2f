import { afterEach, expect, test } from "bun:test";
import { existsSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { allocatedBytes, digLater, digScheduledNow, digZeroHoles } from "./sparse.ts";

/** On tmpfs, like the RAM files it is for (allocated blocks there are host memory). */
const FILE = `/dev/shm/sparse-test-${process.pid}.mem`;
const MIB = 1024 * 1024;

afterEach(() => rmSync(FILE, { force: true }));

test.skipIf(!existsSync("/dev/shm"))(
  "digs the all-zero pages of a RAM file into holes, data kept",
  async () => {
    const data = Buffer.alloc(8 * MIB);
    // Data in two pages, zeros everywhere else (written, so allocated).
    data.fill(0xab, 4096, 8192);
    data.fill(0xcd, 5 * MIB, 5 * MIB + 100);
    writeFileSync(FILE, data);
    expect(await allocatedBytes(FILE)).toBeGreaterThanOrEqual(8 * MIB);
    const logs: string[] = [];
    const r = await digZeroHoles(FILE, (m) => logs.push(m));
    expect(logs).toEqual([]);
    expect(r?.before).toBeGreaterThanOrEqual(8 * MIB);
    // Only the two data pages stay (tmpfs allocates by page).
    expect(r?.after).toBeLessThanOrEqual(2 * 4096);
    expect(r?.after).toBeGreaterThan(0);
    expect(readFileSync(FILE).equals(data)).toBe(true);
  },
);

test("a file it cannot dig is left alone and logged, never thrown", async () => {
  const logs: string[] = [];
  expect(await digZeroHoles(`${FILE}.missing`, (m) => logs.push(m))).toBeUndefined();
  expect(logs).toHaveLength(1);
  expect(logs[0]).toContain("left as it is");
});

test("digLater: one dig per file however many ask, not before it is due; a file gone by then is skipped", async () => {
  const data = Buffer.alloc(2 * MIB); // all zeros, written: allocated
  writeFileSync(FILE, data);
  const logs: string[] = [];
  for (let i = 0; i < 5; i++) digLater(FILE, (m) => logs.push(m));
  digLater(`${FILE}.gone`, (m) => logs.push(m));
  // Not dug yet: the suspends that follow find the file full.
  expect(await allocatedBytes(FILE)).toBeGreaterThanOrEqual(2 * MIB);
  await digScheduledNow();
  expect(await allocatedBytes(FILE)).toBe(0);
  expect(readFileSync(FILE).equals(data)).toBe(true);
  // The missing file was skipped without a word; nothing is left scheduled.
  expect(logs).toEqual([]);
  writeFileSync(FILE, data);
  await digScheduledNow();
  expect(await allocatedBytes(FILE)).toBeGreaterThanOrEqual(2 * MIB);
});
