/**
 * The sandbox manager over the SNAPSHOT driver with REAL VMs under TCG: a warm template built from
 * the busybox fixture, spawn by restore, siblings with their own entropy and hostnames, live fork
 * (a running process and its memory carried over, divergence, fork of a fork, 4 children at once,
 * busy while an exec runs), suspend/resume, and a QEMU killed mid-exec. Every test ends with the
 * leak check: no QEMU, VM dir, overlay, state or RAM file left besides the template's own.
 * Measured figures are printed as one JSON line (AGENT_SNAPSHOT_FIGURES).
 */
import { afterAll, afterEach, beforeAll, describe, expect, test } from "bun:test";
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { rm } from "node:fs/promises";
import { join } from "node:path";
import { ensureGuestArtifacts, type GuestArtifacts } from "../../agent/guest/artifacts.ts";
import { SnapshotDriver } from "../../agent/sandbox/drivers/snapshot.ts";
import { SandboxManager } from "../../agent/sandbox/manager.ts";
import { defaultShmRoot } from "../../agent/snapshot/template.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import {
  busyboxArchive,
  COUNTER,
  codeOf,
  qemuPidsUnder,
  removeBusyboxArchive,
  TEST_CACHE_DIR,
  tempStateDir,
  waitFor,
} from "../support/real-vm.ts";

/** A test restores up to 6 VMs under TCG on a 2-core host; 180 s covers a loaded CI machine. */
const VM_TEST_TIMEOUT_MS = 180_000;
const TEMPLATE = "busybox";
/**
 * A bound for what takes a second or less (a counter's next tick, a state change, an error after a
 * kill): it only catches a hang, on a 2-core TCG host shared with other test files.
 */
const HANG_MS = 30_000;

let stateDir: string;
let shmRoot: string;
let artifacts: GuestArtifacts;
let m: SandboxManager;
const driverLog: string[] = [];
const figures: Record<string, unknown> = {};
const round = (x: number) => Math.round(x * 10) / 10;
const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)] ?? 0;

beforeAll(async () => {
  stateDir = await tempStateDir();
  shmRoot = defaultShmRoot(stateDir);
  artifacts = await ensureGuestArtifacts({ dataDir: TEST_CACHE_DIR });
  const driver = await SnapshotDriver.create({
    cacheDir: TEST_CACHE_DIR,
    stateDir,
    artifacts,
    log: (l) => driverLog.push(l),
  });
  m = await SandboxManager.open({ driver, stateDir });
  expect(m.driverName).toStartWith("snapshot (");
  const t0 = performance.now();
  m.buildTemplate(TEMPLATE, { kind: "archive", path: await busyboxArchive() });
  await m.templates.settled(TEMPLATE);
  expect(m.templates.status(TEMPLATE)).toMatchObject({ status: "ready", phase: "Live" });
  figures.template_build_ms = round(performance.now() - t0);
}, VM_TEST_TIMEOUT_MS);

afterEach(async () => {
  for (const s of m.list()) await m.destroy(s.id, { force: true });
  expect(await leaks()).toEqual({ qemus: [], files: [] });
});

afterAll(async () => {
  console.log(`AGENT_SNAPSHOT_FIGURES ${JSON.stringify(figures)}`);
  try {
    if (m) {
      for (const s of m.list()) await m.destroy(s.id, { force: true });
      await m.deleteTemplate(TEMPLATE);
      // The template's RAM file was the last file of this state dir's tmpfs directory.
      expect(existsSync(shmRoot)).toBe(false);
      expect(await leaks()).toEqual({ qemus: [], files: [] });
    }
  } finally {
    await rm(stateDir, { recursive: true, force: true });
    await rm(shmRoot, { recursive: true, force: true });
    await removeBusyboxArchive();
  }
});

function filesUnder(dir: string): string[] {
  if (!existsSync(dir)) return [];
  const out: string[] = [];
  for (const e of readdirSync(dir, { withFileTypes: true })) {
    const p = join(dir, e.name);
    if (e.isDirectory()) out.push(...filesUnder(p));
    else out.push(p);
  }
  return out;
}

/** QEMUs of this state dir, and every VM, overlay, state or RAM file but the template's. */
async function leaks(): Promise<{ qemus: number[]; files: string[] }> {
  const files = [
    ...filesUnder(join(stateDir, "vms")),
    ...filesUnder(join(stateDir, "storage", "disks")),
    ...filesUnder(join(stateDir, "storage", "suspended")),
    ...filesUnder(shmRoot).filter((f) => !f.endsWith(`/tpl-${TEMPLATE}.mem`)),
  ];
  return { qemus: await qemuPidsUnder(stateDir), files };
}

async function sh(id: string, command: string): Promise<string> {
  const r = await m.exec(id, { files: [], run: { kind: "shell", command } });
  if (r.exitCode !== 0) throw new Error(`${command}: exit ${r.exitCode}: ${r.stderr}`);
  return r.stdout;
}

const counter = async (id: string) => Number((await sh(id, "cat /tmp/c")).trim());
/**
 * Whether the counter of VM `id` passes `n` within HANG_MS (it ticks ten times a second); before
 * its first tick there is no file, read as 0.
 */
const counterPasses = (id: string, n: number) =>
  waitFor(async () => Number((await sh(id, "cat /tmp/c 2>/dev/null || echo 0")).trim()) > n, HANG_MS);

/** Whether a VM's QEMU was started to restore a snapshot (`-incoming defer`), not to boot. */
function restoredQemu(pid: number): boolean {
  return readFileSync(`/proc/${pid}/cmdline`, "utf8").split("\0").includes("-incoming");
}

/** The guest's clock of VM `id` is the host's, to the second (one second each way for the exec). */
async function expectHostClock(id: string): Promise<void> {
  const before = Math.floor(Date.now() / 1000);
  const guest = Number(await sh(id, "date +%s"));
  const after = Math.ceil(Date.now() / 1000);
  expect(guest).toBeGreaterThanOrEqual(before - 1);
  expect(guest).toBeLessThanOrEqual(after + 1);
}

/** The parent stall of the last fork, from the driver's log line. */
function lastStallMs(): number {
  const line = [...driverLog].reverse().find((l) => l.includes("parent stalled"));
  return Number(/parent stalled ([\d.-]+) ms/.exec(line ?? "")?.[1] ?? Number.NaN);
}

describe("SandboxManager + SnapshotDriver with real VMs", () => {
  test(
    "spawn restores the template (its QEMU takes the template's state, no boot); siblings differ in entropy and hostname",
    async () => {
      const created: { id: string; createMs: number; firstExecMs: number }[] = [];
      for (let i = 0; i < 3; i++) {
        const c = await m.create(TEMPLATE, { kind: "sandbox" });
        const t0 = performance.now();
        expect(await sh(c.vmId, 'echo "$FIXTURE_GREETING"; pwd')).toBe("hello-from-image\n/app\n");
        created.push({ id: c.vmId, createMs: c.createTimeMs, firstExecMs: performance.now() - t0 });
      }
      const createMs = median(created.map((c) => c.createMs));
      const firstExecMs = median(created.map((c) => c.firstExecMs));
      figures.spawn_create_ms_p50 = round(createMs);
      figures.spawn_first_exec_ms_p50 = round(firstExecMs);
      // Restored, not booted: each QEMU was started to take the template's state (its speed is
      // in the figures, and in the benches).
      for (const c of created) expect(restoredQemu(m.info(c.id).qemuPid!)).toBe(true);

      const [a, b] = created.map((c) => c.id) as [string, string];
      const rnd = "head -c 16 /dev/urandom | od -An -tx1";
      const [ra, rb] = await Promise.all([sh(a, rnd), sh(b, rnd)]);
      expect(ra.trim().length).toBeGreaterThan(0);
      expect(ra).not.toBe(rb);
      expect((await sh(a, "hostname")).trim()).toBe(a);
      const bootIdOf = (id: string) => sh(id, "cat /proc/sys/kernel/random/boot_id");
      expect(await bootIdOf(a)).toMatch(/^[0-9a-f-]{36}\n$/);
      expect(await bootIdOf(a)).not.toBe(await bootIdOf(b));
      expect((await sh(b, "hostname")).trim()).toBe(b);
      await expectHostClock(a);
      expect(m.usage(a).resources.diskBytes).toBeGreaterThan(0);
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "fork: the child's counter goes on from the parent's, the parent runs on, both diverge; fork of a fork",
    async () => {
      const parent = (await m.create(TEMPLATE, { kind: "sandbox" })).vmId;
      await sh(parent, `echo before > /root/file; ${COUNTER}`);
      expect(await counterPasses(parent, 3)).toBe(true);
      const atFork = await counter(parent);

      const t0 = performance.now();
      const [child] = await m.fork(parent, 1);
      figures.fork1_manager_ms = round(performance.now() - t0);
      figures.fork1_parent_stall_ms = round(lastStallMs());
      const c = child!.vmId;
      expect(m.info(c).state).toBe("running");
      expect(m.info(parent).state).toBe("running");

      // The child's loop continues from where it was (in-memory `i`), not from 0.
      const c1 = await counter(c);
      expect(c1).toBeGreaterThanOrEqual(atFork);
      expect(await counterPasses(c, c1)).toBe(true);
      const c2 = await counter(c);
      expect(await sh(c, "cat /root/file")).toBe("before\n");
      expect((await sh(c, "hostname")).trim()).toBe(c);
      // The parent keeps running.
      expect(await counter(parent)).toBeGreaterThan(atFork);

      // Divergence after the fork.
      await sh(parent, "echo parent > /root/after-p");
      await sh(c, "echo child > /root/after-c");
      expect(await sh(c, "cat /root/after-p 2>/dev/null || echo none")).toBe("none\n");
      expect(await sh(parent, "cat /root/after-c 2>/dev/null || echo none")).toBe("none\n");
      const rnd = "head -c 16 /dev/urandom | od -An -tx1";
      expect(await sh(parent, rnd)).not.toBe(await sh(c, rnd));

      // A fork of the fork sees the child's state, and its counter runs on too.
      const [g] = await m.fork(c, 1);
      const gid = g!.vmId;
      expect(await sh(gid, "cat /root/after-c /root/file")).toBe("child\nbefore\n");
      const g1 = await counter(gid);
      expect(g1).toBeGreaterThanOrEqual(c2);
      expect(await counterPasses(gid, g1)).toBe(true);
      expect(await counterPasses(c, c2)).toBe(true);
      expect((await sh(gid, "hostname")).trim()).toBe(gid);
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "4 children at once, each with its own identity; a fork while an exec is in flight is busy",
    async () => {
      const parent = (await m.create(TEMPLATE, { kind: "sandbox" })).vmId;
      await sh(parent, `echo shared > /root/data; ${COUNTER}`);

      // busy: the fork is refused at once while an exec runs, never queued: the refusal comes
      // while the exec still runs
      let slowDone = false;
      const slow = m.exec(parent, { files: [], run: { kind: "shell", command: "sleep 3; echo done" } });
      const settled = () => {
        slowDone = true;
      };
      slow.then(settled, settled);
      expect(await waitFor(() => m.info(parent).state === "busy", HANG_MS)).toBe(true);
      expect(await codeOf(m.fork(parent, 1))).toBe("busy");
      expect(slowDone).toBe(false);
      expect((await slow).stdout).toBe("done\n");

      const t0 = performance.now();
      const kids = await m.fork(parent, 4);
      figures.fork4_manager_ms = round(performance.now() - t0);
      figures.fork4_parent_stall_ms = round(lastStallMs());
      expect(kids.length).toBe(4);
      const ids = kids.map((k) => k.vmId);
      expect(new Set(ids).size).toBe(4);
      const outs = await Promise.all(
        ids.map((id) =>
          sh(id, "cat /root/data; hostname; head -c 16 /dev/urandom | od -An -tx1; cat /tmp/c"),
        ),
      );
      for (const [i, id] of ids.entries()) expect(outs[i]).toStartWith(`shared\n${id}\n`);
      expect(new Set(outs.map((o) => o.split("\n")[2])).size).toBe(4);
      expect(await counter(parent)).toBeGreaterThan(0);
      for (const id of ids) expect(m.info(id).state).toBe("running");
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "suspend writes the memory to disk (mem_bytes > 0); resume keeps a file and a running process",
    async () => {
      const id = (await m.create(TEMPLATE, { kind: "sandbox" })).vmId;
      await sh(id, `echo kept > /root/s.txt; ${COUNTER}`);
      const bootId = await sh(id, "cat /proc/sys/kernel/random/boot_id");
      expect(await counterPasses(id, 0)).toBe(true);
      const before = await counter(id);
      const pidBefore = m.info(id).qemuPid;
      const t0 = performance.now();
      const s = await m.suspend(id);
      figures.suspend_ms = round(performance.now() - t0);
      figures.suspend_mem_bytes = s.memBytes;
      expect(s.memBytes).toBeGreaterThan(0);
      expect(s.snapshotBytes).toBeGreaterThanOrEqual(s.memBytes);
      expect(m.info(id).state).toBe("suspended");
      expect(m.info(id).qemuPid).toBeUndefined();
      expect(await qemuPidsUnder(join(stateDir, "vms", id))).toEqual([]);
      expect(await codeOf(m.exec(id, { files: [], run: { kind: "none" } }))).not.toBe("ok");

      const t1 = performance.now();
      await m.resume(id);
      figures.resume_ms = round(performance.now() - t1);
      expect(m.info(id).state).toBe("running");
      expect(m.info(id).qemuPid).not.toBe(pidBefore);
      expect(await sh(id, "cat /root/s.txt")).toBe("kept\n");
      // The same machine resumed: its boot id is kept (spawns and fork children get new ones).
      expect(await sh(id, "cat /proc/sys/kernel/random/boot_id")).toBe(bootId);
      const after = await counter(id);
      expect(after).toBeGreaterThanOrEqual(before);
      expect(await counterPasses(id, after)).toBe(true);
      // The suspend state file is freed once resumed.
      expect(filesUnder(join(stateDir, "storage", "suspended"))).toEqual([]);
      // A resumed VM forks like any other (its QEMU's disk node is the fixed one again).
      const [k] = await m.fork(id, 1);
      expect(await sh(k!.vmId, "cat /root/s.txt")).toBe("kept\n");
      expect(await sh(k!.vmId, "cat /proc/sys/kernel/random/boot_id")).not.toBe(bootId);
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "kill -9 of the QEMU mid-exec: a clear error at once, the sandbox is failed and frees its files",
    async () => {
      const id = (await m.create(TEMPLATE, { kind: "sandbox" })).vmId;
      const pid = m.info(id).qemuPid!;
      const pending = m.exec(id, { files: [], run: { kind: "shell", command: "sleep 60" } }).then(
        () => "resolved",
        (e: unknown) => e,
      );
      expect(await waitFor(() => m.info(id).state === "busy", HANG_MS)).toBe(true);
      const t0 = performance.now();
      process.kill(pid, "SIGKILL");
      const err = await pending;
      figures.kill9_error_ms = round(performance.now() - t0);
      expect(err).toBeInstanceOf(SandboxdError);
      expect((err as SandboxdError).code).toBe("gone");
      expect((err as SandboxdError).message).toContain("SIGKILL");
      // Only catches a hang: without the QEMU's death noticed, the exec would run its 60 s.
      expect(performance.now() - t0).toBeLessThan(HANG_MS);
      const info = m.info(id);
      expect(info.state).toBe("failed");
      expect(info.reason).toContain("QEMU exited");
      expect(await codeOf(m.exec(id, { files: [], run: { kind: "none" } }))).toBe("gone");
      expect(await codeOf(m.fork(id, 1))).not.toBe("ok");
    },
    VM_TEST_TIMEOUT_MS,
  );
});
