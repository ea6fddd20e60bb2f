/**
 * Host memory of a QEMU process, from procfs, split into guest RAM and QEMU's own.
 *
 *   /proc/PID/smaps_rollup: Rss, Pss, Private_Dirty ... summed over all mappings.
 *   /proc/PID/smaps:        the same per mapping; the guest RAM is the mapping of the RAM file
 *                           (`memory-backend-file`, the template's file mapped private).
 *
 * PSS (proportional set size) counts each resident page divided by the number of processes that
 * map it: pages only this QEMU has (its heap, TCG code cache, the guest pages it wrote, i.e. its
 * copy-on-write copies of template RAM) count fully, template pages shared by N sandboxes count
 * 1/N each. The sum of the PSS of all processes is the memory they really use together, so PSS
 * is the per-VM cost that adding VMs adds (plus the template's own tmpfs file, paid once).
 */
import { readFile } from "node:fs/promises";

/** Fields of smaps we use, in KiB. */
export interface MemFields {
  rss: number;
  pss: number;
  privateDirty: number;
  privateClean: number;
  sharedClean: number;
  sharedDirty: number;
}

export interface QemuMemory {
  pid: number;
  /** The whole process (smaps_rollup). */
  total: MemFields;
  /** The guest RAM mapping only (the RAM file's VMA in smaps). */
  guestRam: MemFields;
}

const FIELDS: Record<string, keyof MemFields> = {
  Rss: "rss",
  Pss: "pss",
  Private_Dirty: "privateDirty",
  Private_Clean: "privateClean",
  Shared_Clean: "sharedClean",
  Shared_Dirty: "sharedDirty",
};

function zero(): MemFields {
  return { rss: 0, pss: 0, privateDirty: 0, privateClean: 0, sharedClean: 0, sharedDirty: 0 };
}

/** Adds the `Name:   123 kB` lines of one smaps block into `into`. */
function addFields(into: MemFields, line: string): void {
  const m = /^(\w+):\s+(\d+) kB$/.exec(line);
  if (!m) return;
  const key = FIELDS[m[1] as string];
  if (key) into[key] += Number(m[2]);
}

/** Parses smaps_rollup text. */
export function parseRollup(text: string): MemFields {
  const out = zero();
  for (const line of text.split("\n")) addFields(out, line);
  return out;
}

/** A mapping header line of smaps: `start-end perms offset dev inode [path]`. */
const HEADER = /^[0-9a-f]+-[0-9a-f]+ \S{4} [0-9a-f]+ \S+ \d+\s*(.*)$/;

/** Sums the smaps fields of the mappings of `path` (a mapped file). */
export function parseSmapsFor(text: string, path: string): MemFields {
  const out = zero();
  let inside = false;
  for (const line of text.split("\n")) {
    const h = HEADER.exec(line);
    if (h) {
      // A deleted file shows as "PATH (deleted)".
      const p = (h[1] ?? "").replace(/ \(deleted\)$/, "");
      inside = p === path;
      continue;
    }
    if (inside) addFields(out, line);
  }
  return out;
}

export async function qemuMemory(pid: number, ramFile: string): Promise<QemuMemory> {
  const [rollup, smaps] = await Promise.all([
    readFile(`/proc/${pid}/smaps_rollup`, "utf8"),
    readFile(`/proc/${pid}/smaps`, "utf8"),
  ]);
  return { pid, total: parseRollup(rollup), guestRam: parseSmapsFor(smaps, ramFile) };
}
