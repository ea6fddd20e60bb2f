/**
 * An AGENT RESTART in a separate process loses no sandbox (snapshot driver, REAL VMs under TCG).
 *
 * A child `bun` process plays the old agent: it opens a manager + SnapshotDriver on a state dir,
 * builds the template, creates sandbox A (a file + a counter loop in the background; idle-paused
 * when the agent exits) and sandbox B (the same, then suspended), and exits with `process.exit` without destroying anything. This
 * process then opens a new manager on the same state dir: A is re-adopted (same QEMU, its file and
 * its process still there, exec works) and B resumes from its record. Afterwards everything is
 * destroyed and nothing may be left: no QEMU, socket, VM dir, overlay, state or RAM file (the
 * state dir's tmpfs directory under /dev/shm/sandboxd included).
 */
import { afterAll, expect, test } from "bun:test";
import { existsSync, readdirSync } from "node:fs";
import { mkdtemp, readFile, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { ensureGuestArtifacts } from "../../agent/guest/artifacts.ts";
import { SnapshotDriver } from "../../agent/sandbox/drivers/snapshot.ts";
import { SandboxManager } from "../../agent/sandbox/manager.ts";
import { defaultShmRoot } from "../../agent/snapshot/template.ts";
import {
  busyboxArchive,
  qemuPidsUnder,
  removeBusyboxArchive,
  TEST_CACHE_DIR,
  tempStateDir,
  waitFor,
} from "../support/real-vm.ts";

/** Two restores and a template build under TCG, plus a second agent process: 180 s is ample. */
const VM_TEST_TIMEOUT_MS = 180_000;
/** A bound for a counter's next tick (ten a second): it only catches a hang, on a loaded host. */
const HANG_MS = 30_000;
const REPO = resolve(import.meta.dir, "../..");

/** The old agent. Writes what it made to argv[5] as JSON, then exits leaving everything running. */
const CHILD_SCRIPT = `
import { writeFileSync } from "node:fs";
import { ensureGuestArtifacts } from "${REPO}/agent/guest/artifacts.ts";
import { SandboxManager } from "${REPO}/agent/sandbox/manager.ts";
import { SnapshotDriver } from "${REPO}/agent/sandbox/drivers/snapshot.ts";
import { COUNTER } from "${REPO}/tests/support/real-vm.ts";

const [stateDir, cacheDir, archive, out] = process.argv.slice(2);
const artifacts = await ensureGuestArtifacts({ dataDir: cacheDir });
const driver = await SnapshotDriver.create({ cacheDir, stateDir, artifacts });
const m = await SandboxManager.open({ driver, stateDir });
m.buildTemplate("busybox", { kind: "archive", path: archive });
await m.templates.settled("busybox");
const st = m.templates.status("busybox");
if (st.status !== "ready") throw new Error("template: " + JSON.stringify(st));
const sh = async (id, command) => {
  const r = await m.exec(id, { files: [], run: { kind: "shell", command } });
  if (r.exitCode !== 0) throw new Error(command + ": " + r.stderr);
  return r.stdout;
};
/** Polls cond every 25 ms for up to 30 s (a bound for a loaded host); the parent checks the outcome. */
const until = async (cond) => {
  for (const end = Date.now() + 30_000; Date.now() < end && !(await cond()); ) await Bun.sleep(25);
};
const count = async (id) => Number((await sh(id, "cat /tmp/c 2>/dev/null || echo 0")).trim());
const a = (await m.create("busybox", { kind: "sandbox" })).vmId;
await sh(a, "echo alive-a > /root/a.txt; " + COUNTER);
const b = (await m.create("busybox", { kind: "sandbox" })).vmId;
await sh(b, "echo alive-b > /root/b.txt; " + COUNTER);
await until(async () => (await count(b)) > 0);
const counterB = await count(b);
const suspended = await m.suspend(b);
const counterA = Number((await sh(a, "cat /tmp/c")).trim());
// Until the idle pause (2 s grace): A's vCPUs are stopped when the agent exits; adoption must
// wake it. The parent asserts that the pause came.
await until(() => m.info(a).state === "paused");
const stateA = m.info(a).state;
writeFileSync(out, JSON.stringify({ a, b, qemuPidA: m.info(a).qemuPid, stateA, counterA, counterB, memBytes: suspended.memBytes }));
process.exit(0); // an agent exit: nothing destroyed, nothing detached
`;

let scratch: string | undefined;
let stateDir: string | undefined;
afterAll(async () => {
  if (stateDir) {
    for (const pid of await qemuPidsUnder(stateDir)) process.kill(pid, "SIGKILL");
    await rm(stateDir, { recursive: true, force: true });
    await rm(defaultShmRoot(stateDir), { recursive: true, force: true });
  }
  if (scratch) await rm(scratch, { recursive: true, force: true });
  await removeBusyboxArchive();
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

test(
  "agent restart in a separate process: the running sandbox is re-adopted, the suspended one resumes, nothing leaks",
  async () => {
    scratch = await mkdtemp(join(tmpdir(), "sbx-restart-"));
    stateDir = await tempStateDir();
    const sd = stateDir;
    const shmRoot = defaultShmRoot(sd);
    const script = join(scratch, "old-agent.ts");
    const out = join(scratch, "made.json");
    await writeFile(script, CHILD_SCRIPT);
    // The artifacts are cached before the child runs (it would otherwise build them itself).
    const artifacts = await ensureGuestArtifacts({ dataDir: TEST_CACHE_DIR });

    const child = Bun.spawn(
      [process.execPath, "run", script, sd, TEST_CACHE_DIR, await busyboxArchive(), out],
      {
        stdout: "pipe",
        stderr: "pipe",
      },
    );
    const code = await child.exited;
    const stderr = await new Response(child.stderr).text();
    expect({ code, stderr: code === 0 ? "" : stderr }).toEqual({ code: 0, stderr: "" });
    const made = JSON.parse(await readFile(out, "utf8")) as {
      a: string;
      b: string;
      qemuPidA: number;
      stateA: string;
      counterA: number;
      counterB: number;
      memBytes: number;
    };
    expect(made.memBytes).toBeGreaterThan(0);
    expect(made.stateA).toBe("paused");
    // The old agent is gone; A's QEMU is not (it was not tied to the agent's life).
    expect(await qemuPidsUnder(sd)).toEqual([made.qemuPidA]);

    const t0 = performance.now();
    const driver = await SnapshotDriver.create({ cacheDir: TEST_CACHE_DIR, stateDir: sd, artifacts });
    const m = await SandboxManager.open({ driver, stateDir: sd });
    const reopenMs = performance.now() - t0;
    try {
      expect(m.templates.status("busybox").status).toBe("ready");
      const a = m.info(made.a);
      expect(a.state).toBe("running");
      expect(a.qemuPid).toBe(made.qemuPidA);
      expect(m.info(made.b)).toMatchObject({ state: "suspended" });

      const sh = async (id: string, command: string) => {
        const r = await m.exec(id, { files: [], run: { kind: "shell", command } });
        expect(r.exitCode).toBe(0);
        return r.stdout;
      };
      const tExec = performance.now();
      expect(await sh(made.a, "cat /root/a.txt")).toBe("alive-a\n");
      const firstExecMs = performance.now() - tExec;
      const a1 = Number((await sh(made.a, "cat /tmp/c")).trim());
      expect(a1).toBeGreaterThan(made.counterA); // the loop kept running across the restart
      const counter = async (id: string) => Number((await sh(id, "cat /tmp/c")).trim());
      expect(await waitFor(async () => (await counter(made.a)) > a1, HANG_MS)).toBe(true);
      expect((await sh(made.a, "hostname")).trim()).toBe(made.a);

      const tResume = performance.now();
      await m.resume(made.b);
      const resumeMs = performance.now() - tResume;
      expect(m.info(made.b).state).toBe("running");
      expect(await sh(made.b, "cat /root/b.txt")).toBe("alive-b\n");
      const b1 = Number((await sh(made.b, "cat /tmp/c")).trim());
      expect(b1).toBeGreaterThanOrEqual(made.counterB);
      expect(await waitFor(async () => (await counter(made.b)) > b1, HANG_MS)).toBe(true);

      // The adopted VM still forks (its QEMU's node names came from the record).
      const [kid] = await m.fork(made.a, 1);
      expect(await sh(kid!.vmId, "cat /root/a.txt")).toBe("alive-a\n");

      console.log(
        `AGENT_SNAPSHOT_RESTART ${JSON.stringify({
          reopen_with_adoption_ms: Math.round(reopenMs),
          first_exec_after_adoption_ms: Math.round(firstExecMs),
          resume_after_restart_ms: Math.round(resumeMs),
        })}`,
      );

      // Everything destroyed: nothing of the three VMs or the template may be left.
      for (const s of m.list()) await m.destroy(s.id, { force: false });
      await m.deleteTemplate("busybox");
      expect(m.list()).toEqual([]);
      expect(await qemuPidsUnder(sd)).toEqual([]);
      expect({
        vms: filesUnder(join(sd, "vms")),
        disks: filesUnder(join(sd, "storage", "disks")),
        suspended: filesUnder(join(sd, "storage", "suspended")),
        templates: filesUnder(join(sd, "templates")),
        records: filesUnder(join(sd, "records", "sandboxes")),
        sockets: filesUnder(sd).filter((f) => f.endsWith(".sock")),
        shm: filesUnder(shmRoot),
      }).toEqual({ vms: [], disks: [], suspended: [], templates: [], records: [], sockets: [], shm: [] });
      expect(existsSync(shmRoot)).toBe(false);
    } finally {
      for (const s of m.list()) await m.destroy(s.id, { force: true });
    }
  },
  VM_TEST_TIMEOUT_MS,
);
