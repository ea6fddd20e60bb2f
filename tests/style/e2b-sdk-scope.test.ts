/**
 * The E2B SDK suite's scope (tests/e2b-sdk/scope.ts) agrees with what is on disk: out-of-scope.md
 * is its rendering, no file left out whole was copied, each test left out by name is in a copied
 * file.
 */
import { describe, expect, test } from "bun:test";
import { readdirSync, readFileSync } from "node:fs";
import { join, relative } from "node:path";
import { OUT_OF_SCOPE, renderOutOfScope, testNamePattern } from "../e2b-sdk/scope.ts";

const DIR = join(import.meta.dir, "../e2b-sdk");
const TESTS = join(DIR, "upstream/tests");

function filesUnder(dir: string): string[] {
  return readdirSync(dir, { recursive: true, withFileTypes: true })
    .filter((e) => e.isFile())
    .map((e) => relative(TESTS, join(e.parentPath, e.name)));
}

describe("E2B SDK suite scope", () => {
  test("out-of-scope.md is rendered from scope.ts", () => {
    expect(readFileSync(join(DIR, "out-of-scope.md"), "utf8")).toBe(renderOutOfScope());
  });

  test("no whole file left out was copied; each test left out by name is in a copied file", () => {
    const copied = filesUnder(TESTS);
    for (const e of OUT_OF_SCOPE) {
      if (e.test) {
        expect(copied).toContain(e.file);
        expect(readFileSync(join(TESTS, e.file), "utf8")).toContain(`'${e.test}'`);
      } else {
        expect(copied.filter((f) => f === e.file || (e.file.endsWith("/") && f.startsWith(e.file)))).toEqual(
          [],
        );
      }
    }
  });

  test("the name pattern leaves out exactly the tests named", () => {
    const re = new RegExp(testNamePattern());
    for (const e of OUT_OF_SCOPE) if (e.test) expect(re.test(`sandbox/x.test.ts ${e.test}`)).toBe(false);
    expect(re.test("sandbox/create.test.ts create")).toBe(true);
    expect(re.test("sandbox/snapshot.test.ts pause and resume a sandbox")).toBe(true);
  });
});
