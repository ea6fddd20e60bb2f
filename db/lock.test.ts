/** The one-opener lock of a PGlite directory (lock.ts), on a real file system. */
import { afterAll, expect, test } from "bun:test";
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { SandboxdError } from "../contracts/errors.ts";
import { lockDir } from "./lock.ts";

const root = mkdtempSync(join(tmpdir(), "sbx-lock-"));
afterAll(() => rmSync(root, { recursive: true, force: true }));

test("one holder at a time; the lock file always names it, and nothing else is left beside it", () => {
  const dir = join(root, "a");
  const held = lockDir(dir);
  // Written beside and linked into place: never an empty lock file a racing opener could judge stale.
  const holder = JSON.parse(readFileSync(`${dir}.lock`, "utf8")) as { pid: number };
  expect(holder.pid).toBe(process.pid);
  expect(readdirSync(root)).toEqual(["a.lock"]);
  // This process is alive: a second opener is refused, naming it, and leaves nothing behind.
  const second = (() => {
    try {
      lockDir(dir);
    } catch (err) {
      return err;
    }
  })();
  expect(second).toBeInstanceOf(SandboxdError);
  expect((second as SandboxdError).code).toBe("conflict");
  expect((second as SandboxdError).message).toContain(`in use by process ${process.pid}`);
  expect(readdirSync(root)).toEqual(["a.lock"]);
  held.release();
  expect(existsSync(`${dir}.lock`)).toBe(false);
  lockDir(dir).release();
});

test("a lock left by a process that is gone, or an unreadable one, is taken over", () => {
  for (const [name, content] of [
    ["dead", JSON.stringify({ pid: 2 ** 22 + 7, start: "1", nonce: "0123456789abcdef", cmd: "gone" })],
    ["garbled", "{not json"],
  ] as const) {
    const dir = join(root, name);
    writeFileSync(`${dir}.lock`, content);
    const held = lockDir(dir);
    expect((JSON.parse(readFileSync(`${dir}.lock`, "utf8")) as { pid: number }).pid).toBe(process.pid);
    held.release();
  }
  expect(readdirSync(root)).toEqual([]);
});
