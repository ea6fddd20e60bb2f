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

export const Expected = z.object({
  maxFailed: z.number().int().nonnegative(),
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

/** What is over the bound, in words; empty when the run is within it. */
export function overBound(r: SuiteResult, bound: Expected): string[] {
  const over: string[] = [];
  if (r.failed > bound.maxFailed) over.push(`${r.failed} tests failed, at most ${bound.maxFailed} expected`);
  if (r.failedFiles.length > bound.maxFailedFiles) {
    over.push(`${r.failedFiles.length} files failed to run, at most ${bound.maxFailedFiles} expected`);
  }
  return over;
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
