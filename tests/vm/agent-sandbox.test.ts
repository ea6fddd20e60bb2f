import { afterAll, afterEach, describe, expect, test } from "bun:test";
import { mkdir, rm, writeFile } from "node:fs/promises";
import { join } from "node:path";
import type { UsageInterval } from "../../agent/sandbox/accounting.ts";
import { SandboxManager } from "../../agent/sandbox/manager.ts";
import type { ManagerOptions } from "../../agent/sandbox/manager-types.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { BootDriver } from "../support/boot-driver.ts";
import {
  busyboxArchive,
  codeOf,
  leftovers,
  removeBusyboxArchive,
  TEST_CACHE_DIR,
  tempStateDir,
  waitFor,
} from "../support/real-vm.ts";

/**
 * The sandbox manager over the cold-boot driver with REAL VMs under TCG: exec rules, idle pause,
 * destroy (normal / force), QEMU death, accounting, and re-adoption after an agent restart.
 * Every test ends with the leak check: no QEMU, socket or VM directory left in its state dir.
 */

/** Each cold boot is ~2-3 s under TCG; a test boots at most three VMs; 180 s covers a slow CI host. */
const VM_TEST_TIMEOUT_MS = 180_000;
/**
 * A bound for what happens in well under a second (a state change, an error after a kill): it
 * only catches a hang, on a 2-core TCG host shared with other test files.
 */
const HANG_MS = 30_000;
const TEMPLATE = "busybox";

const cleanups: Array<() => Promise<void>> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});
afterAll(removeBusyboxArchive);

async function openManager(stateDir: string, extra: Partial<ManagerOptions> = {}): Promise<SandboxManager> {
  const driver = await BootDriver.create({ cacheDir: TEST_CACHE_DIR, stateDir });
  return SandboxManager.open({ driver, stateDir, ...extra });
}

/** A manager with the busybox template ready, and the cleanup + leak check registered. */
async function setup(extra: Partial<ManagerOptions> = {}) {
  const stateDir = await tempStateDir();
  const m = await openManager(stateDir, extra);
  const managers = [m];
  cleanups.push(async () => {
    for (const mm of managers) for (const s of mm.list()) await mm.destroy(s.id, { force: true });
    const left = await leftovers(stateDir);
    await rm(stateDir, { recursive: true, force: true });
    expect(left).toEqual({ qemus: [], vmDirs: [] });
  });
  m.buildTemplate(TEMPLATE, { kind: "archive", path: await busyboxArchive() });
  await m.templates.settled(TEMPLATE);
  expect(m.templates.status(TEMPLATE)).toMatchObject({ status: "ready", phase: "Live" });
  return { m, stateDir, managers };
}

describe("SandboxManager with real VMs", () => {
  test(
    "create, exec forms, busy on concurrent exec/fork, idle pause and transparent wake, destroy",
    async () => {
      const usage: UsageInterval[] = [];
      // A short idle grace so the test sees the pause; production uses DEFAULT_IDLE_PAUSE_MS.
      const { m } = await setup({ idlePauseMs: 300, onUsage: (iv) => usage.push(iv) });
      const created = await m.create(TEMPLATE, { kind: "sandbox" });
      expect(created.vmId).toMatch(/^vm-[0-9a-f]{16}$/);
      expect(created.resources).toMatchObject({ vcpus: 1, memMib: 256 });
      expect(m.info(created.vmId).state).toBe("running");
      const id = created.vmId;

      // shell command with the image's Env + extra env, in the image's WorkingDir
      const r1 = await m.exec(id, {
        files: [],
        run: { kind: "shell", command: 'echo "$FIXTURE_GREETING $EXTRA" && pwd' },
        env: { EXTRA: "x1" },
      });
      expect(r1).toMatchObject({ stdout: "hello-from-image x1\n/app\n", stderr: "", exitCode: 0 });

      // files written first (relative to WorkingDir), then argv commands in order; last one wins
      const r2 = await m.exec(id, {
        files: [{ path: "sub/a.txt", content: "alpha\n" }],
        run: {
          kind: "argv",
          commands: [
            ["sh", "-c", "cp sub/a.txt b.txt"],
            ["cat", "/app/b.txt"],
          ],
        },
        seed: "00112233445566778899aabbccddeeff",
      });
      expect(r2).toMatchObject({ stdout: "alpha\n", exitCode: 0, seedAck: "verified" });

      // code on stdin to the image's Entrypoint+Cmd (["sh"])
      const r3 = await m.exec(id, { files: [], run: { kind: "code", code: "echo from-code; exit 3\n" } });
      expect(r3).toMatchObject({ stdout: "from-code\n", exitCode: 3 });

      // timeout: the guest kills the group; exit code 124
      const r4 = await m.exec(id, { files: [], run: { kind: "shell", command: "sleep 5" }, timeoutMs: 500 });
      expect(r4.exitCode).toBe(124);

      // busy: a second exec and a fork while one is in flight fail at once, never queued: both
      // refusals come while the first exec still runs
      let slowDone = false;
      const slow = m.exec(id, { files: [], run: { kind: "shell", command: "sleep 3; echo done" } });
      const settled = () => {
        slowDone = true;
      };
      slow.then(settled, settled);
      expect(await waitFor(() => m.info(id).state === "busy", HANG_MS)).toBe(true);
      expect(await codeOf(m.exec(id, { files: [], run: { kind: "shell", command: "true" } }))).toBe("busy");
      expect(await codeOf(m.fork(id, 1))).toBe("busy");
      expect(slowDone).toBe(false);
      expect((await slow).stdout).toBe("done\n");

      // idle: vCPUs stopped after the grace; the next exec wakes it transparently
      expect(await waitFor(() => m.info(id).state === "paused", HANG_MS)).toBe(true);
      // Left paused a moment: seen the instant it paused, its paused time (whole ms) could be 0.
      await Bun.sleep(20);
      const tWake = performance.now();
      const r5 = await m.exec(id, { files: [], run: { kind: "shell", command: "cat /app/b.txt" } });
      const wakeMs = performance.now() - tWake;
      expect(r5.stdout).toBe("alpha\n");
      // round trip of a trivial exec on a warm VM, for the report
      const tRt = performance.now();
      await m.exec(id, { files: [], run: { kind: "argv", commands: [["true"]] } });
      console.log(
        `[agent-sandbox] boot ${created.forkTimeMs.toFixed(0)} ms, exec after idle pause ${wakeMs.toFixed(0)} ms, ` +
          `warm exec round trip ${(performance.now() - tRt).toFixed(1)} ms`,
      );

      // fork needs the snapshot driver: a typed error, and the sandbox stays usable
      expect(await codeOf(m.fork(id, 1))).toBe("unsupported");
      expect(m.info(id).state).toBe("running");

      const rep = m.usage(id);
      expect(rep.resources).toMatchObject({ vcpus: 1, memMib: 256 });
      expect(rep.resources.diskBytes).toBeGreaterThan(0);
      expect(rep.totalsMs.running).toBeGreaterThan(0);
      expect(rep.totalsMs.paused).toBeGreaterThan(0);
      expect(usage.some((iv) => iv.vmId === id && iv.phase === "paused" && iv.endMs > iv.startMs)).toBe(true);

      expect(m.info(id).execCount).toBe(7); // the refused (busy) calls do not count
      await m.destroy(id, { force: false });
      expect(await codeOf(m.exec(id, { files: [], run: { kind: "none" } }))).toBe("not_found");
      await m.destroy(id, { force: false }); // idempotent
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "normal destroy waits for the in-flight exec; force destroy aborts it at once",
    async () => {
      const { m } = await setup();
      const a = (await m.create(TEMPLATE, { kind: "sandbox" })).vmId;
      const b = (await m.create(TEMPLATE, { kind: "sandbox" })).vmId;

      const execA = m.exec(a, { files: [], run: { kind: "shell", command: "sleep 1; echo finished" } });
      expect(await waitFor(() => m.info(a).state === "busy", HANG_MS)).toBe(true);
      await m.destroy(a, { force: false });
      expect((await execA).stdout).toBe("finished\n");

      const execB = m.exec(b, { files: [], run: { kind: "shell", command: "sleep 60" } });
      const execBResult = execB.then(
        () => "resolved",
        (e: unknown) => e,
      );
      expect(await waitFor(() => m.info(b).state === "busy", HANG_MS)).toBe(true);
      const t0 = performance.now();
      await m.destroy(b, { force: true });
      const err = await execBResult;
      // Only catches a hang: not aborted, the exec would run its 60 s.
      expect(performance.now() - t0).toBeLessThan(HANG_MS);
      expect(err).toBeInstanceOf(SandboxdError);
      expect((err as SandboxdError).code).toBe("gone");
      expect((err as SandboxdError).message).toContain("destroyed (force)");
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "kill -9 of the QEMU mid-exec: the caller gets a clear error promptly, the sandbox is failed",
    async () => {
      const { m } = await setup();
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
      const ms = performance.now() - t0;
      expect(err).toBeInstanceOf(SandboxdError);
      expect((err as SandboxdError).code).toBe("gone");
      expect((err as SandboxdError).message).toContain("SIGKILL");
      // Only catches a hang: without the QEMU's death noticed, the exec would run its 60 s.
      expect(ms).toBeLessThan(HANG_MS);
      const info = m.info(id);
      expect(info.state).toBe("failed");
      expect(info.reason).toContain("QEMU exited");
      expect(await codeOf(m.exec(id, { files: [], run: { kind: "none" } }))).toBe("gone");
      await m.destroy(id, { force: false });
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "agent restart: running VMs are re-adopted with their files; a killed one is lost; strays reaped",
    async () => {
      const { m, stateDir, managers } = await setup({ idlePauseMs: 200 });
      const keep = (await m.create(TEMPLATE, { kind: "sandbox" })).vmId;
      const doomed = (await m.create(TEMPLATE, { kind: "sandbox" })).vmId;
      await m.exec(keep, {
        files: [{ path: "/root/state.txt", content: "survives\n" }],
        run: { kind: "none" },
      });
      // let `keep` reach the idle pause: adoption must wake a paused guest
      expect(await waitFor(() => m.info(keep).state === "paused", HANG_MS)).toBe(true);
      const doomedPid = m.info(doomed).qemuPid!;

      // The "crash": the old manager lets go of everything without destroying anything.
      await m.detach();
      managers.length = 0;
      process.kill(doomedPid, "SIGKILL");
      // A stray VM directory no record claims (e.g. left by a crash between mkdir and record).
      await mkdir(join(stateDir, "vms", "vm-stray"), { recursive: true });
      await writeFile(join(stateDir, "vms", "vm-stray", "owner.json"), JSON.stringify({ ownerPid: 999999 }));

      const m2 = await openManager(stateDir);
      managers.push(m2);
      expect(m2.info(keep).state).toBe("running");
      const r = await m2.exec(keep, { files: [], run: { kind: "shell", command: "cat /root/state.txt" } });
      expect(r.stdout).toBe("survives\n");
      expect(m2.info(keep).execCount).toBe(2);

      const lost = m2.info(doomed);
      expect(lost.state).toBe("lost");
      expect(lost.reason).toContain("not re-adopted");
      expect(await codeOf(m2.exec(doomed, { files: [], run: { kind: "none" } }))).toBe("gone");
      expect((await leftovers(stateDir)).vmDirs.sort()).toEqual([keep]);

      await m2.destroy(doomed, { force: false });
      await m2.destroy(keep, { force: false });
    },
    VM_TEST_TIMEOUT_MS,
  );
});
