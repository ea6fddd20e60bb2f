/**
 * What `sandboxd test` runs and how it reads the results (pure: no processes here; the runner
 * is cli/testing/run.ts). Test files sort into two tiers by where they live:
 *
 * - quick: unit tests beside the code (`agent/**`, `gateway/**`, ... `*.test.ts`), and
 *   `tests/integration/` and `tests/style/`: no VM, no `up`. The check to run before each commit.
 * - full: all of quick, plus `tests/vm/` (real QEMU in this process), `tests/e2e/` (a real `up`
 *   over HTTP), `tests/perf/` (the benches, tiny counts), and unit files named `*.vm.test.ts`
 *   (beside code that can only be tested with a VM booted).
 *
 * A file that changes what the whole host sees (fills /dev/shm, flips a sysctl the other files'
 * VMs read) says so with a `test-runner: exclusive (why)` line in its first 40 lines: it runs
 * with no other full-tier file beside it (quick files, which start no VM, may run meanwhile).
 */

export type Tier = "quick" | "full";

export interface TestFile {
  /** Path from the repository root, `/`-separated. */
  path: string;
  tier: Tier;
  exclusive: boolean;
}

/** Folders under tests/ whose files need a VM or a running service: the full tier only. */
const FULL_ONLY_DIRS = ["tests/vm/", "tests/e2e/", "tests/perf/"];
/** Folders under tests/ that hold quick suites. Any other place under tests/ is refused (below). */
const QUICK_DIRS = ["tests/integration/", "tests/style/"];

export function tierOf(path: string): Tier {
  if (FULL_ONLY_DIRS.some((d) => path.startsWith(d))) return "full";
  if (path.endsWith(".vm.test.ts")) return "full";
  return "quick";
}

/**
 * A test file placed under tests/ outside the known folders is a mistake the runner names
 * (it would otherwise land in a tier by accident).
 */
export function misplaced(paths: string[]): string[] {
  return paths.filter(
    (p) => p.startsWith("tests/") && ![...FULL_ONLY_DIRS, ...QUICK_DIRS].some((d) => p.startsWith(d)),
  );
}

const EXCLUSIVE_MARK = /test-runner:\s*exclusive\b/;

export function isExclusive(head: string): boolean {
  return EXCLUSIVE_MARK.test(head.split("\n").slice(0, 40).join("\n"));
}

/** The files a run takes: the tier's, then those whose path contains one of `filters` (if any). */
export function select(files: TestFile[], opts: { quick: boolean; filters: string[] }): TestFile[] {
  return files.filter(
    (f) =>
      (!opts.quick || f.tier === "quick") &&
      (opts.filters.length === 0 || opts.filters.some((x) => f.path.includes(x))),
  );
}

/** What one `bun test FILE` printed, read from its output. */
export interface FileResult {
  passed: number;
  failed: number;
  skipped: number;
  /** Names of the skipped (and todo) tests, as bun prints them: `describe > test`. */
  skippedNames: string[];
  /** Whether bun printed its summary at all (a crash or a kill prints none). */
  summarized: boolean;
  /** Each failed test: its name and the end of what bun printed for it (the error, bounded). */
  failures: { name: string; excerpt: string[] }[];
}

// Bun's summary lines (` 12 pass`, ` 1 skip`, ` 0 fail`, ` 1 todo`) and per-test lines.
const COUNT = (word: string) => new RegExp(`^\\s*(\\d+) ${word}$`, "m");
const RESULT_LINE = /^\((pass|fail|skip|todo)\) (.*?)(?: \[[\d.]+m?s\])?$/;
/** bun's source excerpt above an error (`12 | code`): the error's own lines say more. */
const SOURCE_LINE = /^\s*\d+ \|/;

/**
 * Lines of a failure kept for the run's closing problems (CI shows only the end of the output, so
 * the cause must be there): from the last `error:` line of the test's output, at most 16 lines of
 * at most 240 characters (a longer one: its first 4 and its last 11); a test's logs above its
 * error are left in the file's own section.
 */
const EXCERPT_LINES = 16;
const EXCERPT_HEAD = 4;
const EXCERPT_LINE_CHARS = 240;

function failureExcerpt(block: string[]): string[] {
  const lines = block.filter((l) => l.trim() !== "" && l.trim() !== "^" && !SOURCE_LINE.test(l));
  let from = lines.length - 1;
  while (from >= 0 && !/^\s*(error|\w*Error):/.test(lines[from]!)) from--;
  const error = lines.slice(Math.max(0, from));
  // A long message (a service's log tail): its head, and the end where Expected/Received and `at` are.
  const kept =
    error.length <= EXCERPT_LINES
      ? error
      : [...error.slice(0, EXCERPT_HEAD), "...", ...error.slice(-(EXCERPT_LINES - EXCERPT_HEAD - 1))];
  return kept.map((l) => l.trimEnd().slice(0, EXCERPT_LINE_CHARS));
}

/**
 * The per-test lines: the skipped (and todo) tests' names, and the failed tests, each with the
 * lines bun printed between the test before it and its `(fail)`.
 */
function perTest(out: string): Pick<FileResult, "skippedNames" | "failures"> {
  const skippedNames: string[] = [];
  const failures: FileResult["failures"] = [];
  let block: string[] = [];
  for (const line of out.split("\n")) {
    const m = RESULT_LINE.exec(line);
    if (!m) {
      block.push(line);
      continue;
    }
    const name = m[2]!.trim();
    if (m[1] === "fail") failures.push({ name, excerpt: failureExcerpt(block) });
    else if (m[1] === "skip" || m[1] === "todo") skippedNames.push(name);
    block = [];
  }
  return { skippedNames, failures };
}

export function parseBunOutput(out: string): FileResult {
  const n = (word: string) => Number(COUNT(word).exec(out)?.[1] ?? 0);
  const summarized = /^Ran \d+ tests? across \d+ files?\./m.test(out);
  return {
    passed: n("pass"),
    failed: n("fail"),
    skipped: n("skip") + n("todo"),
    summarized,
    ...perTest(out),
  };
}

/** One entry of the allow-list of skips (tests/allowed-skips.ts). */
export interface AllowedSkip {
  /** The test file's path from the repository root. */
  file: string;
  /** The skipped test's full name as bun prints it (`describe > test`), or its start. */
  test: string;
  /** Why it may skip, and on which hosts: said in the run's output next to the skip. */
  reason: string;
}

/** The skips of `file` that no allow-list entry names: each one fails the run. */
export function unallowedSkips(file: string, names: string[], allowed: AllowedSkip[]): string[] {
  return names.filter((name) => !allowed.some((a) => a.file === file && name.startsWith(a.test)));
}

/**
 * The order a pool of workers takes the files in: longest first by the last recorded time (so
 * the longest file does not start last and stretch the run), files with no record by a guess
 * for their tier. Exclusive files go first: the other full-tier files start once they have run.
 */
export function schedule(files: TestFile[], recordedMs: Record<string, number>): TestFile[] {
  const guess = (f: TestFile) => recordedMs[f.path] ?? (f.tier === "full" ? 60_000 : 2_000);
  return [...files].sort(
    (a, b) =>
      Number(b.exclusive) - Number(a.exclusive) || guess(b) - guess(a) || a.path.localeCompare(b.path),
  );
}

/** The closing line CI reads: `N passed, N failed, N skipped`. */
export function summaryLine(t: { passed: number; failed: number; skipped: number }): string {
  return `${t.passed} passed, ${t.failed} failed, ${t.skipped} skipped`;
}

/** The `n` slowest files, as lines `  123.4 s  path`. */
export function slowest(timings: { path: string; ms: number }[], n: number): string[] {
  return [...timings]
    .sort((a, b) => b.ms - a.ms)
    .slice(0, n)
    .map((t) => `${(t.ms / 1000).toFixed(1).padStart(7)} s  ${t.path}`);
}
