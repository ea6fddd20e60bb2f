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
  [/^agent\/sandbox\/testing\.ts$/, "test-only helpers (the shared test data directory)"],
];

/** Files with reads that are not setting reads, by count. */
const COUNTED: Record<string, { reads: number; why: string }> = {
  "agent/host/tool.ts": { reads: 1, why: "a tool's child process starts with our environment plus its own" },
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
