/**
 * Pre-launched QEMUs (agent/sandbox/prelaunch-pool.ts) with REAL VMs under TCG: the manager keeps
 * one QEMU per template launched in its jail and waiting for the template's state. A create that
 * finds one (a pool hit) and a create that finds none (a miss) both give working sandboxes that
 * are alike afterwards (own hostname = id, own boot id). The pool's QEMUs are freed like any VM:
 * an agent stop leaves none, a crashed agent's are reaped by the next, and a deleted template
 * leaves no QEMU, VM dir, overlay, cgroup or uid lock of them.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { existsSync, readdirSync, readFileSync, statSync } from "node:fs";
import { rm } from "node:fs/promises";
import { join } from "node:path";
import { ensureGuestArtifacts, type GuestArtifacts } from "../../agent/guest/artifacts.ts";
import { vmCgroupDirs } from "../../agent/qemu/cgroup.ts";
import { UID_LOCK_DIR } from "../../agent/qemu/uids.ts";
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

/** A test restores a few VMs under TCG on a 2-core host; 180 s covers a loaded CI machine. */
const VM_TEST_TIMEOUT_MS = 180_000;
/** A pre-launch takes ~40-150 ms; a loaded CI host may need seconds. */
const POOL_WAIT_MS = 60_000;
const TEMPLATE = "busybox";

let stateDir: string;
let shmRoot: string;
let artifacts: GuestArtifacts;
let m: SandboxManager;
const driverLog: string[] = [];

async function openManager(): Promise<SandboxManager> {
  const driver = await SnapshotDriver.create({
    cacheDir: TEST_CACHE_DIR,
    stateDir,
    artifacts,
    log: (l) => driverLog.push(l),
  });
  return SandboxManager.open({ driver, stateDir, prelaunch: 1 });
}

beforeAll(async () => {
  stateDir = await tempStateDir();
  shmRoot = defaultShmRoot(stateDir);
  artifacts = await ensureGuestArtifacts({ dataDir: TEST_CACHE_DIR });
  m = await openManager();
  m.buildTemplate(TEMPLATE, { kind: "archive", path: await busyboxArchive() });
  await m.templates.settled(TEMPLATE);
  expect(m.templates.status(TEMPLATE)).toMatchObject({ status: "ready" });
}, VM_TEST_TIMEOUT_MS);

afterAll(async () => {
  try {
    if (m) {
      for (const s of m.list()) await m.destroy(s.id, { force: true });
      await m.detach();
    }
  } finally {
    await rm(stateDir, { recursive: true, force: true });
    await rm(shmRoot, { recursive: true, force: true });
    await removeBusyboxArchive();
  }
});

function vmIds(): string[] {
  const d = join(stateDir, "vms");
  return existsSync(d) ? readdirSync(d) : [];
}

/** The pool's one QEMU of the template, once it is up: its VM id and jail uid. */
async function pooled(mgr: SandboxManager): Promise<{ id: string; uid: number }> {
  expect(await waitFor(() => mgr.prelaunch.sizes()[TEMPLATE] === 1, POOL_WAIT_MS)).toBe(true);
  const live = new Set(mgr.list().map((s) => s.id));
  const ids = vmIds().filter((id) => !live.has(id));
  expect(ids).toHaveLength(1);
  const id = ids[0]!;
  const owner = JSON.parse(readFileSync(join(stateDir, "records", "vms", id, "owner.json"), "utf8")) as {
    jailUid?: number;
  };
  expect(owner.jailUid).toBeGreaterThan(0);
  return { id, uid: owner.jailUid! };
}

/** What a VM of `id` (jailed as `uid`) would leave on the host if it were not freed. */
function leftoversOf(id: string, uid: number): string[] {
  const out: string[] = [];
  const dir = join(stateDir, "vms", id);
  if (existsSync(dir)) out.push(`vm dir ${dir}`);
  const disks = join(stateDir, "storage", "disks");
  for (const f of existsSync(disks) ? readdirSync(disks) : [])
    if (f.startsWith(`${id}-`)) out.push(`disk ${f}`);
  for (const d of vmCgroupDirs(dir)?.dirs ?? []) {
    try {
      statSync(d);
      out.push(`cgroup ${d}`);
    } catch {
      // gone: good
    }
  }
  if (existsSync(UID_LOCK_DIR) && readdirSync(UID_LOCK_DIR).includes(String(uid)))
    out.push(`uid lock ${uid}`);
  return out;
}

async function sh(mgr: SandboxManager, id: string, command: string): Promise<string> {
  const r = await mgr.exec(id, { files: [], run: { kind: "shell", command } });
  if (r.exitCode !== 0) throw new Error(`${command}: exit ${r.exitCode}: ${r.stderr}`);
  return r.stdout.trim();
}

describe("pre-launched QEMUs with real VMs", () => {
  test(
    "a pool hit and a pool miss both give working sandboxes, alike afterwards",
    async () => {
      const pre = await pooled(m);
      // Hit: the create takes the pre-launched QEMU and keeps its id.
      const hit = await m.create(TEMPLATE, { kind: "sandbox" });
      expect(hit.vmId).toBe(pre.id);
      expect(
        driverLog.some((l) => l.startsWith(`spawned ${hit.vmId} `) && l.includes("(pre-launched)")),
      ).toBe(true);
      // Miss: with the pool emptied first, the create spawns cold.
      await m.prelaunch.drain(TEMPLATE);
      const miss = await m.create(TEMPLATE, { kind: "sandbox" });
      expect(miss.vmId).not.toBe(pre.id);
      const missLine = driverLog.find((l) => l.startsWith(`spawned ${miss.vmId} `));
      expect(missLine).toBeDefined();
      expect(missLine).not.toContain("(pre-launched)");
      // Both run commands, each under its own hostname (its id) and its own boot id.
      const [hHit, hMiss] = [await sh(m, hit.vmId, "hostname"), await sh(m, miss.vmId, "hostname")];
      expect([hHit, hMiss]).toEqual([hit.vmId, miss.vmId]);
      const boot = "cat /proc/sys/kernel/random/boot_id";
      expect(await sh(m, hit.vmId, boot)).not.toBe(await sh(m, miss.vmId, boot));
      expect(await sh(m, hit.vmId, "echo $((6*7))")).toBe("42");
      expect(await sh(m, miss.vmId, "echo $((6*7))")).toBe("42");
      // The pool refilled beside them, counted against capacity with them.
      const next = await pooled(m);
      expect([hit.vmId, miss.vmId]).not.toContain(next.id);
      expect(m.prelaunch.used().count).toBe(1);
      await m.destroy(hit.vmId, { force: true });
      await m.destroy(miss.vmId, { force: true });
      expect(vmIds()).toEqual([next.id]);
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "stopping the agent leaves no pre-launched QEMU; a crashed agent's are reaped by the next",
    async () => {
      const pre = await pooled(m);
      await m.detach();
      expect(await qemuPidsUnder(stateDir)).toEqual([]);
      expect(leftoversOf(pre.id, pre.uid)).toEqual([]);
      expect(vmIds()).toEqual([]);

      // A crash: a driver pre-launches a QEMU (which outlives its agent, as sandboxes do) and its
      // process lets go of it without freeing it.
      const crashed = await SnapshotDriver.create({ cacheDir: TEST_CACHE_DIR, stateDir, artifacts });
      await crashed.restoreTemplate(TEMPLATE, m.templates.ready(TEMPLATE).prepared);
      await crashed.prelaunch(TEMPLATE, "vm-crashed0000000", { vcpus: 1, memMib: 256 });
      const owner = JSON.parse(
        readFileSync(join(stateDir, "records", "vms", "vm-crashed0000000", "owner.json"), "utf8"),
      ) as {
        jailUid: number;
      };
      await crashed.detach();
      expect((await qemuPidsUnder(stateDir)).length).toBe(1);

      // The next agent reaps it before it pre-launches its own.
      m = await openManager();
      expect(leftoversOf("vm-crashed0000000", owner.jailUid)).toEqual([]);
      const again = await pooled(m);
      expect(again.id).not.toBe("vm-crashed0000000");
      expect(await qemuPidsUnder(stateDir)).toHaveLength(1);
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "deleting the template leaves no pre-launched QEMU, VM dir, overlay, cgroup or uid lock",
    async () => {
      const pre = await pooled(m);
      await m.deleteTemplate(TEMPLATE);
      expect(m.prelaunch.used().count).toBe(0);
      expect(await qemuPidsUnder(stateDir)).toEqual([]);
      expect(leftoversOf(pre.id, pre.uid)).toEqual([]);
      expect(vmIds()).toEqual([]);
      // The template's files went with the last VM holding them (its RAM file included).
      expect(existsSync(shmRoot)).toBe(false);
    },
    VM_TEST_TIMEOUT_MS,
  );
});
