/**
 * Reads vitest's JSON report (its jest-compatible `json` reporter) of E2B's SDK suite into counts
 * per file and in all, and checks them against tests/e2b-sdk/expected.json. Test code only.
 */
import { relative } from "node:path";
import { z } from "zod";

const Assertion = z.object({
  fullName: z.string(),
  status: z.string(),
  failureMessages: z.array(z.string()).default([]),
});
const FileResult = z.object({
  name: z.string(),
  status: z.string(),
  message: z.string().default(""),
  assertionResults: z.array(Assertion),
});
const Report = z.object({ testResults: z.array(FileResult) });

/** A test allowed to fail, by its `file > full name`, and why (the closing of the gap it names). */
const Allowed = z.object({ test: z.string().min(1), why: z.string().min(1) });
export const Expected = z.object({
  /** Tests that fail against sandboxd today, each for a stated difference from E2B. */
  knownFailures: z.array(Allowed),
  /** Tests that pass but may fail on a loaded host (a fixed wait shorter than TCG needs). */
  flaky: z.array(Allowed),
  maxFailedFiles: z.number().int().nonnegative(),
});
export type Expected = z.infer<typeof Expected>;

export interface Counts {
  passed: number;
  failed: number;
  skipped: number;
}

export interface SuiteResult extends Counts {
  /** Files that failed without a failed test: they did not load or a hook failed. */
  failedFiles: { file: string; message: string }[];
  files: Record<string, Counts>;
  /** Each failed test: `file > full name`, and its message's first line. */
  failures: { test: string; message: string }[];
}

/** vitest's statuses: passed, failed, skipped, pending, todo, disabled. */
function bucket(status: string): keyof Counts {
  if (status === "passed") return "passed";
  if (status === "failed") return "failed";
  return "skipped";
}

const firstLine = (s: string) => (s.split("\n").find((l) => l.trim() !== "") ?? "").slice(0, 300);

/** The counts of a report; file names relative to `root` (the upstream directory). */
export function summarise(json: unknown, root: string): SuiteResult {
  const report = Report.parse(json);
  const out: SuiteResult = { passed: 0, failed: 0, skipped: 0, failedFiles: [], files: {}, failures: [] };
  for (const f of report.testResults) {
    const file = relative(root, f.name);
    const counts: Counts = { passed: 0, failed: 0, skipped: 0 };
    for (const a of f.assertionResults) {
      const b = bucket(a.status);
      counts[b]++;
      out[b]++;
      if (b === "failed")
        out.failures.push({
          test: `${file} > ${a.fullName}`,
          message: firstLine(a.failureMessages.join("\n")),
        });
    }
    out.files[file] = counts;
    if (f.status === "failed" && counts.failed === 0)
      out.failedFiles.push({ file, message: firstLine(f.message) });
  }
  return out;
}

/**
 * What is over the bound, in words; empty when the run is within it: every failed test must be a
 * known failure or a flaky one, so any other failure (a regression) is named here.
 */
export function overBound(r: SuiteResult, bound: Expected): string[] {
  const over: string[] = [];
  const allowed = new Set([...bound.knownFailures, ...bound.flaky].map((a) => a.test));
  for (const f of r.failures)
    if (!allowed.has(f.test)) over.push(`a test failed that is not expected to: ${f.test}: ${f.message}`);
  if (r.failedFiles.length > bound.maxFailedFiles) {
    over.push(`${r.failedFiles.length} files failed to run, at most ${bound.maxFailedFiles} expected`);
  }
  return over;
}

/** Known failures that passed in this run: the list can shrink. */
export function nowPassing(r: SuiteResult, bound: Expected): string[] {
  const failed = new Set(r.failures.map((f) => f.test));
  return bound.knownFailures.map((a) => a.test).filter((t) => !failed.has(t));
}

/** A table of the counts per file and the totals, for the runner's output. */
export function formatCounts(r: SuiteResult): string {
  const names = Object.keys(r.files).sort();
  const width = Math.max(4, ...names.map((n) => n.length));
  const row = (name: string, c: Counts) =>
    `${name.padEnd(width)}  ${String(c.passed).padStart(4)}  ${String(c.failed).padStart(4)}  ${String(c.skipped).padStart(4)}`;
  return [
    `${"file".padEnd(width)}  pass  fail  skip`,
    ...names.map((n) => row(n, r.files[n]!)),
    row("TOTAL", r),
  ].join("\n");
}
