/**
 * The runner's worker pool: N workers take jobs from one queue under the rules of the full tier.
 * Quick files run beside anything, from the start. A full-tier file waits for the shared test
 * cache; an exclusive one runs with no other full-tier file beside it (quick files still fill the
 * other workers), and the other full-tier files start once every exclusive one has run.
 */

export interface Job {
  run: () => Promise<void>;
  exclusive: boolean;
  /** A full-tier file: waits for the shared test cache, and never runs beside an exclusive one. */
  needsCache: boolean;
}

/**
 * Runs every job of `queue` (taken in order, each as soon as the rules allow) on `workers`
 * workers; `cache` builds the shared test cache (undefined when no job needs it). Resolves when
 * the queue and the cache build are done.
 */
export async function runPool(
  queue: Job[],
  workers: number,
  cache: (() => Promise<void>) | undefined,
): Promise<void> {
  let cacheReady = cache === undefined;
  let runningFull = 0;
  let runningExclusive = 0;
  let pendingExclusive = queue.filter((j) => j.exclusive).length;
  const waiters: (() => void)[] = [];
  const wake = () => {
    for (const w of waiters.splice(0)) w();
  };
  const built = cache
    ? cache().finally(() => {
        cacheReady = true;
        wake();
      })
    : Promise.resolve();
  const eligible = (j: Job) => {
    if (!j.needsCache) return true;
    if (!cacheReady) return false;
    if (j.exclusive) return runningFull === 0;
    return pendingExclusive === 0 && runningExclusive === 0;
  };
  /** The next job a worker may start now; waits while only jobs that may not start yet are left. */
  const take = async (): Promise<Job | undefined> => {
    for (;;) {
      const i = queue.findIndex(eligible);
      if (i >= 0) {
        const j = queue.splice(i, 1)[0]!;
        // Counted as it is taken, before any other worker looks: two exclusive files never pair.
        if (j.needsCache) runningFull++;
        if (j.exclusive) runningExclusive++;
        return j;
      }
      if (queue.length === 0) return undefined;
      await new Promise<void>((resolve) => waiters.push(resolve));
    }
  };
  const runOne = async (j: Job) => {
    try {
      await j.run();
    } finally {
      if (j.needsCache) runningFull--;
      if (j.exclusive) {
        runningExclusive--;
        pendingExclusive--;
      }
      wake();
    }
  };
  const pool = Array.from({ length: Math.min(workers, queue.length) }, async () => {
    for (let next = await take(); next; next = await take()) await runOne(next);
  });
  await Promise.all([...pool, built]);
}
