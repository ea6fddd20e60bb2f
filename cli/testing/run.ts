/**
 * `sandboxd test [--quick] [--jobs N] [FILTER...]`, the project's one test command (README):
 * the type check and the lint, then every test file in its own `bun test` process, several at
 * once. What runs and how results are read is cli/testing/plan.ts.
 *
 * Each file's output is printed whole when it ends (never interleaved), then the 15 slowest files,
 * then the closing line CI reads: `N passed, N failed, N skipped`. The type check and the lint
 * count as one test each. A skip that tests/allowed-skips.ts does not list fails the run, and so
 * does a file that crashed before bun's summary.
 */
import { type ChildProcess, spawn } from "node:child_process";
import { existsSync, mkdirSync, readdirSync, readFileSync, writeFileSync } from "node:fs";
import { join, relative } from "node:path";
import { ALLOWED_SKIPS } from "../../tests/allowed-skips.ts";
import { REPO_ROOT } from "../config.ts";
import {
  type AllowedSkip,
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
import { type Job, runPool } from "./pool.ts";

/**
 * The most one file may run. The longest file takes about 5 minutes on a loaded 2-core TCG host;
 * a file past this is hung (a VM that never answers, a wait with no bound) and is killed so the
 * run still ends and says which.
 */
const FILE_LIMIT_MS = 20 * 60_000;
/** Bun's own per-test bound: VM tests boot real QEMU under TCG, a single test may take a minute. */
const TEST_TIMEOUT_MS = 180_000;
/** Directories never searched for tests: tools, data, dependencies, build output. */
const SKIP_DIRS = new Set(["node_modules", "build", "dist", "__pycache__"]);
/**
 * E2B's own SDK tests, copied as they are: vitest runs them against the service from
 * tests/e2e/e2b-sdk-suite.test.ts (docs/e2b.md "E2B's own SDK tests"); `bun test` cannot.
 */
const SKIP_PATHS = new Set(["tests/e2b-sdk/upstream"]);
const SLOWEST_SHOWN = 15;

const USAGE = `usage: sandboxd test [--quick] [--jobs N] [FILTER...]
  --quick    type check, lint and the quick tier (unit and in-process suites: no VM, no up)
  --jobs N   files run at once (default 2 with --quick, 3 otherwise)
  FILTER     only the test files whose path contains one of these (no type check or lint)`;

interface Options {
  quick: boolean;
  jobs: number | undefined;
  filters: string[];
}

function parseOptions(args: string[]): Options | string {
  const opts: Options = { quick: false, jobs: undefined, filters: [] };
  for (let i = 0; i < args.length; i++) {
    const a = args[i]!;
    if (a === "--quick") opts.quick = true;
    else if (a === "--jobs") {
      const n = Number(args[++i]);
      // Beyond 16 files at once the 2-core machines only thrash.
      if (!Number.isInteger(n) || n < 1 || n > 16) return "--jobs takes a whole number from 1 to 16";
      opts.jobs = n;
    } else if (a === "--help" || a === "-h") return "";
    else if (a.startsWith("-")) return `unknown option ${a}`;
    else opts.filters.push(a);
  }
  return opts;
}

function findTestFiles(root: string, dir = root, out: string[] = []): string[] {
  for (const e of readdirSync(dir, { withFileTypes: true })) {
    if (e.name.startsWith(".") || SKIP_DIRS.has(e.name)) continue;
    const p = join(dir, e.name);
    if (SKIP_PATHS.has(relative(root, p))) continue;
    if (e.isDirectory()) findTestFiles(root, p, out);
    else if (e.isFile() && e.name.endsWith(".test.ts")) out.push(relative(root, p));
  }
  return out;
}

function testFiles(root: string): TestFile[] {
  return findTestFiles(root).map((path) => ({
    path,
    tier: tierOf(path),
    exclusive: isExclusive(readFileSync(join(root, path), "utf8")),
  }));
}

/** Where each run records its per-file times; the committed tests/timings.json seeds a clean clone. */
function timingsPaths(root: string, dataDir: string): { read: string; write: string } {
  const write = join(dataDir, "test-timings.json");
  return { read: existsSync(write) ? write : join(root, "tests", "timings.json"), write };
}

function readTimings(path: string): Record<string, number> {
  try {
    return JSON.parse(readFileSync(path, "utf8")) as Record<string, number>;
  } catch {
    return {};
  }
}

interface Done {
  label: string;
  code: number | null;
  out: string;
  ms: number;
  killed: boolean;
  /** Processes of the file's group still running after it ended (a leak): `pid command`. */
  leftover: string[];
}

/**
 * A file's processes may take a moment to go after bun exits (a service on its SIGTERM, a QEMU
 * reaped by pid): what is still in its group after this long was left running by the file.
 */
const LEFTOVER_GRACE_MS = 10_000;

/** `pid command` of the processes whose process group is `pgid` (from /proc). */
function groupMembers(pgid: number): string[] {
  const out: string[] = [];
  for (const name of readdirSync("/proc")) {
    if (!/^\d+$/.test(name)) continue;
    try {
      const stat = readFileSync(`/proc/${name}/stat`, "utf8");
      // Fields after the command (which may hold spaces and parentheses): state ppid pgrp ...
      const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
      if (fields[0] === "Z" || Number(fields[2]) !== pgid) continue;
      const cmd = readFileSync(`/proc/${name}/cmdline`, "utf8").replaceAll("\0", " ").trim();
      out.push(`${name} ${cmd.slice(0, 160)}`);
    } catch {
      // gone meanwhile
    }
  }
  return out;
}

async function leftoversOf(pgid: number, graceMs: number): Promise<string[]> {
  const deadline = performance.now() + graceMs;
  let left = groupMembers(pgid);
  while (left.length > 0 && performance.now() < deadline) {
    await new Promise((r) => setTimeout(r, 100));
    left = groupMembers(pgid);
  }
  return left;
}

const live = new Set<ChildProcess>();

/** Runs one command in its own process group; its whole output is kept (printed when it ends). */
function runJob(
  label: string,
  cmd: string,
  args: string[],
  limitMs: number,
  cwd: string,
  graceMs = LEFTOVER_GRACE_MS,
): Promise<Done> {
  const t0 = performance.now();
  return new Promise((resolve) => {
    // Own group: what the file started and left (an `up`, a QEMU) goes with it at the end.
    const child = spawn(cmd, args, { cwd, stdio: ["ignore", "pipe", "pipe"], detached: true });
    live.add(child);
    let out = "";
    let killed = false;
    const keep = (b: Buffer) => {
      out += b.toString();
      // A runaway printer is cut to its tail: the summary is at the end.
      if (out.length > 4_000_000) out = `[... cut ...]\n${out.slice(-1_000_000)}`;
    };
    child.stdout!.on("data", keep);
    child.stderr!.on("data", keep);
    const timer = setTimeout(() => {
      killed = true;
      killGroup(child);
    }, limitMs);
    child.on("close", async (code) => {
      clearTimeout(timer);
      const ms = performance.now() - t0;
      const leftover = killed || !child.pid ? [] : await leftoversOf(child.pid, graceMs);
      live.delete(child);
      killGroup(child);
      resolve({ label, code, out, ms, killed, leftover });
    });
  });
}

function killGroup(child: ChildProcess): void {
  try {
    if (child.pid) process.kill(-child.pid, "SIGKILL");
  } catch {
    // the group is already gone
  }
}

/** What a run works on; the defaults are this repository's. Tests of the runner pass their own. */
export interface RunnerDeps {
  root: string;
  /** The shared test data dir (SANDBOXD_TEST_DATA): the per-file times are recorded there. */
  dataDir: string;
  allowedSkips: AllowedSkip[];
  /** The script that builds the shared test cache before the first full-tier file. */
  warmCache: string;
  /** Where the output goes (the CLI's stdout). */
  write: (s: string) => void;
  /** How long a file's processes may outlive it before they count as left running. */
  leftoverGraceMs: number;
}

export function defaultRunnerDeps(): RunnerDeps {
  return {
    root: REPO_ROOT,
    dataDir: process.env.SANDBOXD_TEST_DATA ?? join(REPO_ROOT, ".data", "test"),
    allowedSkips: ALLOWED_SKIPS,
    warmCache: "tests/support/warm-cache.ts",
    write: (s) => process.stdout.write(s),
    leftoverGraceMs: LEFTOVER_GRACE_MS,
  };
}

/** What the run found, file by file: the counts, the problems and each file's time. */
class Tally {
  readonly total = { passed: 0, failed: 0, skipped: 0 };
  readonly problems: string[] = [];
  readonly fileTimes: { path: string; ms: number }[] = [];

  constructor(private readonly deps: RunnerDeps) {}

  fail(problem: string): void {
    this.total.failed++;
    this.problems.push(problem);
  }

  report(d: Done, body: string): void {
    this.deps.write(`\n=== ${d.label} (${(d.ms / 1000).toFixed(1)} s): ${body}\n${d.out.trimEnd()}\n`);
  }

  /** The type check or the lint: a check of its own, passed on exit 0. */
  onCheck(d: Done): void {
    if (d.code === 0) this.total.passed++;
    else this.fail(`${d.label} failed`);
    this.report(d, d.code === 0 ? "ok" : `FAILED (exit ${d.code})`);
  }

  /** The shared cache's build: not a test, but a failed build fails the run. */
  onCacheBuilt(d: Done): void {
    if (d.code !== 0) this.fail("building the shared test cache failed (tests/support/warm-cache.ts)");
    this.report(d, d.code === 0 ? "ok" : `FAILED (exit ${d.code})`);
  }

  onFile(f: TestFile, d: Done): void {
    const r = parseBunOutput(d.out);
    this.total.passed += r.passed;
    this.total.failed += r.failed;
    this.total.skipped += r.skipped;
    this.fileTimes.push({ path: f.path, ms: d.ms });
    const notes: string[] = [];
    if (d.killed) notes.push(`killed after ${FILE_LIMIT_MS / 60_000} min`);
    else if (!r.summarized || (d.code !== 0 && r.failed === 0))
      notes.push(`bun exited ${d.code} without a result`);
    if (d.leftover.length > 0) {
      notes.push(`left ${d.leftover.length} process(es) running: ${d.leftover.join("; ")}`);
    }
    if (notes.length > 0) this.total.failed++;
    for (const name of unallowedSkips(f.path, r.skippedNames, this.deps.allowedSkips)) {
      this.total.failed++;
      notes.push(`skipped and not on tests/allowed-skips.ts: ${name}`);
    }
    for (const n of notes) this.problems.push(`${f.path}: ${n}`);
    if (r.failed > 0) this.problems.push(`${f.path}: ${r.failed} failed`);
    for (const x of r.failures) this.problems.push(`  (fail) ${x.name}`, ...x.excerpt.map((l) => `    ${l}`));
    this.report(
      d,
      `${r.passed} pass, ${r.failed} fail, ${r.skipped} skip${notes.map((n) => `; ${n}`).join("")}`,
    );
  }
}

/** The checks (when the whole suite runs: the type check first, the longest quick step), then the files. */
function buildQueue(
  files: TestFile[],
  recorded: Record<string, number>,
  withChecks: boolean,
  deps: RunnerDeps,
  tally: Tally,
): Job[] {
  const bun = process.execPath;
  const queue: Job[] = [];
  if (withChecks) {
    const check = (label: string, args: string[]): Job => ({
      run: () => runJob(label, bun, args, FILE_LIMIT_MS, deps.root).then((d) => tally.onCheck(d)),
      exclusive: false,
      needsCache: false,
    });
    queue.push(check("typecheck", ["x", "tsc", "--noEmit", "-p", "."]));
    queue.push(check("lint", ["x", "biome", "check", "."]));
  }
  for (const f of schedule(files, recorded)) {
    queue.push({
      run: () =>
        runJob(
          f.path,
          bun,
          ["test", "--timeout", String(TEST_TIMEOUT_MS), `./${f.path}`],
          FILE_LIMIT_MS,
          deps.root,
          deps.leftoverGraceMs,
        ).then((d) => tally.onFile(f, d)),
      exclusive: f.exclusive,
      needsCache: f.tier === "full",
    });
  }
  return queue;
}

/** Files that are gone drop out; the rest keep their last time until they run again. */
function saveTimings(
  path: string,
  all: TestFile[],
  recorded: Record<string, number>,
  fileTimes: Tally["fileTimes"],
): void {
  const merged: Record<string, number> = {};
  for (const f of all) if (recorded[f.path] !== undefined) merged[f.path] = recorded[f.path]!;
  for (const t of fileTimes) merged[t.path] = Math.round(t.ms);
  try {
    mkdirSync(join(path, ".."), { recursive: true });
    writeFileSync(path, `${JSON.stringify(merged, Object.keys(merged).sort(), 2)}\n`);
  } catch {
    // a read-only data dir: the times are printed all the same
  }
}

export async function runTests(args: string[], deps: RunnerDeps = defaultRunnerDeps()): Promise<number> {
  const parsed = parseOptions(args);
  if (typeof parsed === "string") {
    process.stderr.write(parsed ? `sandboxd test: ${parsed}\n${USAGE}\n` : `${USAGE}\n`);
    return parsed ? 2 : 0;
  }
  const all = testFiles(deps.root);
  const files = select(all, parsed);
  if (files.length === 0) {
    process.stderr.write(`sandboxd test: no test file matches ${parsed.filters.join(" ")}\n`);
    return 2;
  }
  const jobs = parsed.jobs ?? (parsed.quick ? 2 : 3);
  const timings = timingsPaths(deps.root, deps.dataDir);
  const recorded = readTimings(timings.read);
  const withChecks = parsed.filters.length === 0;
  const t0 = performance.now();
  deps.write(
    `sandboxd test: ${files.length} files (${parsed.quick ? "quick tier" : "full"}), ${jobs} at a time` +
      `${withChecks ? ", with the type check and the lint" : ""}\n`,
  );
  const tally = new Tally(deps);
  for (const p of misplaced(files.map((f) => f.path)))
    tally.fail(`${p}: a test file outside tests/{integration,style,vm,e2e,perf}/ (put it in one)`);

  const queue = buildQueue(files, recorded, withChecks, deps, tally);
  const stop = () => {
    for (const c of live) killGroup(c);
    process.exit(130);
  };
  process.once("SIGINT", stop);
  process.once("SIGTERM", stop);
  // The shared cache is built once, beside the quick files, before any VM file takes it.
  const cache = queue.some((j) => j.needsCache)
    ? () =>
        runJob("shared test cache", process.execPath, [deps.warmCache], FILE_LIMIT_MS, deps.root).then((d) =>
          tally.onCacheBuilt(d),
        )
    : undefined;
  await runPool(queue, jobs, cache);
  process.off("SIGINT", stop);
  process.off("SIGTERM", stop);

  saveTimings(timings.write, all, recorded, tally.fileTimes);
  const wallS = ((performance.now() - t0) / 1000).toFixed(1);
  deps.write(`\nslowest ${SLOWEST_SHOWN} files:\n${slowest(tally.fileTimes, SLOWEST_SHOWN).join("\n")}\n`);
  if (tally.problems.length > 0)
    deps.write(`\nproblems:\n${tally.problems.map((p) => `  ${p}`).join("\n")}\n`);
  deps.write(`\nwall time ${wallS} s, ${jobs} files at a time\n${summaryLine(tally.total)}\n`);
  return tally.total.failed === 0 ? 0 : 1;
}
