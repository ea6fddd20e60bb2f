import { afterAll, describe, expect, test } from "bun:test";
import { existsSync, mkdtempSync, readFileSync, rmSync, statSync, utimesSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { StorageError } from "./chain.ts";
import { createOverlayOn, flattenOnto, virtualSize } from "./qcow2.ts";

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

describe("flattenOnto", () => {
  /** Writes `byte` over `len` bytes at `offset` of a qcow2 through qemu-io (a real guest write). */
  function write(img: string, byte: number, offset: number, len: number): void {
    const r = Bun.spawnSync(["qemu-io", "-f", "qcow2", "-c", `write -P ${byte} ${offset} ${len}`, img]);
    expect(r.exitCode).toBe(0);
  }
  /** True when `len` bytes at `offset` of `img` (its whole chain) all equal `byte`. */
  function holds(img: string, byte: number, offset: number, len: number): boolean {
    const r = Bun.spawnSync([
      "qemu-io",
      "-r",
      "-U",
      "-f",
      "qcow2",
      "-c",
      `read -P ${byte} ${offset} ${len}`,
      img,
    ]);
    return r.exitCode === 0 && !r.stdout.toString().includes("Pattern verification failed");
  }

  test("keeps the data of every layer between top and base, not only top's own", async () => {
    const base = join(dir, "fl-base.qcow2");
    Bun.spawnSync(["qemu-img", "create", "-q", "-f", "qcow2", base, "8M"]);
    write(base, 0x11, 0, 65536);
    // Three layers, each writing its own cluster: a chain like a fork of a fork of a fork.
    const layers = [1, 2, 3].map((i) => join(dir, `fl-${i}.qcow2`));
    let below = base;
    for (const [i, layer] of layers.entries()) {
      await createOverlayOn(below, layer);
      write(layer, 0x20 + i, (i + 1) * 65536, 65536);
      below = layer;
    }
    const top = layers[2] as string;
    const out = join(dir, "fl-out.qcow2");
    await flattenOnto(top, [layers[1] as string, layers[0] as string, base], out, 8 * 1024 * 1024);
    expect(info(out)["backing-filename"]).toBe(base);
    expect(holds(out, 0x11, 0, 65536)).toBe(true); // the base's data, through the backing link
    expect(holds(out, 0x20, 65536, 65536)).toBe(true); // the lowest layer: what convert -B lost
    expect(holds(out, 0x21, 2 * 65536, 65536)).toBe(true);
    expect(holds(out, 0x22, 3 * 65536, 65536)).toBe(true);
    // The flat copy stands alone: the layers may go.
    for (const layer of layers) rmSync(layer);
    expect(holds(out, 0x20, 65536, 65536)).toBe(true);
    expect(holds(out, 0x22, 3 * 65536, 65536)).toBe(true);
    // The check itself can fail: a wrong pattern is seen.
    expect(holds(out, 0x21, 65536, 65536)).toBe(false);
  });

  test("follows the chain it is given, never a backing name a layer's header was rewritten to", async () => {
    const base = join(dir, "hd-base.qcow2");
    Bun.spawnSync(["qemu-img", "create", "-q", "-f", "qcow2", base, "8M"]);
    const mid = join(dir, "hd-mid.qcow2");
    const top = join(dir, "hd-top.qcow2");
    await createOverlayOn(base, mid);
    write(mid, 0x44, 65536, 65536);
    await createOverlayOn(mid, top);
    // The canary stands for a host file; an atime before its mtime moves on any read (relatime).
    const canary = join(dir, "hd-canary");
    writeFileSync(canary, "canary\n");
    const old = new Date("2001-01-01T00:00:00Z");
    utimesSync(canary, old, new Date());
    // What a jail holding `top` can do: rename its backing file in the header.
    const rebase = ["qemu-img", "rebase", "-u", "-f", "qcow2", "-F", "qcow2", "-b", canary, top];
    expect(Bun.spawnSync(rebase).exitCode).toBe(0);
    expect(info(top)["backing-filename"]).toBe(canary);
    const out = join(dir, "hd-out.qcow2");
    await flattenOnto(top, [mid, base], out, 8 * 1024 * 1024);
    expect(holds(out, 0x44, 65536, 65536)).toBe(true); // mid's data, as the records say
    expect(statSync(canary).atimeMs).toBe(old.getTime());
    expect(readFileSync(canary, "utf8")).toBe("canary\n");
    // The check can fail: qemu-img left to the header reads the canary (and refuses it).
    const own = join(dir, "hd-own.qcow2");
    await createOverlayOn(top, own, 8 * 1024 * 1024);
    Bun.spawnSync(["qemu-img", "rebase", "-U", "-q", "-f", "qcow2", "-F", "qcow2", "-b", base, own]);
    expect(statSync(canary).atimeMs).not.toBe(old.getTime());
  });
});
