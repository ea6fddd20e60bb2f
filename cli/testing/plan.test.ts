import { describe, expect, test } from "bun:test";
import {
  isExclusive,
  misplaced,
  parseBunOutput,
  schedule,
  select,
  slowest,
  summaryLine,
  type TestFile,
  tierOf,
  unallowedSkips,
} from "./plan.ts";

describe("tiers", () => {
  test("unit files beside the code, tests/integration and tests/style are quick; vm, e2e, perf are not", () => {
    expect(tierOf("agent/qemu/qmp/framing.test.ts")).toBe("quick");
    expect(tierOf("tests/integration/gateway-api.test.ts")).toBe("quick");
    expect(tierOf("tests/style/layout.test.ts")).toBe("quick");
    expect(tierOf("tests/vm/vm-boot.test.ts")).toBe("full");
    expect(tierOf("tests/e2e/e2e-http.test.ts")).toBe("full");
    expect(tierOf("tests/perf/bench.test.ts")).toBe("full");
    expect(tierOf("agent/qemu/qmp/client.vm.test.ts")).toBe("full");
  });

  test("a test file loose in tests/ is named, so it cannot land in a tier by accident", () => {
    expect(misplaced(["tests/loose.test.ts", "tests/vm/a.test.ts", "agent/x.test.ts"])).toEqual([
      "tests/loose.test.ts",
    ]);
  });

  test("the exclusive mark counts only near the top", () => {
    expect(isExclusive("/**\n * test-runner: exclusive (fills /dev/shm)\n */")).toBe(true);
    expect(isExclusive(`${"\n".repeat(50)}// test-runner: exclusive`)).toBe(false);
    expect(isExclusive("// nothing here")).toBe(false);
  });

  test("--quick keeps the quick tier; filters keep the paths that contain one of them", () => {
    const files: TestFile[] = [
      { path: "agent/a.test.ts", tier: "quick", exclusive: false },
      { path: "tests/vm/b.test.ts", tier: "full", exclusive: false },
      { path: "tests/e2e/c.test.ts", tier: "full", exclusive: false },
    ];
    expect(select(files, { quick: true, filters: [] }).map((f) => f.path)).toEqual(["agent/a.test.ts"]);
    expect(select(files, { quick: false, filters: [] })).toHaveLength(3);
    expect(select(files, { quick: false, filters: ["e2e/", "agent/"] }).map((f) => f.path)).toEqual([
      "agent/a.test.ts",
      "tests/e2e/c.test.ts",
    ]);
    expect(select(files, { quick: true, filters: ["e2e/"] })).toEqual([]);
  });
});

describe("reading bun's output", () => {
  const out = [
    "bun test v1.4.5 (a7733435c)",
    "",
    "a.test.ts:",
    "(pass) one [1.00ms]",
    "(skip) two skipped",
    "(skip) grp > inner",
    "(todo) later",
    "(fail) broke [12.00ms]",
    "",
    " 1 pass",
    " 2 skip",
    " 1 todo",
    " 1 fail",
    "Ran 5 tests across 1 file. [3.00ms]",
  ].join("\n");

  test("counts, skipped names (todo counts as a skip) and the summary", () => {
    expect(parseBunOutput(out)).toEqual({
      passed: 1,
      failed: 1,
      skipped: 3,
      skippedNames: ["two skipped", "grp > inner", "later"],
      summarized: true,
      failures: [{ name: "broke", excerpt: [] }],
    });
  });

  test("a failure keeps its error's lines, bounded, without bun's source excerpt or the logs above it", () => {
    const failing = [
      "a.test.ts:",
      "(pass) one [1.00ms]",
      "a log line of the test",
      "error: first attempt",
      '120 |     expect(st.state).toBe("ready");',
      "error: expect(received).toBe(expected)",
      "",
      'Expected: "ready"',
      'Received: "pending"',
      "",
      `      at <anonymous> (/r/tests/e2e/a.test.ts:120:22) ${"x".repeat(400)}`,
      "(fail) grp > snapshot [72000.00ms]",
      ...Array.from({ length: 40 }, (_, i) => `log ${i}`),
      "(fail) no error line [1.00ms]",
      " 1 pass",
      " 2 fail",
      "Ran 3 tests across 1 file. [3.00ms]",
    ].join("\n");
    const f = parseBunOutput(failing).failures;
    expect(f.map((x) => x.name)).toEqual(["grp > snapshot", "no error line"]);
    expect(f[0]!.excerpt.slice(0, 3)).toEqual([
      "error: expect(received).toBe(expected)",
      'Expected: "ready"',
      'Received: "pending"',
    ]);
    expect(f[0]!.excerpt[3]!.length).toBe(240);
    expect(f[1]!.excerpt).toEqual([
      ...Array.from({ length: 4 }, (_, i) => `log ${i}`),
      "...",
      ...Array.from({ length: 11 }, (_, i) => `log ${i + 29}`),
    ]);
  });

  test("a run cut short has no summary", () => {
    expect(parseBunOutput("a.test.ts:\n(pass) one\nSegmentation fault").summarized).toBe(false);
  });

  test("a skip passes only when the allow-list names its file and the start of its name", () => {
    const allowed = [{ file: "a.test.ts", test: "grp >", reason: "why" }];
    expect(unallowedSkips("a.test.ts", ["grp > inner", "two skipped"], allowed)).toEqual(["two skipped"]);
    expect(unallowedSkips("b.test.ts", ["grp > inner"], allowed)).toEqual(["grp > inner"]);
  });
});

describe("scheduling and the closing lines", () => {
  test("exclusive first, then the longest recorded first; unrecorded files by their tier's guess", () => {
    const f = (path: string, tier: "quick" | "full", exclusive = false): TestFile => ({
      path,
      tier,
      exclusive,
    });
    const order = schedule(
      [
        f("q.test.ts", "quick"),
        f("tests/vm/new.test.ts", "full"),
        f("long.test.ts", "quick"),
        f("x.test.ts", "full", true),
      ],
      { "long.test.ts": 300_000, "q.test.ts": 100 },
    ).map((x) => x.path);
    expect(order).toEqual(["x.test.ts", "long.test.ts", "tests/vm/new.test.ts", "q.test.ts"]);
  });

  test("the summary CI reads, and the slowest files", () => {
    expect(summaryLine({ passed: 3, failed: 1, skipped: 2 })).toBe("3 passed, 1 failed, 2 skipped");
    expect(
      slowest(
        [
          { path: "a", ms: 1000 },
          { path: "b", ms: 61_234 },
        ],
        1,
      ),
    ).toEqual(["   61.2 s  b"]);
  });
});
