/**
 * `sandboxd test`'s runner (cli/testing/run.ts) on a small tree of its own: real `bun test`
 * processes, files that pass, fail, skip, crash or sit outside the known folders, the shared-cache
 * step before the full tier, and the lines CI reads.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { type RunnerDeps, runTests } from "../../cli/testing/run.ts";

let root: string;
const FILES: Record<string, string> = {
  "tests/integration/pass.test.ts": `import { test, expect } from "bun:test";
test("one", () => expect(1).toBe(1));
test("two", () => expect(2).toBe(2));`,
  "tests/integration/skips.test.ts": `import { test } from "bun:test";
test("runs", () => {});
test.skip("allowed > because", () => {});
test.skip("not on the list", () => {});`,
  "agent/thing/broken.test.ts": `import { test, expect } from "bun:test";
test("fails", () => expect(1).toBe(2));`,
  "tests/integration/crash.test.ts": `process.exit(3);`,
  // The full tier's file passes only when the shared-cache step ran before it.
  "tests/vm/needs-cache.test.ts": `import { test, expect } from "bun:test";
import { existsSync } from "node:fs";
test("the cache was built first", () => expect(existsSync(process.env.MARKER!)).toBe(true));`,
  "tests/loose.test.ts": `import { test } from "bun:test"; test("x", () => {});`,
};

async function run(args: string[]): Promise<{ code: number; out: string; dataDir: string }> {
  let out = "";
  const dataDir = mkdtempSync(join(root, "data-"));
  const deps: RunnerDeps = {
    root,
    dataDir,
    allowedSkips: [{ file: "tests/integration/skips.test.ts", test: "allowed >", reason: "a fixture" }],
    warmCache: "warm.ts",
    write: (s) => {
      out += s;
    },
  };
  const code = await runTests(args, deps);
  return { code, out, dataDir };
}

beforeAll(() => {
  root = mkdtempSync(join(tmpdir(), "sbx-runner-"));
  for (const [path, text] of Object.entries(FILES)) {
    mkdirSync(dirname(join(root, path)), { recursive: true });
    writeFileSync(join(root, path), text);
  }
  process.env.MARKER = join(root, "cache-built");
  writeFileSync(join(root, "warm.ts"), `require("node:fs").writeFileSync(process.env.MARKER, "1");`);
});

afterAll(() => {
  delete process.env.MARKER;
  rmSync(root, { recursive: true, force: true });
});

describe("sandboxd test on a tree of its own", () => {
  test("every file in its own process: counts, skips off the list, crashes and loose files fail; the closing line", async () => {
    // A filter that matches every file: no type check or lint (the tree has no tsconfig).
    const r = await run(["test.ts"]);
    expect(r.code).toBe(1);
    // pass 2 + skips 1 + vm 1 (+ the loose file's 1) passed; broken 1 + crash 1 + unlisted skip 1
    // + loose 1 failed; 2 skipped.
    expect(r.out.trimEnd().split("\n").at(-1)).toBe("5 passed, 4 failed, 2 skipped");
    expect(r.out).toContain(
      "tests/integration/skips.test.ts: skipped and not on tests/allowed-skips.ts: not on the list",
    );
    expect(r.out).not.toContain("skipped and not on tests/allowed-skips.ts: allowed > because");
    expect(r.out).toContain("tests/integration/crash.test.ts: bun exited 3 without a result");
    expect(r.out).toContain("tests/loose.test.ts: a test file outside tests/");
    expect(r.out).toMatch(/slowest 15 files:\n\s+[\d.]+ s {2}\S+\.test\.ts/);
    expect(existsSync(join(root, "cache-built"))).toBe(true);
    // The times are recorded for the next run's order.
    const times = JSON.parse(readFileSync(join(r.dataDir, "test-timings.json"), "utf8"));
    expect(Object.keys(times).sort()).toContain("tests/vm/needs-cache.test.ts");
  }, 60_000);

  test("--quick leaves the full tier (and its cache step) out", async () => {
    rmSync(join(root, "cache-built"), { force: true });
    const r = await run(["--quick", "pass", "skips"]);
    expect(r.out.trimEnd().split("\n").at(-1)).toBe("3 passed, 1 failed, 2 skipped");
    expect(r.out).not.toContain("needs-cache");
    expect(existsSync(join(root, "cache-built"))).toBe(false);
  }, 60_000);

  test("a clean tree passes with exit 0", async () => {
    const r = await run(["pass.test"]);
    expect(r.code).toBe(0);
    expect(r.out.trimEnd().split("\n").at(-1)).toBe("2 passed, 0 failed, 0 skipped");
  }, 60_000);

  test("an unknown option or a filter that matches nothing is a usage error (exit 2), nothing runs", async () => {
    expect((await run(["--quik"])).code).toBe(2);
    expect((await run(["--jobs", "0"])).code).toBe(2);
    expect((await run(["no-such-file"])).code).toBe(2);
  });
});
