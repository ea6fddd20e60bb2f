import { expect, test } from "bun:test";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { asNoSpace, bytesSetting, freeBytes, isNoSpace, requireFreeSpace } from "./disk-space.ts";
import { SandboxdError } from "./errors.ts";

test("free bytes of a path not yet created are those of its nearest existing parent", async () => {
  const free = await freeBytes(tmpdir());
  expect(free).toBeGreaterThan(0);
  const deep = await freeBytes(join(tmpdir(), "no-such-dir", "deeper", "file"));
  expect(Math.abs(deep - free)).toBeLessThan(64 * 1024 * 1024);
});

test("a write that fits with the reserve passes; one that does not is insufficient_storage, nothing written", async () => {
  await requireFreeSpace(tmpdir(), { what: "a small file", bytes: 1024, reserveBytes: 0 });
  const free = await freeBytes(tmpdir());
  const err = await requireFreeSpace(tmpdir(), {
    what: "the image upload",
    bytes: 1024,
    reserveBytes: free,
  }).catch((e) => e);
  expect(err).toBeInstanceOf(SandboxdError);
  expect(err.code).toBe("insufficient_storage");
  expect(err.message).toStartWith("not enough disk space for the image upload: ");
  expect(err.details).toMatchObject({ needBytes: 1024, reserveBytes: free });
});

test("ENOSPC and EDQUOT, as errno or as a tool's text, are a full disk; other errors pass through", () => {
  const enospc = Object.assign(new Error("write failed"), { code: "ENOSPC" });
  expect(isNoSpace(enospc)).toBe(true);
  expect(isNoSpace(new Error("outer", { cause: Object.assign(new Error("x"), { code: "EDQUOT" }) }))).toBe(
    true,
  );
  expect(isNoSpace("mkfs.ext4: No space left on device while writing")).toBe(true);
  expect(isNoSpace(new Error("permission denied"))).toBe(false);
  const mapped = asNoSpace(enospc, "suspending") as SandboxdError;
  expect(mapped.code).toBe("insufficient_storage");
  expect(mapped.cause).toBe(enospc);
  const other = new Error("boom");
  expect(asNoSpace(other, "x")).toBe(other);
});

test("byte settings: default, a count, junk refused", () => {
  expect(bytesSetting({}, "X", 7)).toBe(7);
  expect(bytesSetting({ X: "1048576" }, "X", 1)).toBe(1048576);
  expect(() => bytesSetting({ X: "12MB" }, "X", 1)).toThrow(/X must be a byte count/);
  expect(() => bytesSetting({ X: "-1" }, "X", 1)).toThrow();
});
