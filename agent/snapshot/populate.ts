/**
 * Faults in, for reading, the pages of a running QEMU's guest RAM mapping that are not yet
 * mapped, from the host (root reads /proc/<pid>/mem), while the guest keeps running.
 *
 * Why: a background snapshot (fork-method.ts) write-protects the guest's RAM with userfaultfd,
 * and only a mapped page can be write-protected, so QEMU first touches every unmapped page
 * (ram_block_populate_read). QEMU does that with the guest stopped: for a 256 MiB guest that has
 * touched ~20 MiB, ~60,000 page faults inside the stall (~170 ms under TCG here). Done before
 * the stop, they cost the guest nothing; QEMU's own pass then finds every page mapped (~5 ms).
 * Pages the guest maps meanwhile are mapped already; pages it drops are found by QEMU's pass.
 *
 * The pagemap tells which pages are mapped (bit 63 present, bit 62 swapped), so only the holes
 * are read: 512 KiB of pagemap for 256 MiB of RAM, and a later fork of the same VM finds almost
 * nothing to do.
 */
import { statSync } from "node:fs";
import { open, readdir, readFile } from "node:fs/promises";
import { SandboxdError } from "../../contracts/errors.ts";

const PAGE = 4096;
/** One /proc/<pid>/mem read: 4 MiB, a bounded buffer whatever the guest's size. */
const READ_CHUNK = 4 * 1024 * 1024;
/** Pagemap entries read at once (8 bytes each): 512 KiB, 256 MiB of guest RAM. */
const PAGEMAP_CHUNK_PAGES = 65536;
const PRESENT = 1n << 63n;
const SWAPPED = 1n << 62n;
/** Bit 61: a page cache (file) page or shared anonymous memory; clear on a private copy. */
const FILE_PAGE = 1n << 61n;

export interface PopulateResult {
  /** Bytes of the mapping that were not mapped and were read in. */
  faultedBytes: number;
  /** Bytes of the mapping. */
  mappingBytes: number;
}

/** The [start, end) of the mapping of `file` (by device and inode) in `/proc/<pid>/maps`. */
export async function findMapping(
  pid: number,
  file: string,
): Promise<{ start: number; end: number } | undefined> {
  const st = statSync(file);
  const maps = await readFile(`/proc/${pid}/maps`, "utf8");
  let best: { start: number; end: number } | undefined;
  for (const line of maps.split("\n")) {
    // start-end perms offset major:minor inode path
    const m = /^([0-9a-f]+)-([0-9a-f]+) \S+ [0-9a-f]+ [0-9a-f]+:[0-9a-f]+ (\d+)/.exec(line);
    if (!m || Number(m[3]) !== st.ino) continue;
    const start = Number.parseInt(m[1] as string, 16);
    const end = Number.parseInt(m[2] as string, 16);
    // The guest RAM is one mapping of the whole file; keep the largest in case of others.
    if (!best || end - start > best.end - best.start) best = { start, end };
  }
  return best;
}

/**
 * The pagemap of `range` in process `pid`, PAGEMAP_CHUNK_PAGES entries at a time: the index of
 * the chunk's first page in the range, its entries (8 bytes each, `n` of them read) and how many
 * were asked for (`want`: a short read leaves `n` below it).
 */
async function* pagemapChunks(
  pid: number,
  range: { start: number; end: number },
): AsyncGenerator<{ first: number; entries: Buffer; n: number; want: number }> {
  const pagemap = await open(`/proc/${pid}/pagemap`, "r");
  try {
    const entries = Buffer.alloc(PAGEMAP_CHUNK_PAGES * 8);
    const pages = (range.end - range.start) / PAGE;
    for (let first = 0; first < pages; first += PAGEMAP_CHUNK_PAGES) {
      const want = Math.min(PAGEMAP_CHUNK_PAGES, pages - first);
      const { bytesRead } = await pagemap.read(entries, 0, want * 8, (range.start / PAGE + first) * 8);
      yield { first, entries, n: Math.floor(bytesRead / 8), want };
    }
  } finally {
    await pagemap.close();
  }
}

/**
 * Reads in every unmapped page of `pid`'s mapping of `file`. Throws when the process or the
 * mapping is not there (the caller goes on without: QEMU populates the rest itself).
 */
export async function populateMapping(pid: number, file: string): Promise<PopulateResult> {
  const range = await findMapping(pid, file);
  if (!range) throw new SandboxdError("internal", `no mapping of ${file} in process ${pid}`);
  // Reads go through the thread pool (fs/promises), so the agent serves other calls meanwhile.
  const mem = await open(`/proc/${pid}/mem`, "r");
  try {
    const sink = Buffer.alloc(READ_CHUNK);
    let faulted = 0;
    /** Reads [from, to) of the mapping through /proc/<pid>/mem, in bounded chunks. */
    const readIn = async (from: number, to: number) => {
      for (let at = from; at < to; at += READ_CHUNK) {
        await mem.read(sink, 0, Math.min(READ_CHUNK, to - at), at);
      }
      faulted += to - from;
    };
    for await (const { first, entries, n, want } of pagemapChunks(pid, range)) {
      let holeStart = -1;
      for (let i = 0; i < n; i++) {
        const e = entries.readBigUInt64LE(i * 8);
        const mapped = (e & (PRESENT | SWAPPED)) !== 0n;
        if (!mapped && holeStart < 0) holeStart = i;
        if (mapped && holeStart >= 0) {
          await readIn(range.start + (first + holeStart) * PAGE, range.start + (first + i) * PAGE);
          holeStart = -1;
        }
      }
      if (holeStart >= 0)
        await readIn(range.start + (first + holeStart) * PAGE, range.start + (first + want) * PAGE);
    }
    return { faultedBytes: faulted, mappingBytes: range.end - range.start };
  } finally {
    await mem.close();
  }
}

/**
 * The pages of `pid`'s private mapping of `file` that are its own (one byte per page, 1 = own):
 * the ones it wrote (a private copy: present without the file-page bit) or that were swapped out.
 * Every other page shows the file's content (the page cache's, or never touched). A suspend saves
 * only its own (suspend.ts); pages QEMU maps after this (none while the guest is stopped) would
 * not be counted. Throws when the process or the mapping is not there.
 */
export async function ownPages(pid: number, file: string): Promise<Uint8Array> {
  const range = await findMapping(pid, file);
  if (!range) throw new SandboxdError("internal", `no mapping of ${file} in process ${pid}`);
  const own = new Uint8Array((range.end - range.start) / PAGE);
  for await (const { first, entries, n, want } of pagemapChunks(pid, range)) {
    if (n !== want) throw new SandboxdError("internal", `short pagemap read of process ${pid}`);
    for (let i = 0; i < n; i++) {
      const e = entries.readBigUInt64LE(i * 8);
      if ((e & SWAPPED) !== 0n || ((e & PRESENT) !== 0n && (e & FILE_PAGE) === 0n)) own[first + i] = 1;
    }
  }
  return own;
}

/** Samples of a blocked-in-userfault check, and the time between them (see blockedInUserfault). */
const BLOCKED_SAMPLES = 5;
const BLOCKED_SAMPLE_MS = 100;

/**
 * True when a thread of `pid` stays blocked in a userfaultfd fault (its wchan is
 * `handle_userfault`) across ~0.5 s of samples: after a failed background snapshot nobody will
 * resolve that fault (QEMU 7.2 leaves it), and the guest will never run again. A fault that is
 * being served passes within milliseconds.
 */
export async function blockedInUserfault(pid: number): Promise<boolean> {
  const blocked = async () => {
    const tasks = await readdir(`/proc/${pid}/task`).catch(() => [] as string[]);
    for (const t of tasks) {
      const wchan = await readFile(`/proc/${pid}/task/${t}/wchan`, "utf8").catch(() => "");
      if (wchan.trim() === "handle_userfault") return t;
    }
    return undefined;
  };
  const first = await blocked();
  if (!first) return false;
  for (let i = 1; i < BLOCKED_SAMPLES; i++) {
    await Bun.sleep(BLOCKED_SAMPLE_MS);
    if ((await blocked()) !== first) return false;
  }
  return true;
}
