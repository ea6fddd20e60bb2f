import { afterAll, expect, test } from "bun:test";
import { existsSync } from "node:fs";
import { mkdir, mkdtemp, readdir, rm, stat, utimes, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { type CacheEntry, chooseEvictions, evictImageCaches, listCacheEntries, touchEntry } from "./evict.ts";

const MIN = 60_000;
const NOW = 1_800_000_000_000;
const e = (dir: string, bytes: number, agoMin: number): CacheEntry => ({
  dir,
  bytes,
  lastUsedMs: NOW - agoMin * MIN,
});

test("least recently used first, only until the rest fit the budget", () => {
  const entries = [e("a", 40, 100), e("b", 40, 300), e("c", 40, 200), e("d", 40, 50)];
  expect(chooseEvictions(entries, 200, () => false, NOW).map((x) => x.dir)).toEqual([]);
  expect(chooseEvictions(entries, 120, () => false, NOW).map((x) => x.dir)).toEqual(["b"]);
  expect(chooseEvictions(entries, 80, () => false, NOW).map((x) => x.dir)).toEqual(["b", "c"]);
  expect(chooseEvictions(entries, 0, () => false, NOW).map((x) => x.dir)).toEqual(["b", "c", "a", "d"]);
});

test("entries in use and entries used within the grace period are never evicted", () => {
  const entries = [e("old-in-use", 100, 500), e("old", 10, 400), e("fresh", 100, 1)];
  const chosen = chooseEvictions(entries, 0, (x) => x.dir === "old-in-use", NOW);
  // The budget stays exceeded: what is kept is kept whatever it costs.
  expect(chosen.map((x) => x.dir)).toEqual(["old"]);
  expect(chooseEvictions(entries, 0, () => false, NOW, 0).map((x) => x.dir)).toEqual([
    "old-in-use",
    "old",
    "fresh",
  ]);
});

const root = await mkdtemp(join(tmpdir(), "sbx-evict-"));
afterAll(() => rm(root, { recursive: true, force: true }));

async function entry(dir: string, bytes: number, agoMin: number): Promise<void> {
  await mkdir(dir, { recursive: true });
  await writeFile(join(dir, "blob"), Buffer.alloc(bytes, 1));
  const t = new Date(Date.now() - agoMin * MIN);
  await utimes(dir, t, t);
}

test("the caches on disk: sizes, use times, eviction of both kinds, a touch keeps an entry", async () => {
  const cache = join(root, "c1");
  const hex = (c: string) => c.repeat(64);
  const imported = join(cache, "images", hex("a"));
  const importedOld = join(cache, "images", hex("b"));
  const pulled = join(cache, "images", "pulled", hex("c"));
  const pulledOld = join(cache, "images", "pulled", hex("d"));
  await entry(imported, 64 * 1024, 30);
  await entry(importedOld, 64 * 1024, 300);
  await entry(pulled, 64 * 1024, 60);
  await entry(pulledOld, 64 * 1024, 600);
  await mkdir(join(cache, "images", "tmp-not-an-entry"), { recursive: true });
  const listed = await listCacheEntries(cache);
  expect(listed.map((x) => x.dir).sort()).toEqual([imported, importedOld, pulled, pulledOld].sort());
  for (const x of listed) expect(x.bytes).toBeGreaterThanOrEqual(64 * 1024);

  await touchEntry(importedOld); // served just now: the newest
  expect((await stat(importedOld)).mtimeMs).toBeGreaterThan(Date.now() - MIN);

  const logs: string[] = [];
  const gone = await evictImageCaches(cache, {
    budgetBytes: 2 * 64 * 1024 + 16 * 1024,
    inUse: (d) => d === pulledOld,
    graceMs: 10 * MIN,
    log: (m) => logs.push(m),
  });
  // pulledOld is in use; next oldest are pulled (60 min) then imported (30 min).
  expect(gone.map((x) => x.dir)).toEqual([pulled, imported]);
  expect(existsSync(pulled) || existsSync(imported)).toBe(false);
  expect(existsSync(pulledOld) && existsSync(importedOld)).toBe(true);
  expect(logs).toHaveLength(2);
  // Nothing renamed aside is left behind.
  expect((await readdir(join(cache, "images", "pulled"))).sort()).toEqual([hex("d")]);
});

test("an empty or missing cache evicts nothing", async () => {
  expect(await evictImageCaches(join(root, "none"), { budgetBytes: 0, inUse: () => false })).toEqual([]);
});
