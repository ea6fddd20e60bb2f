import { afterAll, describe, expect, test } from "bun:test";
import { existsSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { StorageError } from "./chain.ts";
import { createOverlayOn, virtualSize } from "./qcow2.ts";

const dir = mkdtempSync(join(tmpdir(), "qcow2-test-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

function info(path: string): Record<string, unknown> {
  return JSON.parse(
    Bun.spawnSync(["qemu-img", "info", "-U", "--output=json", path]).stdout.toString(),
  ) as Record<string, unknown>;
}

describe("createOverlayOn", () => {
  const base = join(dir, "base.qcow2");
  Bun.spawnSync(["qemu-img", "create", "-q", "-f", "qcow2", base, "16M"]);

  test("without a size: a qcow2 backed by its base, with the base's size", async () => {
    const overlay = join(dir, "overlay.qcow2");
    await createOverlayOn(base, overlay);
    expect(existsSync(overlay)).toBe(true);
    const i = info(overlay);
    expect(i["backing-filename"]).toBe(base);
    expect(i["backing-filename-format"]).toBe("qcow2");
    expect(await virtualSize(overlay)).toBe(16 * 1024 * 1024);
  });

  test("with a size: the base is not opened (-u), the size is the one given", async () => {
    const overlay = join(dir, "sized.qcow2");
    await createOverlayOn(join(dir, "no-such-base.qcow2"), overlay, 32 * 1024 * 1024);
    expect(info(overlay)["backing-filename"]).toBe(join(dir, "no-such-base.qcow2"));
    expect(info(overlay)["virtual-size"]).toBe(32 * 1024 * 1024);
  });

  test("a failing qemu-img is a StorageError with its reason, the ToolError as cause", async () => {
    const err = await createOverlayOn(join(dir, "no-such-base.qcow2"), join(dir, "x.qcow2")).catch(
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(StorageError);
    expect((err as StorageError).code).toBe("storage_error");
    expect((err as StorageError).message).toMatch(/^qemu-img create .* failed \(exit 1\): .*no-such-base/);
    expect((err as StorageError).cause).toBeDefined();
  });

  test("paths with ',' are refused before qemu-img runs", async () => {
    await expect(createOverlayOn(base, join(dir, "a,b.qcow2"))).rejects.toBeInstanceOf(StorageError);
  });
});
