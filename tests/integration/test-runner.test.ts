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
  // Passes, but leaves a process of its group running after it ends: a leak the runner reports.
  "tests/integration/leaky.test.ts": `import { test } from "bun:test";
import { spawn } from "node:child_process";
test("starts a sleeper it never stops", () => {
  spawn("sleep", ["30"], { stdio: "ignore" }).unref();
});`,
  "tests/loose.test.ts": `import { test } from "bun:test"; test("x", () => {});`,
  // Each appends its start and end to ORDER_LOG: an exclusive file has no full-tier file beside it.
  "tests/vm/excl-one.test.ts": `// test-runner: exclusive (a fixture)
${logged("excl-one")}`,
  "tests/vm/excl-two.test.ts": `// test-runner: exclusive (a fixture)
${logged("excl-two")}`,
  "tests/vm/excl-other-a.test.ts": logged("other-a"),
  "tests/vm/excl-other-b.test.ts": logged("other-b"),
};

/** A test file that logs its start and end, with a pause between so that overlaps would show. */
function logged(name: string): string {
  return `import { test } from "bun:test";
import { appendFileSync } from "node:fs";
test("${name}", async () => {
  appendFileSync(process.env.ORDER_LOG!, "start ${name}\\n");
  await Bun.sleep(200); // a fixture's span, not a check: what runs beside it shows in the log
  appendFileSync(process.env.ORDER_LOG!, "end ${name}\\n");
});`;
}

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
    leftoverGraceMs: 1_000,
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
  process.env.ORDER_LOG = join(root, "order.log");
  writeFileSync(join(root, "warm.ts"), `require("node:fs").writeFileSync(process.env.MARKER, "1");`);
});

afterAll(() => {
  delete process.env.MARKER;
  delete process.env.ORDER_LOG;
  rmSync(root, { recursive: true, force: true });
});

describe("sandboxd test on a tree of its own", () => {
  test("every file in its own process: counts, skips off the list, crashes and loose files fail; the closing line", async () => {
    // A filter that matches every file: no type check or lint (the tree has no tsconfig).
    const r = await run(["test.ts", "--jobs", "3"]);
    expect(r.code).toBe(1);
    // pass 2 + skips 1 + needs-cache 1 + the 4 order-logging files + the loose file's 1 passed;
    // + leaky's 1; broken 1 + crash 1 + unlisted skip 1 + loose 1 + leaky's sleeper 1 failed;
    // 2 skipped.
    expect(r.out.trimEnd().split("\n").at(-1)).toBe("10 passed, 5 failed, 2 skipped");
    expect(r.out).toContain(
      "tests/integration/skips.test.ts: skipped and not on tests/allowed-skips.ts: not on the list",
    );
    expect(r.out).not.toContain("skipped and not on tests/allowed-skips.ts: allowed > because");
    expect(r.out).toContain("tests/integration/crash.test.ts: bun exited 3 without a result");
    expect(r.out).toContain("tests/loose.test.ts: a test file outside tests/");
    expect(r.out).toMatch(/tests\/integration\/leaky\.test\.ts: left 1 process\(es\) running: \d+ sleep 30/);
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

  test("an exclusive file runs with no other full-tier file beside it; the others start after every exclusive one", async () => {
    rmSync(join(root, "order.log"), { force: true });
    const r = await run(["--jobs", "4", "excl-"]);
    expect(r.out.trimEnd().split("\n").at(-1)).toBe("4 passed, 0 failed, 0 skipped");
    const lines = readFileSync(join(root, "order.log"), "utf8").trim().split("\n");
    // Each exclusive file's start is followed at once by its own end.
    for (const name of ["excl-one", "excl-two"]) {
      const at = lines.indexOf(`start ${name}`);
      expect(lines[at + 1]).toBe(`end ${name}`);
    }
    const lastExclusiveEnd = Math.max(lines.indexOf("end excl-one"), lines.indexOf("end excl-two"));
    expect(lines.indexOf("start other-a")).toBeGreaterThan(lastExclusiveEnd);
    expect(lines.indexOf("start other-b")).toBeGreaterThan(lastExclusiveEnd);
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
