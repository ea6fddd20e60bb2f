/**
 * `bin/sandboxd bench --density --max 3` and `bench --burst 3` end to end: the real CLI in a
 * subprocess, each starting a real `up` on the busybox fixture. Checks the JSON's shape, that the
 * figures are real (3 sandboxes held at once, each QEMU's PSS measured, 3 creates answered), and
 * that nothing is left: the result's own leftover count, and independently no QEMU naming the
 * run's data dir, no data dir, no RAM-file root. Speed is never asserted.
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { existsSync, mkdtempSync, readdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { defaultShmRoot } from "../../agent/snapshot/template.ts";
import { qemuPidsNaming } from "../../agent/vm/process.ts";
import type { BurstResult, DensityResult, ServiceLeftovers } from "../../bench/density.ts";
import { busyboxImageSpec, makeDockerArchive } from "../fixtures/images.ts";
import { runCli, SHARED_DATA_DIR } from "../support/e2e-service.ts";

/**
 * A harness bound, not a speed assertion: `up`, two keys (PGlite migrates on each), a template
 * build and 3-4 restores under TCG on a loaded 2-core host; the artifacts may be built first.
 */
const RUN_TIMEOUT_MS = 300_000;
const scratch = mkdtempSync(join(tmpdir(), "bench-density-test-"));
const image = join(scratch, "busybox.tar");

/** The data dirs the benchmark makes (bench/density-service.ts `withService`). */
function runDirs(): string[] {
  return readdirSync(tmpdir()).filter((n) => n.startsWith("sbx-density-"));
}

beforeAll(async () => {
  await makeDockerArchive(image, await busyboxImageSpec(join(scratch, "img")));
});

afterAll(() => {
  rmSync(scratch, { recursive: true, force: true });
});

/** Runs `bench` with `args`, returns its parsed JSON, and checks it left nothing behind. */
async function bench<T>(args: string[]): Promise<T & ServiceLeftovers> {
  const before = new Set(runDirs());
  const r = await runCli(
    ["bench", "--image", image, "--data-dir", SHARED_DATA_DIR, ...args],
    { ...process.env, SANDBOXD_QUIET: "0" },
    RUN_TIMEOUT_MS,
  );
  if (r.code !== 0) throw new Error(`bench ${args.join(" ")} exited ${r.code}:\n${r.stderr.slice(-3000)}`);
  const out = JSON.parse(r.stdout) as T & ServiceLeftovers;
  expect(out.leftovers).toEqual({ qemu_processes: [], vm_dirs: [], cgroups: [], uid_locks: [] });
  const made = /data (\/\S+)/.exec(r.stderr)?.[1];
  expect(made).toBeDefined();
  const dataDir = made as string;
  expect(existsSync(dataDir)).toBe(false);
  expect(existsSync(defaultShmRoot(join(dataDir, "agent")))).toBe(false);
  expect(await qemuPidsNaming([dataDir])).toEqual([]);
  expect(runDirs().filter((d) => !before.has(d))).toEqual([]);
  return out;
}

test(
  "bench --density --max 3: three idle sandboxes held, their PSS measured, all freed",
  async () => {
    const d = await bench<DensityResult>(["--density", "--max", "3"]);
    expect(d.mode).toBe("density");
    expect(d.count).toBe(3);
    expect(d.stopped_by).toBe("max");
    expect(d.memory.running_vms).toBe(3);
    expect(d.memory.pss_per_vm_mib).toBeGreaterThan(0);
    expect(d.memory.qemu_own_per_vm_mib).toBeGreaterThan(0);
    expect(d.memory.guest_ram_per_vm_mib).toBeGreaterThan(0);
    expect(d.memory.pss_total_mib).toBeGreaterThanOrEqual(d.memory.pss_per_vm_mib * 3);
    expect(d.create_ms.p50).toBeGreaterThan(0);
    // The template's RAM file is sparse: a 256 MiB guest's file holds far less than 256 MiB.
    expect(d.template_ram_files_mib).toBeGreaterThan(0);
    expect(d.template_ram_files_mib).toBeLessThan(256);
    expect(d.memory_bound_estimate).toBeGreaterThan(0);
    expect(d.host_mem_total_mib).toBeGreaterThan(0);
    expect(d.delete_failures).toBe(0);
  },
  RUN_TIMEOUT_MS + 30_000,
);

test(
  "bench --burst 3: a single create as the floor, three at once, percentiles, all freed",
  async () => {
    const b = await bench<BurstResult>(["--burst", "3"]);
    expect(b.mode).toBe("burst");
    expect(b.n).toBe(3);
    expect(b.single_create_ms).toBeGreaterThan(0);
    expect(b.successes + b.failures).toBe(3);
    // 3 creates fit any host the suite runs on (the agent's default capacity is 4 vCPUs per core).
    expect(b.successes).toBe(3);
    expect(b.failures_by_code).toEqual({});
    expect(b.create_ms.p50).toBeGreaterThan(0);
    expect(b.create_ms.p50).toBeLessThanOrEqual(b.create_ms.p95);
    expect(b.create_ms.p95).toBeLessThanOrEqual(b.create_ms.p99);
    expect(b.wall_ms).toBeGreaterThan(0);
    expect(b.delete_failures).toBe(0);
  },
  RUN_TIMEOUT_MS + 30_000,
);

test("bench rejects --density with --burst, and a bad --max", async () => {
  for (const args of [
    ["--density", "--burst", "3"],
    ["--density", "--max", "0"],
    ["--burst", "x"],
  ]) {
    const r = await runCli(["bench", "--image", image, ...args]);
    expect(r.code).not.toBe(0);
    expect(r.stderr).toMatch(/--(density|max|burst)/);
  }
});
