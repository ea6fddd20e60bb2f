import { afterEach, describe, expect, test } from "bun:test";
import { mkdtemp, readdir, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { type SandboxRecord, sandboxRecords } from "../../agent/sandbox/records.ts";

/** The on-disk records the agent re-adopts from: atomic writes, ordering, torn/foreign files. */

const dirs: string[] = [];
afterEach(async () => {
  for (const d of dirs.splice(0)) await rm(d, { recursive: true, force: true });
});

const rec = (id: string, execCount = 0): SandboxRecord => ({
  version: 1,
  id,
  templateId: "busybox",
  kind: "sandbox",
  state: "running",
  size: { vcpus: 1, memMib: 256 },
  qemuPid: 1234,
  createdAtMs: 1,
  lastUsedAtMs: 2,
  execCount,
  endpoints: {},
});

describe("RecordStore", () => {
  test("writes land in call order, atomically; list skips torn and foreign files; tmp files go", async () => {
    const dir = await mkdtemp(join(tmpdir(), "sbx-records-"));
    dirs.push(dir);
    const store = sandboxRecords(dir);
    await Promise.all(Array.from({ length: 50 }, (_, i) => store.write(rec("vm-a", i))));
    expect((await store.read("vm-a"))?.execCount).toBe(49);
    await store.write(rec("vm-b"));
    await writeFile(join(store.dir, "vm-torn.json"), '{"version":1,"id":"vm-t');
    await writeFile(join(store.dir, "vm-foreign.json"), JSON.stringify({ version: 99, id: "vm-f" }));
    await writeFile(join(store.dir, "vm-c.json.abcd.tmp"), "partial");
    const { records, bad } = await store.list();
    expect(records.map((r) => r.id)).toEqual(["vm-a", "vm-b"]);
    expect(bad.map((b) => b.file.split("/").pop()).sort()).toEqual(["vm-foreign.json", "vm-torn.json"]);
    expect((await readdir(store.dir)).some((n) => n.endsWith(".tmp"))).toBe(false);
    await store.remove("vm-a");
    expect(await store.read("vm-a")).toBeUndefined();
  });

  test("ids that could leave the directory are refused", async () => {
    const dir = await mkdtemp(join(tmpdir(), "sbx-records-"));
    dirs.push(dir);
    const store = sandboxRecords(dir);
    await expect(store.write({ ...rec("vm-x"), id: "../escape" })).rejects.toThrow("unsafe record id");
    await expect(store.write({ ...rec("vm-x"), id: "a/b" })).rejects.toThrow("unsafe record id");
    expect(await readdir(dir)).toEqual([]);
  });
});
