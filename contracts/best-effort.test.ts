import { expect, test } from "bun:test";
import { awaitedLater, bestEffort, ifExists, settled } from "./best-effort.ts";
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

test("settled waits for either outcome and never throws", async () => {
  let done = false;
  await settled(
    new Promise((_, reject) =>
      setTimeout(() => {
        done = true;
        reject(new Error("x"));
      }, 5),
    ),
  );
  expect(done).toBe(true);
  await settled(Promise.resolve(1));
});

test("awaitedLater keeps the rejection for whoever awaits the promise", async () => {
  const p = Promise.reject(new Error("later"));
  awaitedLater(p);
  await Bun.sleep(1);
  await expect(p).rejects.toThrow("later");
});

test("ifExists: a missing path is undefined, any other error is thrown", async () => {
  const { readFile } = await import("node:fs/promises");
  expect(await ifExists(readFile("/nonexistent-dir/x"))).toBeUndefined();
  expect(await ifExists(Promise.resolve(3))).toBe(3);
  await expect(ifExists(readFile("/proc/self/mem"))).rejects.toThrow();
  await expect(ifExists(Promise.reject(new Error("EACCES-like")))).rejects.toThrow("EACCES-like");
});
