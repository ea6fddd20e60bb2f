/**
 * A template copied between agents (template-copy.ts, bundle-codec.ts) with real qcow2 files made
 * by qemu-img and a sparse RAM file on tmpfs: a bundle read back gives the same bytes, holes kept,
 * the overlay rebased onto its copied base, the files registered for restores. Then the bundles a
 * hostile sender could send: every one is refused with a clear error and leaves no file behind
 * (no template dir, no copied base, no RAM file). Restoring a copied template in real VMs:
 * tests/vm/template-copy.test.ts.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { mkdir, mkdtemp, readFile, rm, stat, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { GuestArtifacts } from "../guest/artifacts.ts";
import { runTool } from "../host/tool.ts";
import { openChainStore } from "../storage/chain.ts";
import { createOverlayOn } from "../storage/qcow2.ts";
import { BUNDLE_MAGIC, encodeBundle } from "./bundle-codec.ts";
import { defaultShmRoot, type TemplateMeta, writeMeta } from "./template.ts";
import {
  type BundleHeader,
  exportTemplate,
  type ImportTemplateOptions,
  importTemplate,
  qemuVersion,
} from "./template-copy.ts";

const MIB = 1024 * 1024;
const MEM_MIB = 64;
const ARTIFACTS: GuestArtifacts = {
  vmlinux: "/k",
  initramfs: "/i",
  kernelVersion: "6.1",
  key: "artifacts-key-1",
};
const CONFIG = {
  env: ["PATH=/bin"],
  workingDir: "/",
  entrypoint: [],
  cmd: ["sh"],
  user: { uid: 0, gid: 0, name: "root" },
  digest: "sha256:abc",
  exposedPorts: [8080],
};

let root: string;
let src: { dataDir: string; meta: TemplateMeta };
let mem: Buffer;
let n = 0;

async function qemuImg(...args: string[]): Promise<void> {
  await runTool(["qemu-img", ...args]);
}

beforeAll(async () => {
  root = await mkdtemp(join(tmpdir(), "sbx-tplcopy-"));
  const dataDir = join(root, "src");
  const dir = join(dataDir, "templates", "tpl-src");
  await mkdir(dir, { recursive: true });
  const base = join(root, "src-cache", "rootfs.qcow2");
  await mkdir(join(root, "src-cache"));
  await qemuImg("create", "-q", "-f", "qcow2", base, "64M");
  await runTool(["qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 1M 64k", base]);
  const disk = join(dir, "disk.qcow2");
  await createOverlayOn(base, disk);
  await runTool(["qemu-io", "-f", "qcow2", "-c", "write -P 0xa5 2M 64k", disk]);
  const shmRoot = defaultShmRoot(dataDir);
  await mkdir(shmRoot, { recursive: true });
  const memPath = join(shmRoot, "tpl-tpl-src.mem");
  mem = Buffer.alloc(MEM_MIB * MIB);
  mem.fill(0x11, 4096, 8192);
  mem.fill(0x22, 40 * MIB, 40 * MIB + 100);
  await writeFile(memPath, mem);
  await writeFile(join(dir, "state"), Buffer.from("device state bytes"));
  const meta: TemplateMeta = {
    id: "tpl-src",
    state: "ready",
    imageDigest: "sha256:abc",
    config: CONFIG,
    baseDisk: base,
    disk,
    diskBytes: 64 * MIB,
    statePath: join(dir, "state"),
    memPath,
    shmRoot,
    memMib: MEM_MIB,
    vcpus: 1,
    accel: "tcg",
    artifacts: ARTIFACTS,
    readyCmd: ["true"],
    createdAt: new Date().toISOString(),
  };
  await writeMeta(meta);
  src = { dataDir, meta };
});

afterAll(async () => {
  for (const d of readdirSync(root))
    await rm(defaultShmRoot(join(root, d)), { recursive: true, force: true });
  await rm(root, { recursive: true, force: true });
});

async function collect(chunks: AsyncIterable<Uint8Array>): Promise<Buffer> {
  const parts: Buffer[] = [];
  for await (const c of chunks) parts.push(Buffer.from(c));
  return Buffer.concat(parts);
}

function streamOf(b: Buffer): ReadableStream<Uint8Array> {
  return new Response(b).body as ReadableStream<Uint8Array>;
}

/** A fresh receiving data dir and the options to import `bundle` into it. */
async function receiver(bundle: Buffer, over: Partial<ImportTemplateOptions> = {}) {
  const dataDir = join(root, `dst-${++n}`);
  const cacheDir = join(root, `dst-${n}-cache`);
  await mkdir(dataDir);
  await mkdir(cacheDir);
  const o: ImportTemplateOptions = {
    dataDir,
    cacheDir,
    shmRoot: defaultShmRoot(dataDir),
    id: "tpl-copy",
    bundle: streamOf(bundle),
    artifacts: ARTIFACTS,
    accel: "tcg",
    ...over,
  };
  return o;
}

/** Nothing an import wrote is left: only a failed meta.json may stay (as for a failed build). */
function leftovers(o: ImportTemplateOptions): string[] {
  const out: string[] = [];
  const tdir = join(o.dataDir, "templates", o.id);
  if (existsSync(tdir)) for (const f of readdirSync(tdir)) if (f !== "meta.json") out.push(join(tdir, f));
  const copied = join(o.cacheDir, "images", "copied");
  if (existsSync(copied)) for (const f of readdirSync(copied)) out.push(join(copied, f));
  if (existsSync(o.shmRoot)) for (const f of readdirSync(o.shmRoot)) out.push(join(o.shmRoot, f));
  return out;
}

async function goodHeader(): Promise<BundleHeader> {
  return {
    version: 1,
    memMib: MEM_MIB,
    vcpus: 1,
    accel: "tcg",
    artifactsKey: ARTIFACTS.key,
    qemuVersion: await qemuVersion(),
    imageDigest: "sha256:abc",
    config: CONFIG,
    exposedPorts: [8080],
    files: { base: 0, disk: 0, state: 0, mem: MEM_MIB * MIB },
  };
}

/** A bundle of `header` over these files (their sizes as the header's). */
async function bundleOf(
  header: BundleHeader,
  files: { base: string; disk: string; state: string; mem: string },
) {
  const sizes = {
    base: (await stat(files.base)).size,
    disk: (await stat(files.disk)).size,
    state: (await stat(files.state)).size,
    mem: (await stat(files.mem)).size,
  };
  const h = { ...header, files: sizes };
  return collect(
    encodeBundle(h, [
      { path: files.base, size: sizes.base },
      { path: files.disk, size: sizes.disk },
      { path: files.state, size: sizes.state },
      { path: files.mem, size: sizes.mem },
    ]),
  );
}

const srcFiles = () => ({
  base: src.meta.baseDisk,
  disk: src.meta.disk,
  state: src.meta.statePath,
  mem: src.meta.memPath,
});

describe("template copy", () => {
  test("a bundle read back is the template: same bytes, holes kept, rebased, registered", async () => {
    const bundle = await collect(
      await exportTemplate(src.dataDir, "tpl-src", { config: CONFIG, exposedPorts: [8080] }),
    );
    // The RAM file's 64 MiB of mostly zeros cross as runs: the bundle is a fraction of the files.
    expect(bundle.length).toBeLessThan(4 * MIB);
    const o = await receiver(bundle);
    const r = await importTemplate(o);
    if (!r.ok) throw r.error;
    const { meta, config, exposedPorts } = r.value;
    expect(meta.state).toBe("ready");
    expect(config).toEqual(CONFIG);
    expect(exposedPorts).toEqual([8080]);
    expect(meta.memMib).toBe(MEM_MIB);
    expect(meta.readyCmd).toEqual(["true"]);
    expect(readFileSync(meta.memPath).equals(mem)).toBe(true);
    // Holes stay holes on tmpfs: the two 64 KiB blocks that hold data, not 64 MiB of host memory.
    expect((await stat(meta.memPath)).blocks * 512).toBeLessThanOrEqual(2 * 64 * 1024);
    expect(await readFile(meta.statePath, "utf8")).toBe("device state bytes");
    // The base is an entry of the image cache of its own, the overlay names it and nothing else.
    expect(meta.baseDisk.startsWith(join(o.cacheDir, "images", "copied"))).toBe(true);
    const info = JSON.parse(
      (
        await runTool(["qemu-img", "info", "-U", "--output=json", "--backing-chain", meta.disk])
      ).stdout.toString(),
    ) as Array<{ filename: string; "backing-filename"?: string }>;
    expect(info.map((i) => i.filename)).toEqual([meta.disk, meta.baseDisk]);
    // The data of both layers arrived: the overlay's own cluster and the base's.
    const read = async (off: string, pattern: string) =>
      (
        await runTool([
          "qemu-io",
          "-f",
          "qcow2",
          "-U",
          "-r",
          "-c",
          `read -P ${pattern} ${off} 64k`,
          meta.disk,
        ])
      ).stdout.toString();
    expect(await read("2M", "0xa5")).toContain("read 65536/65536");
    expect(await read("1M", "0x5a")).toContain("read 65536/65536");
    // The control: a pattern that is not there fails verification (qemu-io exits 1).
    const wrong = await read("1M", "0xa5").catch((e: { details?: { output?: string } }) => e.details?.output);
    expect(wrong).toContain("Pattern verification failed");
    expect((await stat(meta.disk)).mode & 0o777).toBe(0o444);
    expect((await stat(meta.baseDisk)).mode & 0o777).toBe(0o444);
    const chain = await openChainStore(o.dataDir);
    expect(chain.get(meta.memPath)?.holders).toEqual(["template:tpl-copy"]);
    expect(chain.get(meta.disk)?.holders).toEqual(["template:tpl-copy"]);
    // The same id twice: refused, the first copy untouched.
    const again = await importTemplate({ ...o, bundle: streamOf(bundle) });
    expect(again.ok).toBe(false);
    expect(readFileSync(meta.memPath).equals(mem)).toBe(true);
  });

  test("a bundle frozen under another guest kernel, accelerator or QEMU is refused before a byte is written", async () => {
    for (const change of [
      { artifactsKey: "someone-elses-kernel" },
      { accel: "kvm" as const },
      { qemuVersion: "QEMU emulator version 1.0" },
    ]) {
      const bundle = await bundleOf({ ...(await goodHeader()), ...change }, srcFiles());
      const o = await receiver(bundle);
      const r = await importTemplate(o);
      expect(r.ok).toBe(false);
      if (r.ok) continue;
      expect(r.error.code).toBe("template_incompatible");
      expect(existsSync(join(o.dataDir, "templates", o.id))).toBe(false);
      expect(leftovers(o)).toEqual([]);
    }
  });

  test("hostile bundles: each refused with a clear error, nothing left behind", async () => {
    const good = await bundleOf(await goodHeader(), srcFiles());
    const headerLen = good.readUInt32BE(BUNDLE_MAGIC.length);
    const bodyAt = BUNDLE_MAGIC.length + 4 + headerLen;
    const evilBase = join(root, "evil-base.qcow2");
    await qemuImg("create", "-q", "-f", "qcow2", "-F", "raw", "-b", "/etc/shadow", "-u", evilBase, "64M");
    const dataFileDisk = join(root, "datafile.qcow2");
    await qemuImg(
      "create",
      "-q",
      "-f",
      "qcow2",
      "-o",
      `data_file=${join(root, "datafile.raw")}`,
      dataFileDisk,
      "64M",
    );
    const notQcow = join(root, "raw.img");
    await writeFile(notQcow, Buffer.alloc(64 * 1024, 1));
    const withHeader = (h: unknown) => {
      const json = Buffer.from(JSON.stringify(h));
      const len = Buffer.alloc(4);
      len.writeUInt32BE(json.length);
      return Buffer.concat([BUNDLE_MAGIC, len, json, good.subarray(bodyAt)]);
    };
    const h = JSON.parse(good.subarray(BUNDLE_MAGIC.length + 4, bodyAt).toString()) as BundleHeader;
    const cases: Array<[string, Buffer, RegExp]> = [
      ["not a bundle", Buffer.from("GET / HTTP/1.1\r\n\r\n"), /bad magic/],
      [
        "a 2 GiB header",
        Buffer.concat([BUNDLE_MAGIC, Buffer.from([0x80, 0, 0, 0])]),
        /header of \d+ bytes is over/,
      ],
      ["a header that is not JSON", withHeader("x").fill(0x7b, 12, 13), /not JSON|malformed/],
      ["an unknown header field", withHeader({ ...h, path: "/etc" }), /malformed/],
      ["a RAM file of the wrong size", withHeader({ ...h, files: { ...h.files, mem: MIB } }), /RAM file of/],
      ["a 1 TiB base disk", withHeader({ ...h, files: { ...h.files, base: 1024 ** 4 } }), /a base of/],
      ["64 GiB of RAM declared", withHeader({ ...h, memMib: 65_537 }), /memMib .* out of range/],
      ["cut short", good.subarray(0, good.length - 1000), /ended inside|ended at/],
      ["bytes after the last file", Buffer.concat([good, Buffer.from("more")]), /after its last file/],
      [
        "a data record past its file's end",
        withHeader({ ...h, files: { ...h.files, state: 4 } }),
        /data record of \d+ bytes/,
      ],
      [
        "a base disk naming a host file",
        await bundleOf(await goodHeader(), { ...srcFiles(), base: evilBase }),
        /base disk names \/etc\/shadow/,
      ],
      [
        "an overlay with an external data file",
        await bundleOf(await goodHeader(), { ...srcFiles(), disk: dataFileDisk }),
        /external data file/,
      ],
      [
        "a base that is not qcow2",
        await bundleOf(await goodHeader(), { ...srcFiles(), base: notQcow }),
        /not a qcow2/,
      ],
    ];
    for (const [what, bundle, why] of cases) {
      const o = await receiver(bundle);
      const r = await importTemplate(o);
      expect({ what, ok: r.ok }).toEqual({ what, ok: false });
      if (r.ok) continue;
      expect({ what, message: r.error.message }).toEqual({ what, message: expect.stringMatching(why) });
      expect({ what, left: leftovers(o) }).toEqual({ what, left: [] });
    }
    // The host file a hostile header named was never touched.
    expect(existsSync("/etc/shadow")).toBe(true);
  });
});
