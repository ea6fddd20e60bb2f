/**
 * What a jailed QEMU and the host's other users find, checked from the host with a real VM under
 * the serving commands' start (cli/data-dir.ts: umask 077, data dir 0700): QEMU's environment
 * (/proc/<pid>/environ) holds only the jail's PATH, none of the agent's secrets set in the agent
 * process's environment; the data dir is 0700 and the files the agent wrote under it have no
 * group or other bits, and the jail still works under that umask (a sandbox runs a command).
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { spawn } from "node:child_process";
import { chmodSync, lstatSync, readdirSync, readFileSync, type Stats, statSync } from "node:fs";
import { rm } from "node:fs/promises";
import { join, relative } from "node:path";
import { JAIL_ENV } from "../../agent/qemu/jail.ts";
import type { SandboxManager } from "../../agent/sandbox/manager.ts";
import { defaultShmRoot } from "../../agent/snapshot/template.ts";
import { lockDownDataDir } from "../../cli/data-dir.ts";
import {
  managerWithBusybox,
  qemuPidsUnder,
  removeBusyboxArchive,
  shellIn,
  TEST_CACHE_DIR,
  tempStateDir,
} from "../support/real-vm.ts";

/** Template build and one spawn under TCG on a 2-core host. */
const VM_TEST_TIMEOUT_MS = 240_000;
const CANARY = `canary-${process.pid}`;
const SECRETS = ["SANDBOXD_CONNECT_SECRET", "SANDBOXD_KEY_PEPPER", "DATABASE_URL"] as const;

let stateDir: string;
let m: SandboxManager;
const umaskBefore = process.umask();
const envBefore = Object.fromEntries(SECRETS.map((k) => [k, process.env[k]]));
const logs: string[] = [];

beforeAll(async () => {
  for (const k of SECRETS) process.env[k] = `${CANARY}-${k}`;
  stateDir = await tempStateDir();
  chmodSync(stateDir, 0o755); // an earlier, looser data dir: tightened at start
  await lockDownDataDir(stateDir, (l) => logs.push(l));
  m = await managerWithBusybox({ stateDir, cacheDir: TEST_CACHE_DIR, memMib: 128 });
}, VM_TEST_TIMEOUT_MS);

afterAll(async () => {
  try {
    if (m) {
      for (const s of m.list()) await m.destroy(s.id, { force: true });
      await m.deleteTemplate("bb");
    }
  } finally {
    process.umask(umaskBefore);
    for (const k of SECRETS) {
      if (envBefore[k] === undefined) delete process.env[k];
      else process.env[k] = envBefore[k];
    }
    await rm(stateDir, { recursive: true, force: true });
    await rm(defaultShmRoot(stateDir), { recursive: true, force: true });
    await removeBusyboxArchive();
  }
});

function environOf(pid: number): string[] {
  return readFileSync(`/proc/${pid}/environ`, "latin1").split("\0").filter(Boolean);
}

function ppidOf(pid: number): number {
  const m = /^PPid:\s+(\d+)/m.exec(readFileSync(`/proc/${pid}/status`, "utf8"));
  return Number(m?.[1]);
}

/**
 * Every entry under `dir` (not following links), relative to it, with its lstat. The running
 * agent keeps writing records (a temp file renamed over the old one), so a name may go between
 * the listing and its lstat: such a name is skipped, not a failure.
 */
function walk(dir: string, out: { p: string; st: Stats }[] = [], root = dir): { p: string; st: Stats }[] {
  for (const name of readdirSync(dir)) {
    const p = join(dir, name);
    let st: Stats;
    try {
      st = lstatSync(p);
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code === "ENOENT") continue;
      throw err;
    }
    out.push({ p: relative(root, p), st });
    if (st.isDirectory()) walk(p, out, root);
  }
  return out;
}

test(
  "QEMU and its jail's shell hold only the jail's environment: no secret of the agent's",
  async () => {
    // The control: a child spawned with the agent's environment, as QEMU was before, holds them.
    const control = spawn("sleep", ["30"], { stdio: "ignore" });
    try {
      // Read once it is `sleep`: before its exec, /proc shows the forked runtime's environment.
      const pid = control.pid as number;
      const deadline = Date.now() + 5_000;
      while (!readFileSync(`/proc/${pid}/cmdline`, "latin1").startsWith("sleep\0") && Date.now() < deadline)
        await Bun.sleep(5);
      expect(environOf(pid).filter((e) => e.includes(CANARY))).toHaveLength(SECRETS.length);
    } finally {
      control.kill("SIGKILL");
    }
    const { vmId } = await m.create("bb", { kind: "sandbox" });
    expect((await shellIn(m, vmId, "echo jailed")).trim()).toBe("jailed");
    const pids = await qemuPidsUnder(join(stateDir, "vms", vmId));
    expect(pids).toHaveLength(1);
    const qemu = pids[0] as number;
    const allowed = Object.entries(JAIL_ENV).map(([k, v]) => `${k}=${v}`);
    const seen = { qemu: environOf(qemu), jailShell: environOf(ppidOf(qemu)) };
    console.log(JSON.stringify(seen));
    expect(seen).toEqual({ qemu: allowed, jailShell: allowed });
  },
  VM_TEST_TIMEOUT_MS,
);

test(
  "the data dir is 0700 (tightened at start) and what the agent wrote under it is its own",
  () => {
    expect(statSync(stateDir).mode & 0o777).toBe(0o700);
    expect(logs).toEqual([`data dir ${stateDir} was mode 755: tightened to 700`]);
    const entries = walk(stateDir);
    // The jail's skeleton (empty mount points and merged-usr links, inside the VM's own 0700
    // directory) is 0755 for QEMU to walk; a template's disk is every child's read-only backing
    // file, readable by their uids (agent/qemu/jail-setup.ts).
    const skeleton = (p: string) => /^vms\/[^/]+\/root(\/|$)/.test(p);
    const boundReadOnly = (p: string) => /^templates\/[^/]+\/disk\.qcow2$/.test(p);
    // The VM directory itself is root's with the jail's own group (1770, docs/isolation.md): its
    // QEMU adds its sockets there; the group is that VM's uid alone, not the host's users.
    const vmDir = (p: string) => /^vms\/[^/]+$/.test(p);
    const ownVmGroup = entries.filter(({ p }) => vmDir(p));
    for (const { st } of ownVmGroup) {
      expect(st.uid).toBe(0);
      expect(st.mode & 0o7777).toBe(0o1770);
    }
    const agents = entries.filter(({ p }) => !skeleton(p) && !boundReadOnly(p) && !vmDir(p));
    const open = agents
      .filter(({ st }) => (st.mode & 0o077) !== 0)
      .map(({ p, st }) => `${p} ${(st.mode & 0o7777).toString(8)}`);
    console.log(`${agents.length} entries of the agent's checked; open: ${JSON.stringify(open)}`);
    expect(agents.filter(({ st }) => st.isFile()).length).toBeGreaterThan(3);
    expect(open).toEqual([]);
    for (const { st } of entries.filter(({ p }) => boundReadOnly(p))) expect(st.mode & 0o022).toBe(0);
  },
  VM_TEST_TIMEOUT_MS,
);
