import { afterAll, expect, test } from "bun:test";
import { existsSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { ChainStore } from "./chain.ts";

const root = mkdtempSync(join(tmpdir(), "chain-test-"));
afterAll(() => rmSync(root, { recursive: true, force: true }));

test("changes made at once are all applied and written together; a bad one fails alone", async () => {
  const dataDir = join(root, "a");
  const store = await ChainStore.load(dataDir);
  const files = Array.from({ length: 200 }, (_, i) => join(root, `f${i}`));
  for (const f of files) writeFileSync(f, "x");
  // A fork of many children: its changes all arrive while the first write is under way.
  const results = await Promise.allSettled([
    ...files.map((f) => store.add(f, { kind: "overlay", holder: `vm:${f}` })),
    store.hold("vm:nobody", [join(root, "never-registered")]),
    ...files.map((f) => store.hold("fork:x", [f])),
  ]);
  const failed = results.filter((r) => r.status === "rejected");
  expect(failed).toHaveLength(1);
  expect(String((failed[0] as PromiseRejectedResult).reason)).toContain("not a registered file");
  // What is on disk is the whole table: a restart finds every file and hold.
  const reloaded = await ChainStore.load(dataDir);
  expect(reloaded.list()).toHaveLength(200);
  for (const f of files) expect(reloaded.get(f)?.holders.sort()).toEqual(["fork:x", `vm:${f}`].sort());
  // Released at once, every file is freed and deleted.
  await Promise.all(files.map((f) => store.release(`vm:${f}`)));
  await store.release("fork:x");
  expect(store.list()).toEqual([]);
  for (const f of files) expect(existsSync(f)).toBe(false);
  expect((await ChainStore.load(dataDir)).list()).toEqual([]);
});
