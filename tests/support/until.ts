/** Polls `cond` every 10 ms until it holds; throws past `ms`. Resolves how long it took. */
export async function until(cond: () => boolean | Promise<boolean>, ms: number): Promise<number> {
  const t0 = performance.now();
  while (!(await cond())) {
    if (performance.now() - t0 > ms) throw new Error(`not within ${ms} ms`);
    await Bun.sleep(10);
  }
  return performance.now() - t0;
}
