/**
 * How the client commands print: aligned tables and `key: value` blocks for people, the API's own
 * objects as JSON with `--json` for scripts (one document per command, a trailing newline).
 */

/** Where a command writes; the real process streams, or buffers in tests. */
export interface Out {
  write(s: string): void;
}

/** A table with a header row; every cell is text, columns padded to their widest cell. */
export function table(headers: string[], rows: string[][]): string {
  const widths = headers.map((h, i) => Math.max(h.length, ...rows.map((r) => (r[i] ?? "").length)));
  const line = (cells: string[]) =>
    cells
      .map((c, i) => (i === cells.length - 1 ? c : c.padEnd(widths[i]!)))
      .join("  ")
      .trimEnd();
  return [line(headers), ...rows.map(line)].join("\n");
}

/** `key: value` lines, keys padded; nested objects are printed as compact JSON. */
export function keyValues(obj: Record<string, unknown>): string {
  const entries = Object.entries(obj).filter(([, v]) => v !== undefined);
  const width = Math.max(0, ...entries.map(([k]) => k.length)) + 1;
  return entries.map(([k, v]) => `${`${k}:`.padEnd(width)} ${cell(v)}`).join("\n");
}

/** One value as table text: strings as they are, empty objects as `-`, the rest as JSON. */
export function cell(v: unknown): string {
  if (v === undefined || v === null) return "-";
  if (typeof v === "string") return v;
  if (typeof v === "number" || typeof v === "boolean") return String(v);
  if (typeof v === "object" && Object.keys(v).length === 0) return "-";
  if (typeof v === "object" && !Array.isArray(v)) {
    return Object.entries(v)
      .map(([k, x]) => `${k}=${typeof x === "string" ? x : JSON.stringify(x)}`)
      .join(",");
  }
  return JSON.stringify(v);
}

export function json(value: unknown): string {
  return JSON.stringify(value, null, 2);
}

/** Seconds as the shortest unit that reads well: 42s, 3m12s, 5h02m, 2d03h. */
export function duration(secs: number): string {
  const s = Math.max(0, Math.floor(secs));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, "0")}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
  return `${Math.floor(s / 86400)}d${String(Math.floor((s % 86400) / 3600)).padStart(2, "0")}h`;
}

/** Bytes in binary units with one decimal: 512 B, 1.5 KiB, 20.0 MiB. */
export function bytes(n: number): string {
  if (n < 1024) return `${n} B`;
  const units = ["KiB", "MiB", "GiB", "TiB"];
  let v = n / 1024;
  let u = 0;
  while (v >= 1024 && u < units.length - 1) {
    v /= 1024;
    u++;
  }
  return `${v.toFixed(1)} ${units[u]}`;
}
