import { afterAll, describe, expect, test } from "bun:test";
import { spawnSync } from "node:child_process";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { extractVmlinux, GuestArtifactsError, modinfoDepends, writeNewc } from "./artifacts.ts";

const dir = mkdtempSync(join(tmpdir(), "artifacts-test-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

describe("initramfs pieces", () => {
  test("writeNewc output is read back by cpio(1), device node included", () => {
    const cpio = writeNewc([
      { name: "dev", mode: 0o040755 },
      { name: "dev/console", mode: 0o020600, rdevMajor: 5, rdevMinor: 1 },
      { name: "etc", mode: 0o040755 },
      { name: "etc/x", mode: 0o100644, data: Buffer.from("abc") },
      { name: "init", mode: 0o100755, data: Buffer.from("12345") },
    ]);
    expect(cpio.length % 4).toBe(0);
    const r = spawnSync("cpio", ["-itv", "--quiet"], { input: cpio, encoding: "utf8" });
    expect(r.status).toBe(0);
    const lines = r.stdout.trim().split("\n");
    expect(lines.map((l) => l.split(/\s+/).pop())).toEqual(["dev", "dev/console", "etc", "etc/x", "init"]);
    expect(lines[1]).toMatch(/^crw-------.* 5,\s+1 /);
    expect(lines[4]).toMatch(/^-rwxr-xr-x/);
    const x = spawnSync("cpio", ["-i", "--quiet", "--to-stdout", "etc/x"], { input: cpio });
    expect(x.stdout.toString()).toBe("abc");
  });

  test("modinfoDepends reads the NUL-separated depends= field", () => {
    const ko = Buffer.concat([
      Buffer.from("\x7fELF...\0license=GPL\0depends=virtio,virtio-ring\0name=virtio_blk\0"),
    ]);
    expect(modinfoDepends(ko)).toEqual(["virtio", "virtio_ring"]);
    expect(modinfoDepends(Buffer.from("\0depends=\0name=x\0"))).toEqual([]);
    expect(modinfoDepends(Buffer.from("nothing"))).toEqual([]);
  });
});

describe("extractVmlinux", () => {
  // A bzImage in miniature: a header, the LZ4 legacy payload (an ELF), then trailing bytes, which
  // make lz4 exit 1 although the payload decompressed whole.
  const elf = readFileSync("/bin/true");
  const lz4 = spawnSync("lz4", ["-l", "-c"], { input: elf }).stdout;

  test("finds the LZ4 payload and decompresses it despite the data after it", async () => {
    const vmlinuz = join(dir, "vmlinuz");
    writeFileSync(vmlinuz, Buffer.concat([Buffer.alloc(512, 7), lz4, Buffer.alloc(4096, 0xa5)]));
    const out = join(dir, "out", "vmlinux");
    await extractVmlinux(vmlinuz, out);
    expect(readFileSync(out).equals(elf)).toBe(true);
  });

  test("a payload that is not an ELF is refused", async () => {
    const notElf = spawnSync("lz4", ["-l", "-c"], { input: Buffer.alloc(4096, 1) }).stdout;
    const vmlinuz = join(dir, "vmlinuz-bad");
    writeFileSync(vmlinuz, Buffer.concat([Buffer.alloc(64), notElf]));
    const err = await extractVmlinux(vmlinuz, join(dir, "bad")).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(GuestArtifactsError);
    expect((err as Error).message).toContain("is not an ELF file");
  });
});
