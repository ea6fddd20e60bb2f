import { expect, test } from "bun:test";
import { describeError, SandboxdError } from "./errors.ts";

test("describeError walks the cause chain with codes", () => {
  const inner = new Error("disk full");
  const err = new SandboxdError("suspend_failed", "saving the VM failed", { cause: inner });
  expect(describeError(err)).toBe("saving the VM failed [suspend_failed]: caused by: disk full");
});

test("a cause whose message the parent already quotes is not repeated", () => {
  const tool = new Error("mkfs.ext4 failed (exit 1): no space left on device");
  const err = new SandboxdError("image_tool_failed", "mkfs.ext4 failed (exit 1): no space left on device", {
    cause: tool,
  });
  expect(describeError(err)).toBe("mkfs.ext4 failed (exit 1): no space left on device [image_tool_failed]");
});

test("non-Error causes and depth are bounded", () => {
  let e: unknown = "root";
  for (let i = 0; i < 10; i++) e = new Error(`level ${i}`, { cause: e });
  expect(describeError(e).split(": caused by: ")).toHaveLength(5);
});
