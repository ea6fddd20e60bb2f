/**
 * `bin/sandboxd bench` end to end: the real CLI in a subprocess on the busybox fixture, once, with
 * few samples. Checks the JSON's shape, that every figure is a finite positive number, and that the
 * run left nothing behind (no QEMU, no scratch dir, no RAM file, nothing new in the data dir).
 * Speed is never asserted here: the targets are the benchmark's own `targets` block.
 * Also unit checks of the percentile and smaps parsing the figures rest on.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { spawn } from "node:child_process";
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { qemuPidsNaming } from "../../agent/vm/process.ts";
import { KEPT_COLD_ROLLBACKS, KEPT_ROLLBACKS, KEPT_STARTS } from "../../bench/engine-kept.ts";
import type { GatewayBenchResult } from "../../bench/gateway.ts";
import { defaultForkChildren, type HttpBenchResult } from "../../bench/http.ts";
import { parseRollup, parseSmapsFor } from "../../bench/rss.ts";
import type { SoakResult } from "../../bench/soak.ts";
import { percentile, summarize } from "../../bench/stats.ts";
import { busyboxImageSpec, makeDockerArchive } from "../fixtures/images.ts";
import { prepareDataDir, removeDataDir } from "../support/e2e-service.ts";

const REPO = resolve(import.meta.dir, "../..");
/** Guest artifacts and imported images are cached here (shared with the other suites). */
/**
 * Its own data dir (the guest artifacts copied from the shared test cache): the leftover checks
 * below compare the dir's VM dirs and temp files before and after, which other files running
 * beside this one would add to in the shared one.
 */
let DATA_DIR = "";
/**
 * One benchmark run boots a VM, builds a template, restores ~35 VMs and keeps one snapshot under
 * TCG on a 2-core host: ~20 s here; the artifacts may have to be built first on a fresh machine.
 * 300 s covers it.
 */
const BENCH_TIMEOUT_MS = 300_000;
const scratch = mkdtempSync(join(tmpdir(), "bench-test-"));
const image = join(scratch, "busybox.tar");
/** The same image exposing a port, for the tunnel of `bench --http`. */
const HTTP_PORT = 8080;
const imageWithPort = join(scratch, "busybox-port.tar");

interface Run {
  code: number | null;
  stdout: string;
  stderr: string;
}

function sandboxd(args: string[]): Promise<Run> {
  return new Promise((done) => {
    const child = spawn(join(REPO, "bin/sandboxd"), args, {
      env: { ...process.env, SANDBOXD_DATA_DIR: DATA_DIR, SANDBOXD_QUIET: "0" },
      stdio: ["ignore", "pipe", "pipe"],
    });
    let stdout = "";
    let stderr = "";
    child.stdout.on("data", (b: Buffer) => {
      stdout += b.toString();
    });
    child.stderr.on("data", (b: Buffer) => {
      stderr += b.toString();
    });
    child.on("close", (code) => done({ code, stdout, stderr }));
  });
}

function entries(dir: string): string[] {
  return existsSync(dir) ? readdirSync(dir) : [];
}

beforeAll(async () => {
  DATA_DIR = await prepareDataDir("sbx-e2e-bench-", { python: false });
  await makeDockerArchive(image, await busyboxImageSpec(join(scratch, "img")));
  await makeDockerArchive(
    imageWithPort,
    await busyboxImageSpec(join(scratch, "img-port"), {
      config: { ExposedPorts: { [`${HTTP_PORT}/tcp`]: {} } },
    }),
  );
});

afterAll(async () => {
  rmSync(scratch, { recursive: true, force: true });
  if (DATA_DIR) await removeDataDir(DATA_DIR);
});

const STATS_KEYS = [
  "spawn_ms",
  "spawn_restore_ms",
  "spawn_prelaunched_ms",
  "prelaunch_ms",
  "floor_restore_ms",
  "exec_rtt_ms",
  "fork_parent_stall_summary_ms",
  "fork_stop_copy_stall_ms",
  "fork_populate_ms",
  "restore_in_place_ms",
  "restore_in_place_down_ms",
  "restore_in_place_cold_ms",
  "from_snapshot_ms",
];
/** The parts of a rollback's down time, each a summary. */
const RESTORE_PART_KEYS = ["load", "hello", "identity"];
const SCALAR_KEYS = [
  "guest_mem_mib",
  "vcpus",
  "boot_ms",
  "template_snapshot_ms",
  "spawn_vs_floor",
  "fork_parent_stall_ms",
  "fork_children_stall_ms",
  "fork_children",
  "fork_children_ms",
  "fork_children_ready_ms",
  "fork_children_floor_ms",
  "fork_children_vs_floor",
  "fork_children_exec_vs_floor",
  "suspend_ms",
  "resume_ms",
  "snapshot_stall_ms",
  "snapshot_stall_vs_fork_stall",
  "snapshot_ms",
  "snapshot_bytes",
  "restore_in_place_vs_floor",
  "restore_in_place_down_vs_floor",
  "from_snapshot_vs_floor",
  "from_snapshot_vs_spawn_restore",
  "idle_vms",
  "host_rss_per_idle_vm_mb",
  "template_ram_file_mb",
  "total_ms",
];
/** A fork's time, part by part; the per-child parts are {p50, max}. */
const FORK_PART_KEYS = ["prepare", "populate", "parent_stall", "stream", "child_base", "first_exec"];
const FORK_CHILD_PART_KEYS = ["child_launch", "child_load", "child_hello", "child_identity"];
const MEMORY_KEYS = ["pss", "rss", "private_dirty", "guest_ram_dirty", "guest_ram_shared", "qemu_own"];
const TARGET_KEYS = [
  "spawn_vs_floor",
  "exec_rtt_p50_ms",
  "fork_parent_stall_ms",
  "fork_children_ms",
  "fork_children_vs_floor",
  "host_rss_per_idle_vm_mb",
  "restore_in_place_ms",
];

/** Every number anywhere in `v`, with its path. */
function numbers(v: unknown, path = ""): [string, number][] {
  if (typeof v === "number") return [[path, v]];
  if (v && typeof v === "object")
    return Object.entries(v).flatMap(([k, x]) => numbers(x, path ? `${path}.${k}` : k));
  return [];
}

describe("sandboxd bench", () => {
  test(
    "prints one JSON object of finite positive figures and leaves nothing behind",
    async () => {
      const vmsBefore = new Set(entries(join(DATA_DIR, "vms")));
      const tmpBefore = new Set(entries(join(DATA_DIR, "tmp")));
      const r = await sandboxd([
        "bench",
        "--image",
        image,
        "--json",
        "--spawns",
        "3",
        "--execs",
        "10",
        "--data-dir",
        DATA_DIR,
      ]);
      if (r.code !== 0) console.error(r.stderr);
      expect(r.code).toBe(0);
      const out = JSON.parse(r.stdout) as Record<string, unknown>;
      console.log(`BENCH_FIGURES ${JSON.stringify(out)}`);

      // Shape.
      expect(Object.keys(out).sort()).toEqual(
        [
          "accel",
          "accel_reason",
          "fork_method",
          ...SCALAR_KEYS,
          ...STATS_KEYS,
          "host_memory_per_idle_vm_mb",
          "restore_in_place_parts_ms",
          "spawn_parts_ms",
          "fork_children_breakdown_ms",
          "fork_children_stop_copy",
          "targets",
        ].sort(),
      );
      expect(["tcg", "kvm"]).toContain(out.accel as string);
      expect(typeof out.accel_reason).toBe("string");
      for (const k of SCALAR_KEYS) expect(typeof out[k]).toBe("number");
      for (const k of STATS_KEYS) expect(Object.keys(out[k] as object).sort()).toEqual(["n", "p50", "p95"]);
      expect(Object.keys(out.host_memory_per_idle_vm_mb as object).sort()).toEqual([...MEMORY_KEYS].sort());
      const parts = out.restore_in_place_parts_ms as Record<string, object>;
      expect(Object.keys(parts).sort()).toEqual([...RESTORE_PART_KEYS].sort());
      for (const k of RESTORE_PART_KEYS)
        expect(Object.keys(parts[k] as object).sort()).toEqual(["n", "p50", "p95"]);
      const spawnParts = out.spawn_parts_ms as Record<string, object>;
      expect(Object.keys(spawnParts).sort()).toEqual(["hello", "identity", "launch", "load", "setup"]);
      for (const v of Object.values(spawnParts)) expect(Object.keys(v).sort()).toEqual(["n", "p50", "p95"]);
      const forkParts = (b: unknown) => {
        const o = b as Record<string, unknown>;
        expect(Object.keys(o).sort()).toEqual([...FORK_PART_KEYS, ...FORK_CHILD_PART_KEYS].sort());
        for (const k of FORK_CHILD_PART_KEYS)
          expect(Object.keys(o[k] as object).sort()).toEqual(["max", "p50"]);
      };
      forkParts(out.fork_children_breakdown_ms);
      const stopCopy = out.fork_children_stop_copy as Record<string, unknown>;
      expect(Object.keys(stopCopy).sort()).toEqual([
        "breakdown_ms",
        "ms",
        "ready_ms",
        "stall_ms",
        "vs_floor",
      ]);
      forkParts(stopCopy.breakdown_ms);
      // The children answer the agent before they answer an exec; the ratio is to the same run's floor.
      expect(out.fork_children_ready_ms as number).toBeLessThanOrEqual(out.fork_children_ms as number);
      expect(out.fork_children_vs_floor).toBeCloseTo(
        (out.fork_children_ready_ms as number) / (out.fork_children_floor_ms as number),
        1,
      );
      const targets = out.targets as Record<string, { limit: number; value: number; pass: boolean }>;
      expect(Object.keys(targets).sort()).toEqual([...TARGET_KEYS].sort());
      for (const t of Object.values(targets)) {
        expect(Object.keys(t).sort()).toEqual(["limit", "pass", "value"]);
        expect(typeof t.pass).toBe("boolean");
      }
      // The options reached the run.
      expect(out.guest_mem_mib).toBe(256);
      expect(out.vcpus).toBe(1);
      expect((out.spawn_ms as { n: number }).n).toBe(3);
      expect((out.spawn_prelaunched_ms as { n: number }).n).toBe(3);
      expect((out.floor_restore_ms as { n: number }).n).toBe(3);
      expect((out.exec_rtt_ms as { n: number }).n).toBe(10);
      expect(out.fork_children).toBe(8);
      // The agent's default: a background snapshot (this host gives QEMU userfaultfd).
      expect(out.fork_method).toBe("snapshot");
      expect((out.fork_parent_stall_summary_ms as { n: number }).n).toBe(3);
      expect((out.fork_stop_copy_stall_ms as { n: number }).n).toBe(3);
      expect(targets.spawn_vs_floor?.value).toBe(out.spawn_vs_floor as number);
      // One snapshot, rolled back to KEPT_ROLLBACKS times, KEPT_STARTS VMs started from it; the
      // ratios are to the floor of the same run.
      expect((out.restore_in_place_ms as { n: number }).n).toBe(KEPT_ROLLBACKS);
      expect((out.restore_in_place_down_ms as { n: number }).n).toBe(KEPT_ROLLBACKS);
      expect((out.restore_in_place_cold_ms as { n: number }).n).toBe(KEPT_COLD_ROLLBACKS);
      expect((parts.identity as { n: number }).n).toBe(KEPT_ROLLBACKS);
      expect((out.from_snapshot_ms as { n: number }).n).toBe(KEPT_STARTS);
      const p50 = (k: string) => (out[k] as { p50: number }).p50;
      expect(out.restore_in_place_vs_floor).toBeCloseTo(
        p50("restore_in_place_ms") / p50("floor_restore_ms"),
        1,
      );
      expect(targets.restore_in_place_ms?.value).toBe(p50("restore_in_place_ms"));
      expect(targets.restore_in_place_ms?.limit).toBe(100);
      // The down part is inside the whole rollback.
      expect(p50("restore_in_place_down_ms")).toBeLessThanOrEqual(p50("restore_in_place_ms"));

      // Every figure: a finite positive number (no NaN, no -1 "not measured").
      const nums = numbers(out);
      expect(nums.length).toBeGreaterThan(30);
      // Stop-and-copy neither populates nor streams after its stall: those two are 0 there.
      const notApplicable = [
        "fork_children_stop_copy.breakdown_ms.populate",
        "fork_children_stop_copy.breakdown_ms.stream",
      ];
      const bad = nums.filter(
        ([k, x]) => !(Number.isFinite(x) && (x > 0 || (x === 0 && notApplicable.includes(k)))),
      );
      expect(bad).toEqual([]);

      // Nothing left behind: the run's scratch dirs (it names them on stderr) are gone, no QEMU
      // names them, and the data dir holds no new VM dir or temp file.
      const m = /scratch dirs (\S+) (\S+)/.exec(r.stderr);
      expect(m).not.toBeNull();
      const dirs = [m?.[1] as string, m?.[2] as string];
      for (const d of dirs) expect(existsSync(d)).toBe(false);
      expect(await qemuPidsNaming(dirs)).toEqual([]);
      expect(entries(join(DATA_DIR, "vms")).filter((e) => !vmsBefore.has(e))).toEqual([]);
      expect(entries(join(DATA_DIR, "tmp")).filter((e) => !tmpBefore.has(e))).toEqual([]);
    },
    BENCH_TIMEOUT_MS,
  );

  test("bench without --image is a usage error", async () => {
    const r = await sandboxd(["bench", "--json"]);
    expect(r.code).toBe(125);
    expect(r.stderr).toContain("bench needs --image");
    expect(r.stdout).toBe("");
  });
});

/**
 * Bounds of the soak test: what 20 cycles may add to the service. RSS: the JIT, the allocator's
 * arenas and PGlite's buffers settle within a few cycles of the warm-up; a leak of one VM's
 * bookkeeping per cycle (tunnels, guest clients, records) would show as steady growth past it.
 * Fds: the database's files and a keep-alive socket or two may come and go. The data dir grows
 * by the database's rows and its WAL, not by VM files.
 */
const SOAK_CYCLES = 20;
const SOAK_RSS_GROWTH_KIB = 64 * 1024;
const SOAK_FD_SLACK = 4;
const SOAK_DATA_GROWTH_BYTES = 32 * 2 ** 20;

describe("sandboxd bench --soak", () => {
  test(
    `${SOAK_CYCLES} create -> exec -> delete cycles through a real up leak nothing`,
    async () => {
      const r = await sandboxd([
        "bench",
        "--soak",
        String(SOAK_CYCLES),
        "--image",
        image,
        "--data-dir",
        DATA_DIR,
      ]);
      if (r.code !== 0) console.error(r.stderr);
      expect(r.code).toBe(0);
      const out = JSON.parse(r.stdout) as SoakResult;
      console.log(
        `SOAK ${JSON.stringify(out)} bounds: rss +${SOAK_RSS_GROWTH_KIB} KiB, fds +${SOAK_FD_SLACK}, data dir +${SOAK_DATA_GROWTH_BYTES} B`,
      );
      expect(out.cycles).toBe(SOAK_CYCLES);
      expect(out.failures).toBe(0);
      expect(out.leftovers).toEqual({ qemu_processes: [], vm_dirs: [], cgroups: [], uid_locks: [] });
      expect(out.end.open_fds).toBeLessThanOrEqual(out.start.open_fds + SOAK_FD_SLACK);
      expect(out.end.rss_kib).toBeLessThanOrEqual(out.start.rss_kib + SOAK_RSS_GROWTH_KIB);
      // No RAM file outlives its sandbox: what is on /dev/shm is the template's, as at the start.
      expect(out.end.shm_bytes).toBeLessThanOrEqual(out.start.shm_bytes);
      expect(out.end.data_dir_bytes).toBeLessThanOrEqual(out.start.data_dir_bytes + SOAK_DATA_GROWTH_BYTES);
      // The service's heap after a full GC at start, middle and end, and the series between.
      for (const m of [out.start, out.middle, out.end]) {
        expect(m.heap_bytes).toBeGreaterThan(0);
        expect(m.object_count).toBeGreaterThan(0);
        expect(m.rss_anon_kib).toBeGreaterThan(0);
      }
      expect(out.series.map((p) => p.cycle)).toEqual([0, SOAK_CYCLES / 2, SOAK_CYCLES]);
      // The soak's own data dir is gone (the JSON names nothing of it that still exists).
      expect(entries(tmpdir()).filter((e) => e.startsWith("sbx-soak-"))).toEqual([]);
    },
    BENCH_TIMEOUT_MS,
  );
});

describe("sandboxd bench --http", () => {
  test(
    "the service's figures beside the engine's from the same run, and nothing left behind",
    async () => {
      const vmsBefore = new Set(entries(join(DATA_DIR, "vms")));
      const tmpBefore = new Set(entries(tmpdir()).filter((e) => e.startsWith("sbx-bench-http-")));
      const r = await sandboxd([
        "bench",
        "--http",
        "--image",
        imageWithPort,
        "--creates",
        "2",
        "--execs",
        "5",
        "--suspends",
        "1",
        "--tunnels",
        "2",
        "--tunnel-mib",
        "1",
        "--port",
        String(HTTP_PORT),
        "--data-dir",
        DATA_DIR,
      ]);
      if (r.code !== 0) console.error(r.stderr);
      expect(r.code).toBe(0);
      const out = JSON.parse(r.stdout) as HttpBenchResult;
      console.log(`BENCH_HTTP ${JSON.stringify(out)}`);
      const ops = out.operations as unknown as Record<string, Record<string, unknown>>;
      expect(Object.keys(ops).sort()).toEqual(
        ["create", "delete", "exec", "fork", "resume", "suspend", "tunnel_open"].sort(),
      );
      // Every operation: the service's summary; where the engine has the figure, its summary and
      // the difference of the p50s.
      for (const [name, op] of Object.entries(ops)) {
        expect(Object.keys(op.http as object).sort()).toEqual(["n", "p50", "p95"]);
        if (name === "delete" || name === "tunnel_open") {
          expect(op.engine).toBeNull();
          expect(op.engine_after).toBeNull();
          expect(op.share_ms).toBeNull();
          continue;
        }
        const engine = op.engine as { p50: number };
        const engineAfter = op.engine_after as { p50: number };
        expect(Object.keys(engine).sort()).toEqual(["n", "p50", "p95"]);
        expect(Object.keys(engineAfter).sort()).toEqual(["n", "p50", "p95"]);
        const http = (op.http as { p50: number }).p50;
        expect(op.share_ms).toBeCloseTo(http - (engine.p50 + engineAfter.p50) / 2, 0);
        expect(op.engine_drift_ms).toBeCloseTo(engineAfter.p50 - engine.p50, 0);
        expect(typeof op.engine_figure).toBe("string");
      }
      // The counts reached both sides (the engine ran before and after the service).
      const engines = [out.engine.before, out.engine.after];
      expect(out.operations.create.http.n).toBe(2);
      expect(out.operations.exec.http.n).toBe(5);
      expect(out.operations.exec.service_reported.n).toBe(5);
      expect(out.operations.suspend.http.n).toBe(1);
      expect(out.operations.tunnel_open.http.n).toBe(2);
      expect(out.operations.fork.children).toBe(defaultForkChildren());
      for (const e of engines) {
        expect(e.spawn_ms.n).toBe(2);
        expect(e.exec_rtt_ms.n).toBe(5);
        expect(e.fork_children).toBe(out.operations.fork.children);
      }
      expect(out.operations.exec.engine).toEqual(out.engine.before.exec_rtt_ms);
      expect(out.operations.exec.engine_after).toEqual(out.engine.after.exec_rtt_ms);
      // The floor is the engine runs', and the tunnel carried the whole file.
      expect(out.floor_restore_ms).toEqual({
        before: out.engine.before.floor_restore_ms,
        after: out.engine.after.floor_restore_ms,
      });
      expect(out.tunnel_throughput.bytes).toBeGreaterThanOrEqual(2 ** 20);
      // Every figure the service measured: a finite positive number.
      const nums = numbers({ ...out, engine: undefined, leftovers: undefined });
      // Differences (share, drift) may be negative: the service's figure within the engine's noise.
      // A load average may be 0 on an idle host.
      const signed = (k: string) =>
        k.endsWith("share_ms") || k.endsWith("drift_ms") || k.startsWith("host_load.");
      expect(nums.filter(([k, x]) => !(Number.isFinite(x) && (signed(k) || x > 0)))).toEqual([]);

      // Nothing left behind: by the service (counted after it stopped), by the engine runs, and
      // the service's own data dir is gone.
      expect(out.leftovers).toEqual({ qemu_processes: [], vm_dirs: [], cgroups: [], uid_locks: [] });
      expect(entries(join(DATA_DIR, "vms")).filter((e) => !vmsBefore.has(e))).toEqual([]);
      expect(entries(tmpdir()).filter((e) => e.startsWith("sbx-bench-http-") && !tmpBefore.has(e))).toEqual(
        [],
      );
      // Both engine runs name their scratch dirs: gone, and no QEMU names them.
      const dirs = [...r.stderr.matchAll(/scratch dirs (\S+) (\S+)/g)].flatMap((x) => [x[1]!, x[2]!]);
      expect(dirs.length).toBe(4);
      for (const d of dirs) expect(existsSync(d)).toBe(false);
      expect(await qemuPidsNaming(dirs)).toEqual([]);
    },
    BENCH_TIMEOUT_MS,
  );
});

describe("sandboxd bench --gateway", () => {
  test(
    "the exec's overhead beside the agent's own round trip, and read and health load, with nothing left behind",
    async () => {
      const tmpBefore = new Set(entries(tmpdir()).filter((e) => e.startsWith("sbx-gwbench-")));
      // Tiny counts: this checks the figures are there and consistent, never their speed.
      const r = await sandboxd([
        "bench",
        "--gateway",
        "--image",
        image,
        "--data-dir",
        DATA_DIR,
        "--execs",
        "5",
        "--seconds",
        "1",
        "--connections",
        "4",
        // Enough keys that the load stays under each key's 100 requests a second (a 429 is an
        // error): reads served from memory reach ~20,000 a second here, the cap of 200 keys.
        "--keys",
        "1000",
      ]);
      if (r.code !== 0) console.error(r.stderr);
      expect(r.code).toBe(0);
      const out = JSON.parse(r.stdout) as GatewayBenchResult;
      console.log(`GATEWAY_BENCH ${JSON.stringify(out)}`);
      expect(out.exec.count).toBe(5);
      for (const v of [out.exec.http_p50_ms, out.exec.agent_p50_ms, out.exec.own_time_p50_ms]) {
        expect(v).toBeGreaterThan(0);
      }
      expect(out.exec.overhead_p50_ms).toBeCloseTo(out.exec.http_p50_ms - out.exec.agent_p50_ms, 2);
      for (const load of [out.read, out.read_floor, out.health]) {
        expect(load.requests).toBeGreaterThan(0);
        expect(load.errors).toBe(0);
        expect(load.req_per_s).toBeGreaterThan(0);
      }
      expect(out.read.keys).toBe(1000);
      // Its data dir is gone, and no process (a QEMU of its service) names one any more.
      expect(entries(tmpdir()).filter((e) => e.startsWith("sbx-gwbench-") && !tmpBefore.has(e))).toEqual([]);
      const naming = readdirSync("/proc")
        .filter((pid) => /^\d+$/.test(pid))
        .filter((pid) => {
          try {
            return readFileSync(`/proc/${pid}/cmdline`, "utf8").includes("sbx-gwbench-");
          } catch {
            return false; // gone meanwhile
          }
        });
      expect(naming).toEqual([]);
    },
    BENCH_TIMEOUT_MS,
  );
});

describe("bench figures", () => {
  test("nearest-rank percentiles", () => {
    expect(percentile([5, 1, 3], 0.5)).toBe(3);
    expect(percentile([5, 1, 3], 0.95)).toBe(5);
    const xs = Array.from({ length: 20 }, (_, i) => i + 1);
    expect(percentile(xs, 0.5)).toBe(10);
    expect(percentile(xs, 0.95)).toBe(19);
    expect(summarize([2, 4])).toEqual({ p50: 2, p95: 4, n: 2 });
    expect(Number.isNaN(percentile([], 0.5))).toBe(true);
  });

  test("smaps parsing: the whole process and the guest RAM file's mapping", () => {
    const rollup = [
      "55d0c0000000-7ffd00000000 ---p 00000000 00:00 0                          [rollup]",
      "Rss:               78000 kB",
      "Pss:               40000 kB",
      "Shared_Clean:      30000 kB",
      "Shared_Dirty:          0 kB",
      "Private_Clean:      1000 kB",
      "Private_Dirty:     35000 kB",
    ].join("\n");
    expect(parseRollup(rollup)).toEqual({
      rss: 78000,
      pss: 40000,
      sharedClean: 30000,
      sharedDirty: 0,
      privateClean: 1000,
      privateDirty: 35000,
    });
    const ram = "/dev/shm/x/tpl-bench.mem";
    const smaps = [
      `7f0000000000-7f0010000000 rw-p 00000000 00:1a 1234                       ${ram}`,
      "Size:             262144 kB",
      "Rss:               20000 kB",
      "Pss:                5000 kB",
      "Private_Dirty:      3000 kB",
      "7f0010000000-7f0010001000 r-xp 00000000 08:01 99                         /usr/lib/libc.so.6",
      "Rss:                 900 kB",
      "Pss:                 100 kB",
      "Private_Dirty:         0 kB",
      `7f0020000000-7f0020001000 rw-p 10000000 00:1a 1234                       ${ram} (deleted)`,
      "Rss:                   4 kB",
      "Pss:                   4 kB",
      "Private_Dirty:         4 kB",
    ].join("\n");
    const g = parseSmapsFor(smaps, ram);
    expect(g.rss).toBe(20004);
    expect(g.pss).toBe(5004);
    expect(g.privateDirty).toBe(3004);
  });
});
