import { describe, expect, test } from "bun:test";
import { existsSync, readFileSync, rmSync } from "node:fs";
import { runTool, ToolError } from "./tool.ts";

async function failure(p: Promise<unknown>): Promise<ToolError> {
  try {
    await p;
  } catch (e) {
    if (e instanceof ToolError) return e;
    throw e;
  }
  throw new Error("expected a ToolError");
}

describe("runTool", () => {
  test("returns stdout and the stderr tail on exit 0", async () => {
    const r = await runTool(["sh", "-c", "printf out; printf err >&2"]);
    expect(r.stdout.toString()).toBe("out");
    expect(r.stderr).toBe("err");
  });

  test("a non-zero exit is kind exit with the tool's last line as reason", async () => {
    const e = await failure(runTool(["sh", "-c", "echo first >&2; echo 'the reason' >&2; exit 3"]));
    expect(e.kind).toBe("exit");
    expect(e.details.exitCode).toBe(3);
    expect(e.reason).toBe("the reason");
    expect(e.message).toBe("sh failed (exit 3): the reason");
  });

  test("a missing binary is kind spawn", async () => {
    const e = await failure(runTool(["/nonexistent/tool-xyz"]));
    expect(e.kind).toBe("spawn");
  });

  test("the deadline kills the whole process group", async () => {
    const marker = `/tmp/sandboxd-tool-test-${process.pid}`;
    const pidFile = `${marker}.pid`;
    const started = performance.now();
    // The grandchild writes its pid (whole: a rename), and would create the marker after 1 s
    // if the group kill missed it.
    const grandchild = `sh -c 'echo $$ > ${pidFile}.tmp && mv ${pidFile}.tmp ${pidFile}; sleep 1; touch ${marker}'`;
    const e = await failure(runTool(["sh", "-c", `${grandchild} & sleep 30`], { timeoutMs: 200 }));
    expect(e.kind).toBe("timeout");
    // Only catches a hang: without the deadline the tool runs its 30 s.
    expect(performance.now() - started).toBeLessThan(15_000);
    // The grandchild is gone too (or was killed before it wrote its pid), and made nothing.
    if (existsSync(pidFile)) {
      const pid = Number(readFileSync(pidFile, "utf8"));
      rmSync(pidFile);
      // Gone, or a zombie nobody reaped yet (it runs nothing).
      const gone = () => {
        try {
          const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
          return stat.slice(stat.lastIndexOf(")") + 2).startsWith("Z");
        } catch {
          return true;
        }
      };
      for (const end = performance.now() + 10_000; !gone() && performance.now() < end; ) await Bun.sleep(20);
      expect(gone()).toBe(true);
    }
    expect(existsSync(marker)).toBe(false);
  });

  test("an abort signal cancels a running tool", async () => {
    const ac = new AbortController();
    setTimeout(() => ac.abort(), 100);
    const e = await failure(runTool(["sleep", "30"], { signal: ac.signal }));
    expect(e.kind).toBe("aborted");
  });

  test("stdout beyond the cap fails instead of growing without bound", async () => {
    const e = await failure(runTool(["sh", "-c", "head -c 200000 /dev/zero"], { maxStdoutBytes: 1000 }));
    expect(e.kind).toBe("output_too_large");
  });

  test("stdin input reaches the tool; env is passed", async () => {
    const r = await runTool(["sh", "-c", 'cat; printf "$X"'], { input: "in-", env: { X: "env" } });
    expect(r.stdout.toString()).toBe("in-env");
  });
});
