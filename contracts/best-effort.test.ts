import { expect, test } from "bun:test";
import { bestEffort } from "./best-effort.ts";
import { SandboxdError } from "./errors.ts";

test("a failed step is logged with what it was and why, and does not throw", async () => {
  const lines: string[] = [];
  const ok = await bestEffort(
    (m) => lines.push(m),
    "destroying VM sbx_1",
    Promise.reject(new SandboxdError("vm_died", "QEMU exited")),
  );
  expect(ok).toBe(false);
  expect(lines).toHaveLength(1);
  expect(lines[0]).toStartWith("destroying VM sbx_1 failed: ");
  expect(lines[0]).toContain("QEMU exited");
});

test("a function that throws before it returns a promise is caught the same way", async () => {
  const lines: string[] = [];
  const ok = await bestEffort(
    (m) => lines.push(m),
    "step",
    () => {
      throw new Error("at once");
    },
  );
  expect(ok).toBe(false);
  expect(lines[0]).toContain("at once");
});

test("a step that succeeds logs nothing", async () => {
  const lines: string[] = [];
  expect(
    await bestEffort(
      (m) => lines.push(m),
      "step",
      async () => 1,
    ),
  ).toBe(true);
  expect(lines).toEqual([]);
});
