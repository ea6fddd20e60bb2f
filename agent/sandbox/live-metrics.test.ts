/**
 * The host-side sampler (live-metrics.ts, agent/vm/proc-stats.ts) on real processes: a copy of
 * `yes` named like a QEMU burns CPU and is measured; a process with another name is never
 * measured (a pid handed to something else after QEMU ended); the ring keeps the last N samples;
 * nothing the guest says is read.
 */
import { afterAll, expect, test } from "bun:test";
import { copyFileSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { parseProcStats, readProcStats } from "../vm/proc-stats.ts";
import { LiveMetrics } from "./live-metrics.ts";

const dir = mkdtempSync(join(tmpdir(), "sandboxd-metrics-"));
const procs: Bun.Subprocess[] = [];
afterAll(() => {
  for (const p of procs) p.kill("SIGKILL");
  rmSync(dir, { recursive: true, force: true });
});

/** A process whose command name is `name`: a copy of `yes` writing to /dev/null (one core busy). */
function burner(name: string): Bun.Subprocess {
  return named(name, "/usr/bin/yes", []);
}

/** `program` run under the command name `name` (a copy of it). */
function named(name: string, program: string, args: string[]): Bun.Subprocess {
  const bin = join(dir, name);
  copyFileSync(program, bin);
  const p = Bun.spawn([bin, ...args], { stdout: "ignore", stderr: "ignore" });
  procs.push(p);
  return p;
}

test("parseProcStats reads utime+stime after a command name with spaces and ')'", () => {
  const fields = Array.from({ length: 50 }, (_, i) => String(i));
  fields[11] = "250"; // utime, ticks
  fields[12] = "50"; // stime
  const stat = `1234 (qemu-system-x) (y) ${fields.join(" ")}\n`;
  const status = "Name:\tqemu\nVmRSS:\t   2048 kB\nRssAnon:\t    1024 kB\n";
  expect(parseProcStats(stat, status)).toEqual({
    cpuMs: 3000,
    residentBytes: 2048 * 1024,
    anonBytes: 1024 * 1024,
  });
  expect(parseProcStats(stat.replace("qemu-system-x", "bash"), status)).toBeUndefined();
});

test("a process not named qemu-system is never measured", async () => {
  const p = burner("not-a-qemu");
  expect(await readProcStats(p.pid)).toBeUndefined();
  expect(await readProcStats(2 ** 22 + 1)).toBeUndefined(); // above pid_max: no such process
});

test("a busy QEMU-named process shows more CPU than an idle one; the ring keeps the last N samples", async () => {
  const busy = burner("qemu-system-burn");
  const idle = named("qemu-system-idle", "/usr/bin/sleep", ["600"]);
  const m = new LiveMetrics({
    targets: () => [
      { id: "vm-busy", pid: busy.pid },
      { id: "vm-idle", pid: idle.pid },
      { id: "vm-gone", pid: undefined }, // suspended: no QEMU, never sampled
    ],
    diskBytes: async (id) => (id === "vm-busy" ? 4096 : 0),
    samples: 3,
  });
  // 5 sweeps 500 ms apart: each rate spans 50 clock ticks, so one tick is 2%.
  for (let i = 0; i < 5; i++) {
    if (i > 0) await Bun.sleep(500);
    await m.sweep();
  }
  const h = m.history("vm-busy");
  expect(h).toHaveLength(3);
  expect(h.map((s) => s.atMs)).toEqual([...h.map((s) => s.atMs)].sort((a, b) => a - b));
  const mean = (id: string) => {
    const v = m.history(id).map((s) => s.cpuPercent ?? 0);
    return v.reduce((a, b) => a + b, 0) / v.length;
  };
  // One thread spinning is up to 100% of a core (less on a host other work loads); sleep is 0.
  console.log(`cpu %: busy ${mean("vm-busy").toFixed(1)}, idle ${mean("vm-idle").toFixed(1)}`);
  expect(mean("vm-busy")).toBeGreaterThan(5);
  expect(mean("vm-idle")).toBeLessThan(2);
  expect(h.at(-1)?.memResidentBytes).toBeGreaterThan(0);
  expect(h.at(-1)?.memUsedBytes).toBeGreaterThan(0);
  expect(h.at(-1)?.diskBytes).toBe(4096);
  expect(m.history("vm-gone")).toEqual([]);
  expect(m.lastSweep.vms).toBe(2);
  console.log(`one sweep of 2 processes: ${m.lastSweep.ms.toFixed(3)} ms`);
});

test("a VM that is no longer held has its ring dropped; a new pid starts its CPU rate over", async () => {
  const a = burner("qemu-system-a");
  const b = burner("qemu-system-b");
  let targets = [{ id: "vm-x", pid: a.pid as number | undefined }];
  const m = new LiveMetrics({ targets: () => targets, diskBytes: async () => 0 });
  await m.sweep();
  await m.sweep();
  expect(m.history("vm-x")[0]?.cpuPercent).toBeNull();
  expect(m.history("vm-x")[1]?.cpuPercent).not.toBeNull();
  targets = [{ id: "vm-x", pid: b.pid }]; // resumed: another QEMU
  await m.sweep();
  expect(m.history("vm-x")[2]?.cpuPercent).toBeNull();
  targets = [];
  await m.sweep();
  expect(m.history("vm-x")).toEqual([]);
});

test("the figures never come from the guest: the sampler and its /proc reader import nothing of the guest's", () => {
  // The guest is hostile: a figure it reported could say anything. Only the host's /proc and the
  // overlay's stat are read (docs/metrics.md "Rules of live metrics").
  for (const f of ["live-metrics.ts", "../vm/proc-stats.ts"]) {
    const src = readFileSync(join(import.meta.dir, f), "utf8");
    const imports = [...src.matchAll(/from "([^"]+)"/g)].map((x) => x[1]);
    expect(imports.filter((i) => i?.includes("guest"))).toEqual([]);
    expect(src).not.toMatch(/\.guest\b/);
  }
});
