import { afterAll, expect, test } from "bun:test";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describeError, SandboxdError } from "../../contracts/errors.ts";
import { refuseTakenUidRange, subidOverlaps } from "./uids.ts";

const scratch = mkdtempSync(join(tmpdir(), "subid-"));
afterAll(() => rmSync(scratch, { recursive: true, force: true }));

const subuid = join(scratch, "subuid");
const subgid = join(scratch, "subgid");
writeFileSync(subuid, "alice:100000:65536\n# a comment\nbob:165536:65536\n");
writeFileSync(subgid, "carol:950000:10\n");
const files = [subuid, subgid, join(scratch, "absent")];

test("a range that meets a user's subordinate ids is named, one that does not is not", () => {
  // 100000+65536 ends at 165535: the first id past it is free of alice, bob starts there.
  expect(subidOverlaps({ base: 165_535, count: 2 }, files)).toEqual([
    `${subuid}: alice 100000+65536`,
    `${subuid}: bob 165536+65536`,
  ]);
  expect(subidOverlaps({ base: 900_000, count: 50_001 }, files)).toEqual([`${subgid}: carol 950000+10`]);
  expect(subidOverlaps({ base: 900_000, count: 50_000 }, files)).toEqual([]);
  expect(subidOverlaps({ base: 231_072, count: 718_928 }, files)).toEqual([]);
  expect(subidOverlaps({ base: 950_010, count: 100 }, files)).toEqual([]);
});

test("the agent's start refuses an overlapping range with the overlap in its message", () => {
  let err: unknown;
  try {
    refuseTakenUidRange({ base: 900_000, count: 65_536 }, files);
  } catch (e) {
    err = e;
  }
  expect(err).toBeInstanceOf(SandboxdError);
  expect((err as SandboxdError).code).toBe("vm_launch_failed");
  expect(describeError(err)).toContain("carol 950000+10");
  expect(() => refuseTakenUidRange({ base: 960_000, count: 1000 }, files)).not.toThrow();
});
