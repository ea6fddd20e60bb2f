/**
 * The image caches under a size budget: the import cache (`<cacheDir>/images/<hex>/`, one base
 * disk each) and the pulled layouts (`<cacheDir>/images/pulled/<hex>/`) are evicted least
 * recently used until together they fit `SANDBOXD_IMAGE_CACHE_BYTES` (default 20 GiB).
 *
 * "Used" is the directory's mtime: nothing writes into an entry after the rename that published
 * it, so its mtime is free to mean "last served", and `touchEntry` sets it on every cache hit.
 * An entry is never evicted while in use: the caller names those (a template's base disk, an
 * entry a build in progress holds), and an entry used within the last `graceMs` is kept too, so
 * an import finishing beside an eviction keeps what it just returned. Eviction renames the entry
 * aside first (a reader sees it whole or not at all), then removes it.
 */
import type { Dirent } from "node:fs";
import { lstat, readdir, rename, rm, stat, utimes } from "node:fs/promises";
import { join } from "node:path";
import { ifExists } from "../../contracts/best-effort.ts";
import { bytesSetting } from "../../contracts/disk-space.ts";

/** Default budget of the two image caches together (`SANDBOXD_IMAGE_CACHE_BYTES`). */
export const DEFAULT_IMAGE_CACHE_BYTES = 20 * 1024 ** 3;
/** An entry served this recently is never evicted: a build may be about to use it. */
export const EVICT_GRACE_MS = 10 * 60_000;

/** `SANDBOXD_IMAGE_CACHE_BYTES` of the agent's settings (cli/settings/), else the default. */
export function imageCacheBudgetFromEnv(env: Record<string, string | undefined>): number {
  return bytesSetting(env, "SANDBOXD_IMAGE_CACHE_BYTES", DEFAULT_IMAGE_CACHE_BYTES);
}

export interface CacheEntry {
  /** The entry's directory. */
  dir: string;
  /** Bytes it holds on disk (allocated blocks). */
  bytes: number;
  /** When it was last served (its mtime), ms since the epoch. */
  lastUsedMs: number;
}

/**
 * The entries to evict, oldest use first, until the rest fit `budgetBytes`; entries in use or
 * used after `now - graceMs` are kept whatever they cost (the budget may then stay exceeded).
 */
export function chooseEvictions(
  entries: readonly CacheEntry[],
  budgetBytes: number,
  keep: (e: CacheEntry) => boolean,
  now: number,
  graceMs = EVICT_GRACE_MS,
): CacheEntry[] {
  let total = entries.reduce((a, e) => a + e.bytes, 0);
  const out: CacheEntry[] = [];
  const byAge = [...entries].sort((a, b) => a.lastUsedMs - b.lastUsedMs || a.dir.localeCompare(b.dir));
  for (const e of byAge) {
    if (total <= budgetBytes) break;
    if (keep(e) || e.lastUsedMs > now - graceMs) continue;
    out.push(e);
    total -= e.bytes;
  }
  return out;
}

/** Marks a cache entry as served now (its mtime). A vanished entry is not an error. */
export async function touchEntry(dir: string): Promise<void> {
  const now = new Date();
  await ifExists(utimes(dir, now, now));
}

/** Allocated bytes under `dir` (links are not followed). */
export async function treeBytes(dir: string): Promise<number> {
  let total = 0;
  let names: Dirent[];
  try {
    names = await readdir(dir, { withFileTypes: true });
  } catch {
    return 0;
  }
  for (const d of names) {
    const p = join(dir, d.name);
    if (d.isDirectory()) total += await treeBytes(p);
    else {
      const st = await ifExists(lstat(p));
      if (st) total += st.blocks * 512;
    }
  }
  return total;
}

/** Every entry of both caches under `cacheDir` (the `pulled` and `tmp` folders are not entries). */
export async function listCacheEntries(cacheDir: string): Promise<CacheEntry[]> {
  const images = join(cacheDir, "images");
  const out: CacheEntry[] = [];
  const add = async (dir: string) => {
    const st = await ifExists(stat(dir));
    if (!st?.isDirectory()) return;
    out.push({ dir, bytes: await treeBytes(dir), lastUsedMs: st.mtimeMs });
  };
  for (const name of (await ifExists(readdir(images))) ?? []) {
    if (/^[a-f0-9]{64}$/.test(name)) await add(join(images, name));
  }
  const pulled = join(images, "pulled");
  for (const name of await readdir(pulled).catch(() => [] as string[])) {
    if (/^[a-f0-9]{64}$/.test(name)) await add(join(pulled, name));
  }
  return out;
}

export interface EvictOptions {
  budgetBytes: number;
  /** True for an entry directory in use (never evicted). */
  inUse: (dir: string) => boolean;
  now?: number;
  graceMs?: number;
  log?: (m: string) => void;
}

/** Evicts least-recently-used entries of `cacheDir`'s image caches down to the budget. */
export async function evictImageCaches(cacheDir: string, o: EvictOptions): Promise<CacheEntry[]> {
  const entries = await listCacheEntries(cacheDir);
  const victims = chooseEvictions(
    entries,
    o.budgetBytes,
    (e) => o.inUse(e.dir),
    o.now ?? Date.now(),
    o.graceMs ?? EVICT_GRACE_MS,
  );
  for (const v of victims) {
    const aside = `${v.dir}.evicting-${process.pid}`;
    try {
      await rename(v.dir, aside);
    } catch {
      continue; // gone already, or taken by a concurrent eviction
    }
    await rm(aside, { recursive: true, force: true });
    o.log?.(
      `image cache: evicted ${v.dir} (${v.bytes} bytes, last used ${new Date(v.lastUsedMs).toISOString()})`,
    );
  }
  return victims;
}
