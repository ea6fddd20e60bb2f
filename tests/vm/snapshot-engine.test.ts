/**
 * The snapshot engine against real VMs under TCG: templates (ready command ok / failing), spawn,
 * identity of siblings, fork of a running VM (processes and memory carried over, divergence,
 * fork of a fork, 8 children), suspend/resume, a QEMU killed during an exec, and after every
 * test: no QEMU, socket, overlay, RAM file or temp dir left. Measured figures are printed as JSON.
 *
 * test-runner: exclusive (the memcheck test sets the host-wide sysctl vm.unprivileged_userfaultfd
 * to 0 for one fork: meanwhile every other file's snapshot forks would fall back to stop-copy)
 */
import { afterAll, afterEach, beforeAll, describe, expect, test } from "bun:test";
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { ensureGuestArtifacts, type GuestArtifacts } from "../../agent/guest/artifacts.ts";
import { type ImportedImage, importImage } from "../../agent/image/import.ts";
import type { QmpClient } from "../../agent/qemu/qmp/client.ts";
import { type SnapshotError, unwrap } from "../../agent/snapshot/errors.ts";
import { forkVm } from "../../agent/snapshot/fork.ts";
import { type ForkMethod, readyForkMethod } from "../../agent/snapshot/fork-method.ts";
import { floorRestoreMs, spawnFromTemplate } from "../../agent/snapshot/spawn.ts";
import {
  pauseVm,
  resumeVm,
  SUSPEND_MAX_BANDWIDTH,
  suspendVm,
  unpauseVm,
} from "../../agent/snapshot/suspend.ts";
import {
  buildTemplate,
  deleteTemplate,
  loadTemplate,
  type TemplateMeta,
} from "../../agent/snapshot/template.ts";
import type { SandboxVm } from "../../agent/snapshot/vm.ts";
import { openChainStore } from "../../agent/storage/chain.ts";
import { blankOverlayPath } from "../../agent/storage/qcow2.ts";
import { qemuPidsNaming } from "../../agent/vm/process.ts";
import { busyboxImageSpec, makeDockerArchive } from "../fixtures/images.ts";
import { COUNTER, waitFor } from "../support/real-vm.ts";

const REPO = resolve(import.meta.dir, "../..");
/** Guest artifacts and imported images are cached here (shared with the other suites). */
const CACHE_DIR = process.env.SANDBOXD_TEST_DATA ?? join(REPO, ".data", "test");
/** Every VM, template and chain file of this suite lives under these two, removed at the end. */
const scratch = mkdtempSync(join(tmpdir(), "snapshot-test-"));
const DATA_DIR = join(scratch, "data");
const SHM_ROOT = mkdtempSync("/dev/shm/sandboxd-snapshot-test-");
/** Each test boots or restores several VMs under TCG on a 2-core host; 180 s covers a loaded CI machine. */
const VM_TEST_TIMEOUT_MS = 180_000;
/**
 * A bound for what takes a second or less (a counter's next tick, a VM's death after a kill): it
 * only catches a hang, on a 2-core TCG host shared with other test files.
 */
const HANG_MS = 30_000;

let artifacts: GuestArtifacts;
let image: ImportedImage;
let template: TemplateMeta;
const live: SandboxVm[] = [];
const figures: Record<string, unknown> = {};

const log = (m: string) => {
  if (process.env.SNAPSHOT_TEST_VERBOSE) console.log(`[snapshot] ${m}`);
};

function listFiles(dir: string): string[] {
  if (!existsSync(dir)) return [];
  const out: string[] = [];
  for (const e of readdirSync(dir, { withFileTypes: true })) {
    const p = join(dir, e.name);
    if (e.isDirectory()) out.push(...listFiles(p));
    else out.push(p);
  }
  return out;
}

/** Files that may stay between tests: the template's own, and the chain table. */
function leftovers(): string[] {
  const keep = new Set([
    template?.disk,
    template?.statePath,
    template?.memPath,
    join(template?.disk ?? "", "../meta.json"),
    // the pristine overlay spawns copy: the template's own, removed with it
    template ? blankOverlayPath(template.disk, template.diskBytes) : undefined,
  ]);
  return [...listFiles(DATA_DIR), ...listFiles(SHM_ROOT)].filter(
    (f) => !keep.has(f) && !f.endsWith("storage/chain.json"),
  );
}

async function sh(vm: SandboxVm, script: string): Promise<string> {
  const r = await vm.exec({
    argv: ["sh", "-c", script],
    env: ["PATH=/bin:/usr/bin"],
    cwd: "/",
    timeoutMs: 20_000,
  });
  if (r.exitCode !== 0) throw new Error(`${script}: exit ${r.exitCode} ${r.stderr.toString()}`);
  return r.stdout.toString();
}

const median = (xs: number[]) => {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.floor(s.length / 2)] ?? 0;
};
const round = (x: number) => Math.round(x * 10) / 10;

/** The guest's clock is the host's, to the second (one second each way for the exec). */
async function expectHostClock(vm: SandboxVm): Promise<void> {
  const before = Math.floor(Date.now() / 1000);
  const guest = Number(await sh(vm, "date +%s"));
  const after = Math.ceil(Date.now() / 1000);
  expect(guest).toBeGreaterThanOrEqual(before - 1);
  expect(guest).toBeLessThanOrEqual(after + 1);
}

beforeAll(async () => {
  // Forks here use the default method, a background snapshot: what the agent sets up at start.
  expect(await readyForkMethod("snapshot", log)).toBe("snapshot");
  artifacts = await ensureGuestArtifacts({ dataDir: CACHE_DIR, log });
  const archive = join(scratch, "busybox.tar");
  await makeDockerArchive(archive, await busyboxImageSpec(join(scratch, "img")));
  image = await importImage({ source: archive, dataDir: CACHE_DIR, log });
  const r = await buildTemplate({
    dataDir: DATA_DIR,
    image,
    artifacts,
    accel: "tcg",
    id: "base",
    memMib: 256,
    shmRoot: SHM_ROOT,
    log,
  });
  template = unwrap(r);
  figures.template_snapshot_ms = round(template.timings?.snapshotMs ?? -1);
  figures.template_state_bytes = template.stateBytes;
}, VM_TEST_TIMEOUT_MS);

afterEach(async () => {
  for (const vm of live.splice(0)) await vm.destroy();
  expect(await qemuPidsNaming([scratch, SHM_ROOT])).toEqual([]);
  expect(leftovers()).toEqual([]);
  expect(listFiles(join(DATA_DIR, "vms"))).toEqual([]);
});

afterAll(async () => {
  console.log(`SNAPSHOT_FIGURES ${JSON.stringify(figures)}`);
  for (const vm of live.splice(0)) await vm.destroy();
  if (template) unwrap(await deleteTemplate(DATA_DIR, template.id));
  const chain = await openChainStore(DATA_DIR);
  const remaining = chain.list();
  rmSync(scratch, { recursive: true, force: true });
  rmSync(SHM_ROOT, { recursive: true, force: true });
  expect(remaining).toEqual([]);
});

describe("templates", () => {
  test(
    "a built template is ready on disk and loads after a restart",
    async () => {
      expect(template.state).toBe("ready");
      for (const f of [template.disk, template.statePath, template.memPath]) expect(existsSync(f)).toBe(true);
      const again = unwrap(await loadTemplate(DATA_DIR, "base"));
      expect(again.statePath).toBe(template.statePath);
      const missing = await loadTemplate(DATA_DIR, "nope");
      expect(missing.ok ? "" : missing.error.code).toBe("template_not_found");
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "a failing ready command fails the build with a readable error and leaves no files",
    async () => {
      const r = await buildTemplate({
        dataDir: DATA_DIR,
        image,
        artifacts,
        accel: "tcg",
        id: "bad",
        memMib: 256,
        shmRoot: SHM_ROOT,
        readyCmd: ["sh", "-c", "echo not healthy >&2; exit 3"],
        log,
      });
      expect(r.ok).toBe(false);
      if (r.ok) return;
      expect(r.error.code).toBe("template_ready_failed");
      expect(r.error.message).toContain("exited with code 3");
      expect(String(r.error.details?.stderr)).toContain("not healthy");
      const loaded = await loadTemplate(DATA_DIR, "bad");
      expect(loaded.ok ? "" : loaded.error.code).toBe("template_not_ready");
      expect(existsSync(join(SHM_ROOT, "tpl-bad.mem"))).toBe(false);
      unwrap(await deleteTemplate(DATA_DIR, "bad"));
      expect(existsSync(join(DATA_DIR, "templates", "bad"))).toBe(false);
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "a ready command that does not finish in time fails the build",
    async () => {
      const r = await buildTemplate({
        dataDir: DATA_DIR,
        image,
        artifacts,
        accel: "tcg",
        id: "slow",
        memMib: 256,
        shmRoot: SHM_ROOT,
        readyCmd: ["sleep", "30"],
        readyTimeoutMs: 1000,
        log,
      });
      expect(r.ok ? "" : r.error.code).toBe("template_ready_failed");
      expect(r.ok ? "" : r.error.message).toContain("timed out after 1000 ms");
      unwrap(await deleteTemplate(DATA_DIR, "slow"));
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "a ready command that starts a service detached and exits 0 is kept running in spawns",
    async () => {
      // A failed build leaves its record (state failed): the finally removes it too, so a failure
      // here is this test's alone and not every later test's leftovers check.
      const built = await buildTemplate({
        dataDir: DATA_DIR,
        image,
        artifacts,
        accel: "tcg",
        id: "svc",
        memMib: 256,
        shmRoot: SHM_ROOT,
        readyCmd: [
          "sh",
          "-c",
          // Written whole (mv): a `cat` between a truncate and its write read "" (0), once.
          "(while true; do date +%s > /tmp/svc.new && mv /tmp/svc.new /tmp/svc; sleep 0.2; done) >/dev/null 2>&1 & sleep 0.5; test -s /tmp/svc",
        ],
        log,
      });
      try {
        const r = unwrap(built);
        const s = unwrap(await spawnFromTemplate({ dataDir: DATA_DIR, template: r, log }));
        live.push(s.vm);
        // The service runs on in the spawn: its clock file moves past what it said first.
        const a = Number(await sh(s.vm, "cat /tmp/svc"));
        expect(a).toBeGreaterThan(0);
        expect(await waitFor(async () => Number(await sh(s.vm, "cat /tmp/svc")) > a, HANG_MS)).toBe(true);
        await s.vm.destroy();
      } finally {
        // Also when the check fails: the template's files would fail every later test's leftovers check.
        for (const vm of live.splice(0)) await vm.destroy();
        const deleted = await deleteTemplate(DATA_DIR, "svc");
        if (built.ok) unwrap(deleted);
      }
      if (built.ok) expect(existsSync(built.value.memPath)).toBe(false);
    },
    VM_TEST_TIMEOUT_MS,
  );
});

describe("spawn", () => {
  test(
    "spawned VMs answer exec, get their own random bytes and hostnames",
    async () => {
      const times: number[] = [];
      const forks: number[] = [];
      const vms: SandboxVm[] = [];
      for (let i = 0; i < 3; i++) {
        const s = unwrap(await spawnFromTemplate({ dataDir: DATA_DIR, template, log }));
        live.push(s.vm);
        vms.push(s.vm);
        times.push(s.timings.readyMs);
        forks.push(s.timings.forkMs);
        log(JSON.stringify(s.timings));
      }
      const [a, b] = vms as [SandboxVm, SandboxVm];
      expect(await sh(a, "echo hi")).toBe("hi\n");
      const ra = await sh(a, "head -c 16 /dev/urandom | od -x");
      const rb = await sh(b, "head -c 16 /dev/urandom | od -x");
      expect(ra).not.toBe(rb);
      expect((await sh(a, "hostname")).trim()).toBe(a.id);
      expect((await sh(b, "hostname")).trim()).toBe(b.id);
      await expectHostClock(a);
      figures.spawn_ready_ms_p50 = round(median(times));
      figures.spawn_fork_ms_p50 = round(median(forks));
      const floor: number[] = [];
      for (let i = 0; i < 3; i++) floor.push((await floorRestoreMs({ dataDir: DATA_DIR, template })).totalMs);
      figures.floor_restore_ms = round(median(floor));
    },
    VM_TEST_TIMEOUT_MS,
  );
});

/**
 * Cancels the next background snapshot on `proc` once QEMU resumes its guest (QEMU's side fails
 * midway). The rest of the stream is throttled first (the RAM left after the resume can be copied
 * before a bare cancel lands), then cancelled. Returns the listener's off switch.
 */
function cancelSnapshotAtResume(proc: NonNullable<SandboxVm["process"]>): () => void {
  const offResume = proc.qmp.on("RESUME", () => {
    offResume();
    void proc.qmp
      .execute("migrate-set-parameters", { "max-bandwidth": 1024 * 1024 })
      .then(() => proc.qmp.execute("migrate_cancel"))
      .catch((e) => log(`cancelling the snapshot: ${(e as Error).message}`));
  });
  return offResume;
}

async function counter(vm: SandboxVm): Promise<number> {
  return Number((await sh(vm, "cat /tmp/c")).trim());
}

/**
 * Whether the counter of `vm` passes `n` within HANG_MS (it ticks ten times a second); before its
 * first tick there is no file, read as 0.
 */
const counterPasses = (vm: SandboxVm, n: number) =>
  waitFor(async () => Number((await sh(vm, "cat /tmp/c 2>/dev/null || echo 0")).trim()) > n, HANG_MS);

describe("fork", () => {
  test(
    "a child keeps the parent's files and running counter; both diverge; the parent runs on",
    async () => {
      const parent = unwrap(await spawnFromTemplate({ dataDir: DATA_DIR, template, log })).vm;
      live.push(parent);
      await sh(parent, `echo before > /root-file; ${COUNTER}`);
      expect(await counterPasses(parent, 3)).toBe(true);
      const atFork = await counter(parent);
      const f = unwrap(await forkVm(parent, { count: 1, log }));
      const child = f.children[0] as SandboxVm;
      live.push(child);
      log(JSON.stringify(f.timings));
      figures.fork1_parent_stall_ms = round(f.timings.parentStallMs);
      figures.fork1_precopy_ms = round(f.timings.precopyMs);
      figures.fork1_child_ready_ms = round(f.timings.childrenAfterResumeMs);
      figures.fork_state_bytes = f.timings.stateBytes;
      expect(f.timings.parentStallMs).toBeGreaterThan(0);

      // The child's counter goes on from where the parent was (not restarted from 0).
      const c1 = await counter(child);
      expect(c1).toBeGreaterThanOrEqual(atFork);
      expect(await counterPasses(child, c1)).toBe(true);
      const c2 = await counter(child);
      expect(await sh(child, "cat /root-file")).toBe("before\n");
      expect((await sh(child, "hostname")).trim()).toBe(child.id);
      // The parent runs on.
      const p1 = await counter(parent);
      expect(p1).toBeGreaterThan(atFork);
      // Divergence: files written after the fork are not seen by the other.
      await sh(parent, "echo parent > /after-p");
      await sh(child, "echo child > /after-c");
      expect(await sh(child, "cat /after-p 2>/dev/null || echo none")).toBe("none\n");
      expect(await sh(parent, "cat /after-c 2>/dev/null || echo none")).toBe("none\n");
      expect(await sh(parent, "cat /after-p")).toBe("parent\n");
      expect(await sh(parent, "head -c 16 /dev/urandom | od -x")).not.toBe(
        await sh(child, "head -c 16 /dev/urandom | od -x"),
      );

      // A fork of the fork.
      const g = unwrap(await forkVm(child, { count: 1, log }));
      const grandchild = g.children[0] as SandboxVm;
      live.push(grandchild);
      expect(await sh(grandchild, "cat /after-c /root-file")).toBe("child\nbefore\n");
      expect(await counter(grandchild)).toBeGreaterThanOrEqual(c2);
      expect(await counter(child)).toBeGreaterThan(c2);
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "8 children of a running VM all answer, each with its own identity",
    async () => {
      const parent = unwrap(await spawnFromTemplate({ dataDir: DATA_DIR, template, log })).vm;
      live.push(parent);
      await sh(parent, `echo shared > /data; ${COUNTER}`);
      expect(await counterPasses(parent, 0)).toBe(true);
      const f = unwrap(await forkVm(parent, { count: 8, log }));
      live.push(...f.children);
      log(JSON.stringify(f.timings));
      figures.fork8_parent_stall_ms = round(f.timings.parentStallMs);
      figures.fork8_children_ready_ms = round(f.timings.childrenAfterResumeMs);
      figures.fork8_total_ms = round(f.timings.totalMs);
      figures.fork8_stream_ms = round(f.timings.precopyMs);
      expect(f.children.length).toBe(8);
      const outs = await Promise.all(
        f.children.map((c) => sh(c, "cat /data; hostname; head -c 16 /dev/urandom | od -x")),
      );
      expect(new Set(outs).size).toBe(8);
      for (const [i, c] of f.children.entries()) expect(outs[i]).toStartWith(`shared\n${c.id}\n`);
      expect(await counter(parent)).toBeGreaterThan(0);
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "repeated forks keep chains within the bound",
    async () => {
      const { MAX_CHAIN_DEPTH } = await import("../../agent/storage/qcow2.ts");
      const parent = unwrap(await spawnFromTemplate({ dataDir: DATA_DIR, template, log })).vm;
      live.push(parent);
      await sh(parent, "echo 0 > /gen");
      for (let i = 1; i <= MAX_CHAIN_DEPTH + 1; i++) {
        // One file per fork: each lives in its own layer of the chain.
        await sh(parent, `echo ${i} > /gen; echo ${i} > /gen-${i}; sync`);
        const f = unwrap(await forkVm(parent, { count: 1, log }));
        const child = f.children[0] as SandboxVm;
        expect((await sh(child, "cat /gen")).trim()).toBe(String(i));
        // From the disk, not the page cache the child inherited: past the bound the child's
        // base is a flattened copy, which must hold every layer's writes.
        const all = Array.from({ length: i }, (_, k) => `/gen-${k + 1}`).join(" ");
        expect((await sh(child, `echo 3 > /proc/sys/vm/drop_caches; cat ${all} | tr '\\n' ' '`)).trim()).toBe(
          Array.from({ length: i }, (_, k) => k + 1).join(" "),
        );
        const chain = await openChainStore(DATA_DIR);
        expect(chain.depth(child.disk)).toBeLessThanOrEqual(MAX_CHAIN_DEPTH);
        expect(chain.depth(parent.disk)).toBeLessThanOrEqual(MAX_CHAIN_DEPTH + 1);
        await child.destroy();
      }
      expect((await sh(parent, "cat /gen")).trim()).toBe(String(MAX_CHAIN_DEPTH + 1));
    },
    VM_TEST_TIMEOUT_MS,
  );
  test(
    "a child's memory is the parent's at the fork: a writer checking every page finds none stale, by each method; the check sees one flipped bit",
    async () => {
      // memstress rewrites 48 MiB page by page and checks each page before rewriting it, so a
      // page the fork's copy took from another instant is found within one pass (~0.5 s).
      const bin = join(scratch, "memstress");
      const cc = Bun.spawnSync([
        "gcc",
        "-O2",
        "-static",
        "-o",
        bin,
        join(REPO, "tests/fixtures/memstress.c"),
      ]);
      expect(cc.stderr.toString()).toBe("");
      const parent = unwrap(await spawnFromTemplate({ dataDir: DATA_DIR, template, log })).vm;
      live.push(parent);
      await parent.guest?.writeFile("/memstress", readFileSync(bin), { mode: 0o755 });
      await sh(parent, "/memstress 48 >/dev/null 2>&1 & echo $! > /tmp/memstress.pid");
      const check = async (vm: SandboxVm): Promise<string> => {
        // A full pass of the writer first: every page is checked before it is rewritten.
        await Bun.sleep(2000);
        await sh(vm, "rm -f /tmp/memcheck; kill -USR1 $(cat /tmp/memstress.pid)");
        for (let i = 0; i < 200; i++) {
          const out = (await sh(vm, "cat /tmp/memcheck 2>/dev/null || true")).trim();
          if (out) return out;
          await Bun.sleep(100);
        }
        throw new Error(`no memcheck from ${vm.id}`);
      };
      await Bun.sleep(1000);
      const stalls: Record<string, number[]> = {};
      const fork = async (method: ForkMethod, count = 1): Promise<void> => {
        const f = unwrap(await forkVm(parent, { count, method, log }));
        live.push(...f.children);
        expect(f.timings.method).toBe(method);
        stalls[method] = [...(stalls[method] ?? []), round(f.timings.parentStallMs)];
        for (const child of f.children) {
          expect(await check(child)).toMatch(/^ok pages=12288 .* bad=0 /);
          await child.destroy();
        }
      };
      for (const method of ["snapshot", "stop-copy", "snapshot", "snapshot"] as const) await fork(method);
      await fork("snapshot", 2); // shared: the fork point's RAM file, mapped by both children
      figures.memcheck_fork_stall_ms = stalls;

      // Where QEMU may not use userfaultfd, a snapshot fork falls back to stop-and-copy.
      // Host-wide: the file is marked exclusive for it (at the top), and the agent's value (1,
      // readyForkMethod) is put back.
      const sysctl = "/proc/sys/vm/unprivileged_userfaultfd";
      writeFileSync(sysctl, "0\n");
      try {
        const f = unwrap(await forkVm(parent, { count: 1, method: "snapshot", log }));
        live.push(...f.children);
        expect(f.timings.method).toBe("stop-copy");
        expect(await check(f.children[0] as SandboxVm)).toMatch(/^ok /);
        await (f.children[0] as SandboxVm).destroy();
      } finally {
        writeFileSync(sysctl, "1\n");
      }

      // Suspended and resumed under the same load, twice (the second suspend saves the pages the
      // first resume wrote), the parent's memory is whole: its state holds only its own pages
      // (suspend.ts), every other page comes from its RAM file.
      for (let i = 0; i < 2; i++) {
        const s = unwrap(await suspendVm(parent));
        figures[`memcheck_suspend${i}_state_bytes`] = s.memBytes;
        // Its own pages: the writer's 48 MiB and what the guest wrote besides, not the whole RAM.
        expect(s.memBytes).toBeLessThan(parent.shape.memMib * 1024 * 1024);
        unwrap(await resumeVm(parent));
        expect(await check(parent)).toMatch(/^ok pages=12288 .* bad=0 /);
      }

      // The parent is whole too, and the check can fail: one flipped bit is found.
      expect(await check(parent)).toMatch(/^ok /);
      await sh(parent, "kill -USR2 $(cat /tmp/memstress.pid)");
      expect(await check(parent)).toMatch(/^bad .* bad=1 /);

      // A snapshot that fails on QEMU's side midway (cancelled once QEMU has resumed the guest):
      // the fork fails, and the parent is not left looking alive while its guest can never run
      // (QEMU 7.2 leaves a vCPU blocked in a write fault): it answers, or it is ended.
      const proc = parent.process;
      if (!proc) throw new Error("the parent has no QEMU");
      const offResume = cancelSnapshotAtResume(proc);
      const cancelled = await forkVm(parent, { count: 1, method: "snapshot", log });
      offResume();
      if (cancelled.ok) live.push(...cancelled.value.children); // freed by afterEach
      expect(cancelled.ok).toBe(false);
      const err = (cancelled as { error: SnapshotError }).error;
      log(`cancelled snapshot: ${err.code}: ${err.message}`);
      if (parent.state === "dead") {
        // Ended, and the error says so: the blocked vCPU found (vm_died), or, on a loaded host,
        // QEMU wedged behind it first and killed at its QMP deadline (vm_unresponsive), or QEMU
        // exited while the cancel unwound (vm_died, never the bare migration_failed).
        expect(["vm_died", "vm_unresponsive"]).toContain(err.code);
        expect(err.message).toMatch(/blocked in a memory write fault|the VM was killed|the VM was ended/);
        expect(proc.isAlive()).toBe(false);
      } else {
        expect(parent.state).toBe("running");
        expect((await sh(parent, "echo alive")).trim()).toBe("alive");
      }
    },
    VM_TEST_TIMEOUT_MS * 2,
  );
});

describe("suspend and failures", () => {
  test(
    "suspend/resume keeps a file and a running process; the clock is fresh",
    async () => {
      const vm = unwrap(await spawnFromTemplate({ dataDir: DATA_DIR, template, log })).vm;
      live.push(vm);
      await sh(vm, `echo kept > /kept; ${COUNTER}`);
      expect(await counterPasses(vm, 0)).toBe(true);
      // Idle pause: the counter stands still while paused, runs on after unpause.
      unwrap(await pauseVm(vm));
      expect(vm.state).toBe("paused");
      const forkPaused = await forkVm(vm, { count: 1 });
      expect(forkPaused.ok ? "" : forkPaused.error.code).toBe("invalid_state");
      await Bun.sleep(300);
      unwrap(await unpauseVm(vm));
      // The VM runs from the read of `before` until the suspend has returned, and again from the
      // resume until the read of `after`: the counter may tick only in those spans.
      const tBefore = performance.now();
      const before = await counter(vm);
      const s = unwrap(await suspendVm(vm));
      const tSuspended = performance.now();
      expect(vm.state).toBe("suspended");
      expect(vm.process).toBeUndefined();
      expect(s.memBytes).toBeGreaterThan(1_000_000);
      figures.suspend_ms = round(s.suspendMs);
      figures.suspend_mem_bytes = s.memBytes;
      const forkSuspended = await forkVm(vm, { count: 1 });
      expect(forkSuspended.ok ? "" : forkSuspended.error.code).toBe("invalid_state");
      // Suspended for 2 s: 20 ticks a counter that did not sleep with the VM would gain.
      await Bun.sleep(2000);
      const tResume = performance.now();
      const r = unwrap(await resumeVm(vm));
      figures.resume_ms = round(r.readyMs);
      const after = await counter(vm);
      const ranMs = tSuspended - tBefore + (performance.now() - tResume);
      expect(await sh(vm, "cat /kept")).toBe("kept\n");
      // It slept with the VM (no more ticks than the time it ran allows, two of slack), and did
      // not restart from 0.
      expect(after).toBeGreaterThanOrEqual(before);
      expect(after - before).toBeLessThanOrEqual(Math.ceil(ranMs / 100) + 2);
      expect(await counterPasses(vm, after)).toBe(true);
      await expectHostClock(vm);
      // Not allowed twice.
      const again = await resumeVm(vm);
      expect(again.ok ? "" : again.error.code).toBe("invalid_state");
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "suspend lifts QEMU's migration bandwidth cap: at `migrate` QEMU reports SUSPEND_MAX_BANDWIDTH",
    async () => {
      const vm = unwrap(await spawnFromTemplate({ dataDir: DATA_DIR, template, log })).vm;
      live.push(vm);
      const q = vm.process?.qmp as QmpClient;
      type Params = { "max-bandwidth"?: number };
      const execute = q.execute.bind(q);
      // A fresh QEMU has its own default cap (128 MiB/s in 7.2), which throttled the state file.
      const fresh = await execute<Params>("query-migrate-parameters");
      expect(fresh["max-bandwidth"]).toBeLessThan(SUSPEND_MAX_BANDWIDTH);
      // What QEMU itself reports the moment the suspend starts its migration: asked on the same
      // QMP connection just before `migrate` goes out (the QEMU is gone once the suspend returns).
      let atMigrate: Params | undefined;
      q.execute = (async (command: string, args?: Record<string, unknown>, o?: { timeoutMs?: number }) => {
        if (command === "migrate") atMigrate = await execute<Params>("query-migrate-parameters");
        return execute(command, args, o);
      }) as QmpClient["execute"];
      unwrap(await suspendVm(vm));
      expect(atMigrate?.["max-bandwidth"]).toBe(SUSPEND_MAX_BANDWIDTH);
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "kill -9 of QEMU during an exec gives vm_died promptly and frees the VM",
    async () => {
      const vm = unwrap(await spawnFromTemplate({ dataDir: DATA_DIR, template, log })).vm;
      live.push(vm);
      const pid = vm.process?.pid as number;
      const pending = vm.exec({ argv: ["sleep", "30"], env: ["PATH=/bin"], cwd: "/" });
      pending.catch(() => {});
      // In flight: its request is on the guest channel, unanswered.
      expect(await waitFor(() => (vm.guest?.load.inFlight ?? 0) > 0, HANG_MS)).toBe(true);
      const t0 = performance.now();
      process.kill(pid, "SIGKILL");
      let code = "";
      try {
        await pending;
      } catch (err) {
        code = (err as { code?: string }).code ?? String(err);
      }
      const ms = performance.now() - t0;
      expect(code).toBe("vm_died");
      // Only catches a hang: without the death noticed, the exec would run its 30 s.
      expect(ms).toBeLessThan(20_000);
      expect(await waitFor(() => vm.state === "dead", HANG_MS)).toBe(true);
      const r = await suspendVm(vm);
      expect(r.ok ? "" : r.error.code).toBe("invalid_state");
    },
    VM_TEST_TIMEOUT_MS,
  );

  // stop-copy: at the fork's stop, before its disk switch and its copy. snapshot: at the resume,
  // with the background copy in flight (its stream fails first, as a migration error).
  test.each([
    ["stop-copy", "STOP"],
    ["snapshot", "RESUME"],
  ] as const)(
    "kill -9 of the parent's QEMU in the middle of a %s fork (at %s): the fork fails with vm_died, the parent is dead, no overlay or file is left",
    async (method, event) => {
      const vm = unwrap(await spawnFromTemplate({ dataDir: DATA_DIR, template, log })).vm;
      live.push(vm);
      const proc = vm.process;
      if (!proc) throw new Error("the VM has no QEMU");
      const off = proc.qmp.on(event, () => {
        off();
        process.kill(proc.pid, "SIGKILL");
      });
      const forked = await forkVm(vm, { count: 1, method, log });
      off();
      if (forked.ok) live.push(...forked.value.children);
      expect(forked.ok).toBe(false);
      // The code says the VM is gone (a caller would otherwise retry the fork on a dead VM).
      const err = (forked as { error: SnapshotError }).error;
      log(`fork with its QEMU killed at ${event}: ${err.code}: ${err.message}`);
      expect(err.code).toBe("vm_died");
      expect(await waitFor(() => vm.state === "dead", HANG_MS)).toBe(true);
      expect(proc.isAlive()).toBe(false);
      // afterEach checks that no QEMU, disk, state or RAM file of it is left.
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "a snapshot fork cancelled on QEMU's side, its QEMU killed as the cancel lands: vm_died, not a bare migration error",
    async () => {
      const vm = unwrap(await spawnFromTemplate({ dataDir: DATA_DIR, template, log })).vm;
      live.push(vm);
      const proc = vm.process;
      if (!proc) throw new Error("the VM has no QEMU");
      // QEMU is killed as it reports the cancel: the fork's own error is the migration's, and
      // the rollback finds QEMU gone.
      const offResume = cancelSnapshotAtResume(proc);
      const offCancel = proc.qmp.on("MIGRATION", (ev) => {
        const status = (ev.data as { status?: string } | undefined)?.status;
        if (status !== "cancelling" && status !== "cancelled") return;
        offCancel();
        process.kill(proc.pid, "SIGKILL");
      });
      const forked = await forkVm(vm, { count: 1, method: "snapshot", log });
      offResume();
      offCancel();
      if (forked.ok) live.push(...forked.value.children);
      expect(forked.ok).toBe(false);
      const err = (forked as { error: SnapshotError }).error;
      log(`fork cancelled, QEMU killed: ${err.code}: ${err.message}`);
      expect(err.code).toBe("vm_died");
      expect(err.message).toContain("the VM was ended");
      expect(await waitFor(() => vm.state === "dead", HANG_MS)).toBe(true);
      expect(proc.isAlive()).toBe(false);
    },
    VM_TEST_TIMEOUT_MS,
  );
});

describe("restart", () => {
  test(
    "files of VMs that vanished with a crashed agent are freed by reclaimSnapshotStorage",
    async () => {
      const { reclaimSnapshotStorage } = await import("../../agent/snapshot/recover.ts");
      const vm = unwrap(await spawnFromTemplate({ dataDir: DATA_DIR, template, log })).vm;
      live.push(vm);
      const disk = vm.disk;
      // A crash: QEMU gone, VM dir reaped, but the chain table still says the VM holds its disk.
      await vm.process?.kill();
      rmSync(vm.dir, { recursive: true, force: true });
      expect(existsSync(disk)).toBe(true);
      const freed = await reclaimSnapshotStorage(DATA_DIR);
      expect(freed).toEqual([disk]);
      expect(existsSync(disk)).toBe(false);
      expect(existsSync(template.memPath)).toBe(true);
      unwrap(await loadTemplate(DATA_DIR, template.id));
    },
    VM_TEST_TIMEOUT_MS,
  );
});
