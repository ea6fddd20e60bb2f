/**
 * Polls `cond` every `everyMs` (50 by default) until it holds; throws past `ms`. Resolves how long
 * it took.
 *
 * The gateway suites poll one API key with it (gateway-row-cache, gateway-key-cache): at 50 ms a
 * poll of one or two requests stays at 40 requests a second or less, well under the 100 a key may
 * make (docs/limits.md "Public API limits"), so a poll never meets a 429 of its own making.
 */
export async function until(
  cond: () => boolean | Promise<boolean>,
  ms: number,
  everyMs = 50,
): Promise<number> {
  const t0 = performance.now();
  while (!(await cond())) {
    if (performance.now() - t0 > ms) throw new Error(`not within ${ms} ms`);
    await Bun.sleep(everyMs);
  }
  return performance.now() - t0;
}
