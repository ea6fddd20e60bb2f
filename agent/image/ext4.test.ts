import { describe, expect, test } from "bun:test";
import fc from "fast-check";
import { DEFAULT_DISK_SIZING, diskSizeFor } from "./ext4.ts";

describe("disk sizing", () => {
  test("max(256 MiB, 1.5x + 128 MiB), in whole MiB", () => {
    const MiB = 1024 * 1024;
    expect(diskSizeFor(0)).toBe(256 * MiB);
    expect(diskSizeFor(50 * MiB)).toBe(256 * MiB);
    expect(diskSizeFor(1024 * MiB)).toBe(1536 * MiB + 128 * MiB);
    expect(diskSizeFor(1)).toBe(256 * MiB);
    expect(diskSizeFor(100 * MiB, { ...DEFAULT_DISK_SIZING, minBytes: 0, factor: 2, headroomBytes: 0 })).toBe(
      200 * MiB,
    );
    fc.assert(
      fc.property(fc.nat({ max: 2 ** 40 }), (n) => {
        const s = diskSizeFor(n);
        return s % MiB === 0 && s >= 1.5 * n + 128 * MiB && s >= 256 * MiB;
      }),
    );
  });
});
