/** Small statistics for the benchmark: nearest-rank percentiles over a sample. */

export interface Summary {
  /** Median (nearest rank). */
  p50: number;
  /** 95th percentile (nearest rank: with fewer than 20 samples this is the maximum). */
  p95: number;
  /** Number of samples. */
  n: number;
}

/** Nearest-rank percentile `p` (0 < p <= 1) of `xs`; NaN for an empty sample. */
export function percentile(xs: readonly number[], p: number): number {
  if (xs.length === 0) return Number.NaN;
  const s = [...xs].sort((a, b) => a - b);
  const rank = Math.min(s.length, Math.max(1, Math.ceil(p * s.length)));
  return s[rank - 1] as number;
}

/** Rounds to 0.1 (figures are ms or MiB; finer digits are noise). */
export function round1(x: number): number {
  return Math.round(x * 10) / 10;
}

/** Rounds to 0.01 (ratios). */
export function round2(x: number): number {
  return Math.round(x * 100) / 100;
}

export function summarize(xs: readonly number[]): Summary {
  return { p50: round1(percentile(xs, 0.5)), p95: round1(percentile(xs, 0.95)), n: xs.length };
}
