/**
 * An operator-only window on the service's JS heap, for telling a leak from warm-up: with
 * `SANDBOXD_HEAP_STATS=1` in its environment `sandboxd up` answers SIGUSR2 by running a full
 * garbage collection and printing one line to stderr, `heap-stats {json}`: RSS, the heap's size
 * and object count after the collection, the allocator's own size, and the object counts per
 * type. Off by default (nothing is installed and SIGUSR2 keeps its default); `bench --soak`
 * turns it on for the service it starts and reads the lines (bench/soak.ts).
 */
import { heapStats } from "bun:jsc";

export const HEAP_STATS_ENV = "SANDBOXD_HEAP_STATS";
/** What a line starts with; the rest of the line is the JSON of `HeapStatsLine`. */
export const HEAP_STATS_PREFIX = "heap-stats ";

export interface HeapStatsLine {
  rss_kib: number;
  /** Bytes of live JS objects (cells) after a full collection. */
  heap_bytes: number;
  /**
   * Memory that JS objects own outside the cells and report to the collector: ArrayBuffers,
   * WebAssembly memories (PGlite's database runs in one), big strings' storage.
   */
  external_bytes: number;
  object_count: number;
  /** Bytes of the blocks the JS heap holds for its cells, live or free. */
  heap_capacity_bytes: number;
  /** Live objects per JS type after the collection. */
  types: Record<string, number>;
}

/** Collects fully, then measures. The collection is synchronous and takes tens of ms. */
export function collectHeapStats(): HeapStatsLine {
  Bun.gc(true);
  const s = heapStats();
  return {
    rss_kib: Math.round(process.memoryUsage.rss() / 1024),
    // JSC counts the external memory in both its size and its capacity: the cells are the rest.
    heap_bytes: s.heapSize - s.extraMemorySize,
    external_bytes: s.extraMemorySize,
    object_count: s.objectCount,
    heap_capacity_bytes: s.heapCapacity - s.extraMemorySize,
    types: s.objectTypeCounts,
  };
}

/** Installs the SIGUSR2 handler when `SANDBOXD_HEAP_STATS` is on; returns its removal. */
export function installHeapStatsSignal(on: boolean): () => void {
  if (!on) return () => {};
  const onSignal = () => {
    process.stderr.write(`${HEAP_STATS_PREFIX}${JSON.stringify(collectHeapStats())}\n`);
  };
  process.on("SIGUSR2", onSignal);
  return () => process.off("SIGUSR2", onSignal);
}

/** The stats in a line of the service's stderr, or undefined when the line is something else. */
export function parseHeapStatsLine(line: string): HeapStatsLine | undefined {
  const i = line.indexOf(HEAP_STATS_PREFIX);
  if (i < 0) return undefined;
  try {
    return JSON.parse(line.slice(i + HEAP_STATS_PREFIX.length)) as HeapStatsLine;
  } catch {
    return undefined;
  }
}
