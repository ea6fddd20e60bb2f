import { describe, expect, test } from "bun:test";
import { ToolError } from "../host/tool.ts";
import { ImageError } from "./errors.ts";
import { runImageTool } from "./tools.ts";

async function failure(p: Promise<unknown>): Promise<ImageError> {
  try {
    await p;
  } catch (e) {
    if (e instanceof ImageError) return e;
    throw e;
  }
  throw new Error("expected an ImageError");
}

describe("runImageTool", () => {
  test("exit 0 resolves; the argv is logged under image:", async () => {
    const lines: string[] = [];
    await runImageTool(["sh", "-c", "exit 0"], { log: (m) => lines.push(m) });
    expect(lines).toEqual(["image: run: sh -c exit 0"]);
  });

  test("a failing tool is image_tool_failed with its last line, the ToolError as cause", async () => {
    const e = await failure(
      runImageTool(["sh", "-c", "echo noise; echo 'the reason' >&2; exit 3"], { log: () => {} }),
    );
    expect(e.code).toBe("image_tool_failed");
    expect(e.message).toBe("sh failed (exit 3): the reason");
    expect(e.details).toMatchObject({ tool: "sh", exitCode: 3 });
    expect(e.cause).toBeInstanceOf(ToolError);
  });

  test("a missing tool and a deadline are image_tool_failed too", async () => {
    const missing = await failure(runImageTool(["/nonexistent/tool-xyz"], { log: () => {} }));
    expect(missing.code).toBe("image_tool_failed");
    expect(missing.message).toBe("cannot run /nonexistent/tool-xyz");
    const slow = await failure(runImageTool(["sleep", "30"], { log: () => {}, timeoutMs: 1000 }));
    expect(slow.code).toBe("image_tool_failed");
    expect(slow.message).toBe("sleep: no answer within 1 s");
  });

  test("env reaches the tool on top of the agent's own", async () => {
    // The tool fails (exit 1, a throw) unless it sees both; the same check against another value
    // fails, so the check itself can.
    const run = (want: string) =>
      runImageTool(["sh", "-c", `test "$TMPDIR" = ${want} && test -n "$PATH"`], {
        env: { TMPDIR: "/x" },
        log: () => {},
      });
    await expect(run("/x")).resolves.toBeUndefined();
    await expect(run("/y")).rejects.toThrow();
  });
});
