/**
 * `useService({...})`: the one fixture for a suite that needs a real `bin/sandboxd up`. Called at
 * the top of a test file, it registers the file's hooks:
 *
 * - beforeAll: a private data dir seeded from the shared test cache (guest artifacts, the python
 *   layout, every image already imported: prepareDataDir), `up` on a port the OS picks, the
 *   suite's keys (made in this process through the service's operator socket), and the python
 *   template ready when the suite asked for it;
 * - afterEach: the cleanups the tests registered (a sandbox to delete, ...), also after a failed
 *   test, so one failure does not spill into the next test's leak check;
 * - afterAll: the file's `beforeStop` cleanups while `up` still runs, then `up` stopped, any QEMU
 *   it left killed by pid, the data dir removed.
 *
 * `stop()` is the same teardown on demand, for a suite's last test that checks nothing is left.
 */
import { afterAll, afterEach, beforeAll, expect } from "bun:test";
import { readdir } from "node:fs/promises";
import { join } from "node:path";
import type { CatalogImageId } from "../../agent/catalog/python.ts";
import type { Tier } from "../../contracts/api/tiers.ts";
import { bestEffort } from "../../contracts/best-effort.ts";
import {
  type Api,
  createKeys,
  prepareDataDir,
  qemusUnder,
  type RunningService,
  reapQemus,
  removeDataDir,
  startUp,
  waitFor,
  waitForTemplate,
} from "./e2e-service.ts";

/**
 * A cold start under TCG on a loaded 2-core host: the python template's boot and snapshot (its
 * image comes imported from the shared cache) plus `up`'s own start; 10 min leaves room for a
 * first run that also debootstraps the python layout and builds the guest artifacts.
 */
export const SERVICE_SETUP_TIMEOUT_MS = 600_000;
/** `up`'s shutdown (it leaves sandboxes running for the next start) and the reap of its QEMUs. */
export const SERVICE_TEARDOWN_TIMEOUT_MS = 60_000;

export interface ServiceOptions<K extends string> {
  /** The data dir's name prefix under /tmp (must start with `sbx-e2e`). */
  prefix?: string;
  /** Builds and waits for the python catalog template (default); false runs `up --no-catalog`. */
  python?: boolean;
  /** The catalog templates `up` builds and the fixture waits for (default: python's alone). */
  catalog?: readonly CatalogImageId[];
  /** More arguments for `up`. */
  args?: string[];
  /** Operator settings for `up`'s environment. */
  env?: Record<string, string>;
  /** Keys by name: `{ pro: ["acme", "pro"] }`. */
  keys?: Record<K, readonly [tenant: string, tier: Tier]>;
}

export interface ServiceFixture<K extends string> {
  /** The running service (throws when beforeAll failed to start it). */
  readonly svc: RunningService;
  readonly api: Api;
  readonly keys: Record<K, string>;
  readonly dataDir: string;
  /** Whether `up` runs (false before beforeAll, after `stop()` and when it failed to start). */
  readonly running: boolean;
  /** Runs `fn` after the current test, pass or fail (deleting what the test made). */
  cleanup(fn: () => Promise<unknown>): void;
  /**
   * Runs `fn` after the file's tests while `up` still runs, before the fixture stops it (deleting
   * through the API what a failed test left). Skipped when `up` is no longer running; a failure
   * is logged, never thrown, so the stop and the data dir's removal always follow.
   */
  beforeStop(fn: () => Promise<unknown>): void;
  /** The VM directories of `up`'s agent (one per live VM, pre-launched and warm ones included). */
  vmDirs(): Promise<string[]>;
  /** Asserts that no QEMU runs for the data dir and no VM directory is left (waits up to 10 s). */
  expectNoVms(): Promise<void>;
  /** Stops `up` and reaps its QEMUs; what was still running is reported. Idempotent. */
  stop(): Promise<{ exit: number | null; qemus: number[] }>;
  /** Starts `up` again on the same data dir (after `stop()`), with these extra args and env. */
  restart(args?: string[], env?: Record<string, string>): Promise<RunningService>;
}

export function useService<K extends string = never>(opts: ServiceOptions<K> = {}): ServiceFixture<K> {
  const catalog = opts.python === false ? [] : (opts.catalog ?? ["python"]);
  const baseArgs = [
    ...(catalog.length > 0 ? ["--catalog", catalog.join(",")] : ["--no-catalog"]),
    ...(opts.args ?? []),
  ];
  let svc: RunningService | undefined;
  let dataDir = "";
  let keys: Record<K, string> | undefined;
  const cleanups: (() => Promise<unknown>)[] = [];
  const beforeStops: (() => Promise<unknown>)[] = [];
  let stopped: { exit: number | null; qemus: number[] } | undefined;

  const current = () => {
    if (!svc) throw new Error("the service is not running (see beforeAll, or stop() was called)");
    return svc;
  };

  const stop = async () => {
    if (stopped) return stopped;
    const s = svc;
    svc = undefined;
    const exit = s ? await s.stop() : null;
    stopped = { exit, qemus: dataDir ? await reapQemus(dataDir) : [] };
    return stopped;
  };

  const vmDirs = () => readdir(join(dataDir, "agent", "vms")).catch(() => [] as string[]);

  beforeAll(async () => {
    dataDir = await prepareDataDir(opts.prefix ?? "sbx-e2e-", { catalog });
    svc = await startUp(dataDir, baseArgs, opts.env ?? {});
    // While `up` runs a key goes through its operator socket: milliseconds, no PGlite open here.
    keys = await createKeys(dataDir, opts.keys ?? ({} as Record<K, readonly [string, Tier]>));
    for (const id of catalog) await waitForTemplate(svc, id, SERVICE_SETUP_TIMEOUT_MS - 60_000);
  }, SERVICE_SETUP_TIMEOUT_MS);

  afterEach(async () => {
    for (const fn of cleanups.splice(0).reverse()) await fn().catch(() => undefined);
  });

  afterAll(async () => {
    for (const fn of beforeStops) {
      if (!svc) break;
      await bestEffort((m) => console.warn(m), "cleanup before the service's stop", fn);
    }
    await stop();
    if (dataDir) await removeDataDir(dataDir);
  }, SERVICE_TEARDOWN_TIMEOUT_MS);

  return {
    get svc() {
      return current();
    },
    get api() {
      return current().api;
    },
    get keys() {
      if (!keys) throw new Error("no keys: the service did not start (see beforeAll)");
      return keys;
    },
    get dataDir() {
      return dataDir;
    },
    get running() {
      return svc !== undefined;
    },
    cleanup: (fn) => {
      cleanups.push(fn);
    },
    beforeStop: (fn) => {
      beforeStops.push(fn);
    },
    vmDirs,
    async expectNoVms() {
      const clean = await waitFor(async () => (await qemusUnder(dataDir)).length === 0, 10_000);
      expect({ clean, qemus: await qemusUnder(dataDir) }).toEqual({ clean: true, qemus: [] });
      expect(await waitFor(async () => (await vmDirs()).length === 0, 10_000)).toBe(true);
    },
    stop,
    async restart(args = [], env = {}) {
      await stop();
      stopped = undefined;
      svc = await startUp(dataDir, [...baseArgs, ...args], { ...(opts.env ?? {}), ...env });
      return svc;
    },
  };
}
