/**
 * The project's one test command (README): type check, lint, then every bun test file.
 * Prints a last line `N passed, N failed` that CI reads; exits non-zero when anything failed.
 * The type check and the lint each count as one test.
 */
import { spawn } from "node:child_process";
import { REPO_ROOT } from "./config.ts";

interface StepResult {
  passed: number;
  failed: number;
}

function runStep(
  label: string,
  cmd: string,
  args: string[],
  env?: NodeJS.ProcessEnv,
): Promise<{ code: number; out: string }> {
  process.stdout.write(`\n=== ${label}: ${cmd} ${args.join(" ")}\n`);
  return new Promise((resolve) => {
    const child = spawn(cmd, args, {
      cwd: REPO_ROOT,
      env: env ?? process.env,
      stdio: ["ignore", "pipe", "pipe"],
    });
    let out = "";
    const onData = (buf: Buffer, to: NodeJS.WriteStream) => {
      const s = buf.toString();
      out += s;
      // Keep only the tail in memory: the summary lines are at the end.
      if (out.length > 1_000_000) out = out.slice(-200_000);
      to.write(s);
    };
    child.stdout.on("data", (b: Buffer) => onData(b, process.stdout));
    child.stderr.on("data", (b: Buffer) => onData(b, process.stderr));
    child.on("close", (code) => resolve({ code: code ?? 1, out }));
  });
}

export async function runTests(extraArgs: string[]): Promise<number> {
  const bun = process.execPath;
  const total: StepResult = { passed: 0, failed: 0 };
  const only = extraArgs.length > 0;
  if (!only) {
    const tsc = await runStep("typecheck", bun, ["x", "tsc", "--noEmit", "-p", "."]);
    tsc.code === 0 ? total.passed++ : total.failed++;
    const lint = await runStep("lint", bun, ["x", "biome", "check", "."]);
    lint.code === 0 ? total.passed++ : total.failed++;
  }
  // VM tests boot real QEMU under TCG: a single test may take tens of seconds (comment in each).
  const tests = await runStep("tests", bun, ["test", "--timeout", "180000", ...extraArgs]);
  const pass = /^\s*(\d+) pass$/m.exec(tests.out);
  const fail = /^\s*(\d+) fail$/m.exec(tests.out);
  if (pass || fail) {
    total.passed += Number(pass?.[1] ?? 0);
    total.failed += Number(fail?.[1] ?? 0);
  }
  // A runner that crashed before its summary still counts as a failure.
  if (tests.code !== 0 && !fail?.[1]) total.failed++;
  if (tests.code !== 0 && fail?.[1] === "0") total.failed++;
  process.stdout.write(`\n${total.passed} passed, ${total.failed} failed\n`);
  return total.failed === 0 ? 0 : 1;
}
