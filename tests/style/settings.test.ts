/**
 * Settings are read in one place: product code receives them as options from cli/settings/
 * (declared, parsed and range-checked there), so no module reads `process.env` on its own. This
 * fails when a new read appears anywhere else; the places that may still read it, and why, are
 * listed here with how many reads each has.
 */
import { expect, test } from "bun:test";
import { spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { join, resolve } from "node:path";

const REPO = resolve(import.meta.dir, "../..");

/** Where reading the environment is not a setting read. */
const ALLOWED_PLACES: readonly [RegExp, string][] = [
  [/^cli\/settings\/environment\.ts$/, "the settings module's one reader of the environment"],
  [/^tests\//, "test code"],
  [/\.test\.ts$/, "test code"],
  [/^cli\/testing\//, "the test runner"],
  [/^sdk\/typescript\/examples\//, "user programs reading their own API key"],
  [/^agent\/sandbox\/testing\.ts$/, "test-only helpers (set the disk reserve for a test file)"],
];

/**
 * Files with reads that are not setting reads, or are read at the point of use, by count. Every
 * one of these settings is also declared in cli/settings/table.ts, so a malformed value is
 * refused when a serving command starts.
 */
const COUNTED: Record<string, { reads: number; why: string }> = {
  "agent/host/tool.ts": { reads: 1, why: "a tool's child process starts with our environment plus its own" },
  "contracts/disk-space.ts": {
    reads: 1,
    why: "SANDBOXD_DISK_RESERVE_BYTES is read at each free-space check, called from the agent's API, snapshot and image code and set per test file in-process",
  },
  "agent/qemu/uids.ts": { reads: 1, why: "SANDBOXD_JAIL_UID_BASE/COUNT: read where each jail takes its uid" },
  "agent/qemu/jail-setup.ts": { reads: 1, why: "SANDBOXD_JAIL_UNSHARE: read where each jail is built" },
  "agent/qemu/accel.ts": {
    reads: 1,
    why: "SANDBOXD_ACCEL: the probe also serves `bench` and `doctor`, which take no settings",
  },
  "agent/egress/fence.ts": {
    reads: 1,
    why: "SANDBOXD_EGRESS_ALLOW_INTERNAL: the process's one fence, built on first use by the proxy and the registry pull",
  },
  "agent/catalog/python.ts": {
    reads: 1,
    why: "SANDBOXD_DEBIAN_MIRROR: read by the catalog build when it runs debootstrap",
  },
};

const READ = /process\.env\b/g;

test("no process.env read outside the settings module and the listed places", () => {
  const files = spawnSync("git", ["ls-files", "-z", "*.ts"], { cwd: REPO, encoding: "utf8" })
    .stdout.split("\0")
    .filter(Boolean)
    .filter((f) => !ALLOWED_PLACES.some(([re]) => re.test(f)));
  const found: Record<string, number> = {};
  for (const f of files) {
    const n = readFileSync(join(REPO, f), "utf8").match(READ)?.length ?? 0;
    if (n > 0) found[f] = n;
  }
  const expected = Object.fromEntries(Object.entries(COUNTED).map(([f, c]) => [f, c.reads]));
  // A new read: declare the setting in cli/settings/table.ts and pass its value in as an option.
  expect(found).toEqual(expected);
});
