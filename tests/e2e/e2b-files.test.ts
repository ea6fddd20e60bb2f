/**
 * E2B's filesystem through the data plane in a running service (`bin/sandboxd up`, real VMs of
 * the python catalog template, a Debian minbase), driven by E2B's SDK, unmodified (`e2b` 2.45.0):
 * `sandbox.files` write (one file, several, bytes), read (text, bytes), list with depth, getInfo,
 * exists, makeDir, rename, remove, a missing path as the SDK's NotFoundError, and a watcher
 * seeing a file made and removed.
 */
import { expect, test } from "bun:test";
import { FilesystemEventType, NotFoundError, Sandbox } from "e2b";
import { e2bKeyOf } from "../../contracts/e2b/ids.ts";
import { useService } from "../support/service.ts";

/** A Debian template with GNU coreutils and findutils (what the filesystem ops run). */
const TEMPLATE = "python";
/** A create and a dozen file calls under TCG on a loaded 2-core host. */
const TEST_TIMEOUT_MS = 300_000;

const fx = useService({ keys: { pro: ["acme", "pro"] } });

async function create(): Promise<Sandbox> {
  const sbx = await Sandbox.create(TEMPLATE, {
    apiKey: e2bKeyOf(fx.keys.pro),
    apiUrl: `${fx.svc.url}/e2b`,
    sandboxUrl: `${fx.svc.url}/e2b/envd`,
    timeoutMs: 120_000,
  });
  fx.cleanup(() => sbx.kill());
  return sbx;
}

test(
  "write, read, list, info, exists, makeDir, rename, remove; a missing path is NotFoundError",
  async () => {
    const sbx = await create();
    const f = sbx.files;
    const w = await f.write("/tmp/e2b/a.txt", "hello");
    expect(w.path).toBe("/tmp/e2b/a.txt");
    expect(await f.read("/tmp/e2b/a.txt")).toBe("hello");
    const bytes = new Uint8Array([0, 1, 2, 255, 254]);
    await f.write("/tmp/e2b/b.bin", bytes.buffer as ArrayBuffer);
    expect(Array.from(await f.read("/tmp/e2b/b.bin", { format: "bytes" }))).toEqual(Array.from(bytes));
    await f.write([
      { path: "/tmp/e2b/sub/c.txt", data: "c" },
      { path: "/tmp/e2b/sub/d.txt", data: "d" },
    ]);
    const top = (await f.list("/tmp/e2b")).map((e) => e.name).sort();
    expect(top).toEqual(["a.txt", "b.bin", "sub"]);
    const deep = (await f.list("/tmp/e2b", { depth: 2 })).map((e) => e.path).sort();
    expect(deep).toContain("/tmp/e2b/sub/c.txt");
    const info = await f.getInfo("/tmp/e2b/a.txt");
    expect(info).toMatchObject({ name: "a.txt", type: "file", path: "/tmp/e2b/a.txt", size: 5 });
    expect(await f.exists("/tmp/e2b/a.txt")).toBe(true);
    expect(await f.exists("/tmp/e2b/nope")).toBe(false);
    expect(await f.makeDir("/tmp/e2b/new")).toBe(true);
    expect(await f.makeDir("/tmp/e2b/new")).toBe(false);
    const moved = await f.rename("/tmp/e2b/a.txt", "/tmp/e2b/new/a.txt");
    expect(moved.path).toBe("/tmp/e2b/new/a.txt");
    expect(await f.read("/tmp/e2b/new/a.txt")).toBe("hello");
    await f.remove("/tmp/e2b/sub");
    expect(await f.exists("/tmp/e2b/sub")).toBe(false);
    await expect(f.read("/tmp/e2b/missing")).rejects.toBeInstanceOf(NotFoundError);
    await expect(f.getInfo("/tmp/e2b/missing")).rejects.toBeInstanceOf(NotFoundError);
    // A relative path is the user's home's (root's here).
    await f.write("rel.txt", "r");
    expect(await f.read("/root/rel.txt")).toBe("r");
  },
  TEST_TIMEOUT_MS,
);

test(
  "a watcher sees a file made and removed",
  async () => {
    const sbx = await create();
    await sbx.files.makeDir("/tmp/w");
    const seen: Array<[string, FilesystemEventType]> = [];
    const handle = await sbx.files.watchDir("/tmp/w", (e) => {
      seen.push([e.name, e.type]);
    });
    try {
      await sbx.files.write("/tmp/w/x", "1");
      const until = Date.now() + 30_000;
      while (!seen.some(([n, t]) => n === "x" && t === FilesystemEventType.CREATE) && Date.now() < until)
        await Bun.sleep(100);
      await sbx.files.remove("/tmp/w/x");
      while (!seen.some(([n, t]) => n === "x" && t === FilesystemEventType.REMOVE) && Date.now() < until)
        await Bun.sleep(100);
    } finally {
      await handle.stop();
    }
    expect(seen).toContainEqual(["x", FilesystemEventType.CREATE]);
    expect(seen).toContainEqual(["x", FilesystemEventType.REMOVE]);
  },
  TEST_TIMEOUT_MS,
);
