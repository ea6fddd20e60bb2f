import { afterAll, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createOverlayOn } from "../storage/qcow2.ts";
import { backingChain } from "./jail-setup.ts";

const dir = mkdtempSync(join(tmpdir(), "jail-setup-test-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** The chain base <- mid <- top, real qcow2 images made by qemu-img. */
async function chainOf(tag: string): Promise<{ base: string; mid: string; top: string }> {
  const base = join(dir, `${tag}-base.qcow2`);
  const mid = join(dir, `${tag}-mid.qcow2`);
  const top = join(dir, `${tag}-top.qcow2`);
  expect(Bun.spawnSync(["qemu-img", "create", "-q", "-f", "qcow2", base, "8M"]).exitCode).toBe(0);
  await createOverlayOn(base, mid);
  await createOverlayOn(mid, top);
  return { base, mid, top };
}

/** What a jail holding `img` can do to it: rename its backing file in the header (nothing opened). */
function rewriteBacking(img: string, to: string): void {
  const r = Bun.spawnSync(["qemu-img", "rebase", "-u", "-f", "qcow2", "-F", "qcow2", "-b", to, img]);
  expect(r.exitCode).toBe(0);
}

describe("backingChain", () => {
  test("the headers' chain, nearest first, and the top's virtual size", async () => {
    const { base, mid, top } = await chainOf("plain");
    const c = await backingChain(top, new Set([mid, base]));
    expect(c.files).toEqual([mid, base]);
    expect(c.virtualSize).toBe(8 * 1024 * 1024);
    expect(c.foreign).toBeUndefined();
  });

  test("a name outside the allowed set ends the walk unopened (a FIFO there would block an open)", async () => {
    const { base, mid, top } = await chainOf("fifo");
    const fifo = join(dir, "canary.fifo");
    expect(Bun.spawnSync(["mkfifo", fifo]).exitCode).toBe(0);
    rewriteBacking(mid, fifo);
    const c = await backingChain(top, new Set([mid, base]));
    expect(c.files).toEqual([mid, fifo]);
    expect(c.foreign).toBe(fifo);
  });

  test("without an allowed set every name is followed (the check above can fail)", async () => {
    const { mid, top } = await chainOf("open");
    const elsewhere = join(dir, "open-elsewhere.qcow2");
    expect(Bun.spawnSync(["qemu-img", "create", "-q", "-f", "qcow2", elsewhere, "8M"]).exitCode).toBe(0);
    rewriteBacking(mid, elsewhere);
    const c = await backingChain(top);
    expect(c.files).toEqual([mid, elsewhere]);
    expect(c.foreign).toBeUndefined();
  });

  test("a header asking for an external data file is refused", async () => {
    const img = join(dir, "datafile.qcow2");
    const data = join(dir, "datafile.raw");
    const r = Bun.spawnSync([
      "qemu-img",
      "create",
      "-q",
      "-f",
      "qcow2",
      "-o",
      `data_file=${data}`,
      img,
      "8M",
    ]);
    expect(r.exitCode).toBe(0);
    const c = await backingChain(img, new Set());
    expect(c.foreign).toBe(`${img} (an external data file)`);
  });
});
