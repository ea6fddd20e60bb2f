/**
 * Kept snapshots on real QEMU (agent/snapshot/keep.ts through the snapshot driver and the
 * manager, docs/snapshots.md): a sandbox writes a file and starts a counting process, a snapshot
 * is taken, the source changes the file; two sandboxes started from the snapshot each find the
 * file as it was and the process still counting from the snapshot's value, and they diverge. A
 * delete while they run leaves their files in place; the kept files go with the last of them. A
 * new agent process on the same state dir (a restart) starts VMs from a snapshot kept before it.
 * A sandbox rolled back in place to its snapshot (three times) has its file, its counting process
 * and the counter's value back, frees the overlays it replaced, and is adopted after a restart;
 * each rollback takes the standby QEMU launched beside the VM's own (seen from /proc: two QEMUs of
 * the VM's directory, two uids), which goes with the VM.
 * Run under the VM test lock: `flock /tmp/vm-test.lock env SANDBOXD_TEST_DATA=... bun test <file>`.
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { existsSync, readdirSync } from "node:fs";
import { readFile, rm, stat } from "node:fs/promises";
import { join } from "node:path";
import { ensureGuestArtifacts } from "../../agent/guest/artifacts.ts";
import { SnapshotDriver } from "../../agent/sandbox/drivers/snapshot.ts";
import { SandboxManager } from "../../agent/sandbox/manager.ts";
import { defaultShmRoot } from "../../agent/snapshot/template.ts";
import { storageDir } from "../../agent/snapshot/vm.ts";
import { qemuPidsNaming } from "../../agent/vm/process.ts";
import {
  COUNTER,
  codeOf,
  leftovers,
  managerWithBusybox,
  removeBusyboxArchive,
  shellIn,
  TEST_CACHE_DIR,
  tempStateDir,
  waitFor,
} from "../support/real-vm.ts";

/** A template build (~10 s under TCG), a fork-like snapshot and four restores; 300 s covers a slow, shared CI host. */
const VM_TEST_TIMEOUT_MS = 300_000;
const MEM_MIB = 128;
const REF = "snap_vmtest0001";
const REF2 = "snap_vmtest0002";
const REF3 = "snap_vmtest0003";

let stateDir: string;
let m: SandboxManager;

beforeAll(async () => {
  stateDir = await tempStateDir();
  m = await managerWithBusybox({ stateDir, cacheDir: TEST_CACHE_DIR, memMib: MEM_MIB });
}, VM_TEST_TIMEOUT_MS);

afterAll(async () => {
  try {
    for (const s of m?.list() ?? []) await m.destroy(s.id, { force: true });
    expect((await leftovers(stateDir)).qemus).toEqual([]);
  } finally {
    await rm(stateDir, { recursive: true, force: true });
    await rm(defaultShmRoot(stateDir), { recursive: true, force: true });
    await removeBusyboxArchive();
  }
}, VM_TEST_TIMEOUT_MS);

/**
 * A new agent process: the manager detached (`afterDetach` looks at the host in between), a new
 * driver and manager on the same state dir.
 */
async function restartAgent(afterDetach?: () => Promise<void>): Promise<void> {
  await m.detach();
  await afterDetach?.();
  const driver = await SnapshotDriver.create({
    cacheDir: TEST_CACHE_DIR,
    stateDir,
    artifacts: await ensureGuestArtifacts({ dataDir: TEST_CACHE_DIR }),
  });
  m = await SandboxManager.open({ driver, stateDir });
}

/** The real uid a process runs as, from /proc/<pid>/status. */
async function uidOf(pid: number): Promise<number> {
  const status = await readFile(`/proc/${pid}/status`, "utf8");
  return Number(/^Uid:\s+(\d+)/m.exec(status)?.[1]);
}

const counter = async (id: string) => Number((await shellIn(m, id, "cat /tmp/c")).trim());
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

test(
  "two sandboxes from one snapshot: the file as it was, the process counting on from its value, then apart",
  async () => {
    const src = (await m.create("bb", { kind: "sandbox" })).vmId;
    await shellIn(m, src, `mkdir -p /root && echo before > /root/f && ${COUNTER}`);
    await sleep(1500);
    const atSnapshot = await counter(src);
    const taken = await m.takeSnapshot(src, REF);
    expect(taken.sizeBytes).toBeGreaterThan(0);
    console.log(`snapshot ${REF}: source stalled ${taken.stallMs.toFixed(1)} ms, keeps ${taken.sizeBytes} B`);
    // The source runs on and changes after the snapshot.
    await shellIn(m, src, "echo after > /root/f");
    expect((await shellIn(m, src, "cat /root/f")).trim()).toBe("after");
    await sleep(1500);

    const kids = [
      (await m.createFromSnapshot(REF, { kind: "sandbox" })).vmId,
      (await m.createFromSnapshot(REF, { kind: "sandbox" })).vmId,
    ];
    for (const kid of kids) {
      expect((await shellIn(m, kid, "cat /root/f")).trim()).toBe("before");
      const first = await counter(kid);
      const sourceNow = await counter(src);
      // Counting on from the snapshot's value: not from 0, and behind the source, which ran on
      // meanwhile (1.5 s at least, ~15 counts).
      expect(first).toBeGreaterThanOrEqual(atSnapshot);
      expect(first).toBeLessThan(sourceNow);
      await sleep(600);
      expect(await counter(kid)).toBeGreaterThan(first);
    }
    // Apart: one's write is not the other's, nor the source's.
    await shellIn(m, kids[0]!, "echo k1 > /root/f");
    expect((await shellIn(m, kids[1]!, "cat /root/f")).trim()).toBe("before");
    expect((await shellIn(m, src, "cat /root/f")).trim()).toBe("after");

    // Deleted while both run: gone for new starts, their files kept until the last ends.
    const kept = join(storageDir(stateDir), `${REF}.state`);
    expect(existsSync(kept)).toBe(true);
    expect(await m.listSnapshots()).toEqual([REF]);
    await m.deleteSnapshot(REF);
    expect(await m.listSnapshots()).toEqual([]);
    expect(await codeOf(m.createFromSnapshot(REF, { kind: "sandbox" }))).toBe("not_found");
    expect((await shellIn(m, kids[1]!, "cat /root/f")).trim()).toBe("before");
    await m.destroy(kids[0]!, { force: true });
    expect((await shellIn(m, kids[1]!, "cat /root/f")).trim()).toBe("before");
    await m.destroy(kids[1]!, { force: true });
    expect(existsSync(kept)).toBe(false);
    await m.destroy(src, { force: true });
  },
  VM_TEST_TIMEOUT_MS,
);

test(
  "restore in place: the same sandbox rolls back to its snapshot, again and again, and survives an agent restart",
  async () => {
    const id = (await m.create("bb", { kind: "sandbox" })).vmId;
    await shellIn(m, id, `mkdir -p /root && echo before > /root/f && ${COUNTER} echo $! > /tmp/cpid`);
    await sleep(1000);
    const pidAtSnapshot = (await shellIn(m, id, "cat /tmp/cpid")).trim();
    expect(pidAtSnapshot).toMatch(/^\d+$/);
    await m.takeSnapshot(id, REF3);
    const atSnapshot = await counter(id);
    // Seen from the host: the standby QEMU for the next rollback runs beside the VM's own, each
    // in its own slot of the VM's directory, as its own uid.
    const vmDir = join(stateDir, "vms", id);
    expect(await waitFor(async () => (await qemuPidsNaming([vmDir])).length === 2, 30_000)).toBe(true);
    const uids = await Promise.all((await qemuPidsNaming([vmDir])).map(uidOf));
    expect(new Set(uids).size).toBe(2);
    // Admission counts the standby's overhead as a VM's: the one it counts is the one /proc shows.
    expect(m.capacity.memory.standbys()).toBe(1);
    // The standby's slot is root's with its own jail's group, mode 1770: the VM's QEMU (in the
    // directory above, another uid and group) cannot enter it.
    const next = await stat(join(vmDir, "next"));
    expect({ mode: next.mode & 0o7777, uid: next.uid }).toEqual({ mode: 0o1770, uid: 0 });
    expect(uids).toContain(next.gid);
    const own = await stat(vmDir);
    expect(own.gid).not.toBe(next.gid);
    expect(uids).toContain(own.gid);
    const files = () => readdirSync(storageDir(stateDir)).sort();
    let filesAfterFirst: string[] | undefined;
    for (let round = 0; round < 3; round++) {
      // Change everything: the file, a new file, the counter runs on, the process is killed.
      await shellIn(m, id, `echo after${round} > /root/f && touch /root/new && kill ${pidAtSnapshot}`);
      await sleep(300);
      // The standby armed after the snapshot (or the last rollback) is up before each rollback.
      expect(await waitFor(async () => (await qemuPidsNaming([vmDir])).length === 2, 30_000)).toBe(true);
      const r = await m.restoreSnapshot(id, REF3);
      console.log(`restore ${round}: ${r.restoreMs.toFixed(0)} ms, down ${r.downMs.toFixed(0)} ms`);
      expect(r).toMatchObject({ snapshot: REF3, standby: true });
      expect(m.info(id).state).toBe("running");
      expect((await shellIn(m, id, "cat /root/f")).trim()).toBe("before");
      expect((await shellIn(m, id, "ls /root")).trim().split(/\s+/)).toEqual(["f"]);
      // The counting process is back (the same pid) and counts on from the snapshot's value.
      expect((await shellIn(m, id, `kill -0 ${pidAtSnapshot} && echo alive`)).trim()).toBe("alive");
      const first = await counter(id);
      expect(first).toBeLessThanOrEqual(atSnapshot + 3);
      await sleep(500);
      expect(await counter(id)).toBeGreaterThan(first);
      // Rollbacks do not pile up files: the overlays each one replaced are freed.
      if (round === 0) filesAfterFirst = files();
      else expect(files().length).toBe(filesAfterFirst!.length);
    }
    // A refused restore changes nothing: the sandbox runs on as it was.
    await shellIn(m, id, "echo kept-on > /root/f");
    expect(await codeOf(m.restoreSnapshot(id, "snap_notkept0"))).toBe("not_found");
    expect(m.info(id).state).toBe("running");
    expect((await shellIn(m, id, "cat /root/f")).trim()).toBe("kept-on");

    // The rolled-back VM (its QEMU in the directory's `next/` slot after three rollbacks) is what
    // a new agent process adopts: its record names the new QEMU and its slot. The standby the old
    // agent armed is gone with it (before the old agent's detach returns: it was that process's,
    // not the VM's), so the next rollback launches its QEMU on the spot.
    await restartAgent(async () => expect(await qemuPidsNaming([vmDir])).toHaveLength(1));
    expect((await shellIn(m, id, "cat /root/f")).trim()).toBe("kept-on");
    expect(await qemuPidsNaming([vmDir])).toHaveLength(1);
    expect(m.capacity.memory.standbys()).toBe(0);
    const cold = await m.restoreSnapshot(id, REF3);
    console.log(`cold restore: ${cold.restoreMs.toFixed(0)} ms, down ${cold.downMs.toFixed(0)} ms`);
    expect(cold.standby).toBe(false);
    expect((await shellIn(m, id, "cat /root/f")).trim()).toBe("before");
    // And a standby for the next rollback is armed again beside it.
    expect(await waitFor(async () => (await qemuPidsNaming([vmDir])).length === 2, 30_000)).toBe(true);
    expect(m.capacity.memory.standbys()).toBe(1);
    await m.destroy(id, { force: true });
    expect(await qemuPidsNaming([vmDir])).toEqual([]);
    expect(m.capacity.memory.standbys()).toBe(0);
    await m.deleteSnapshot(REF3);
    expect(existsSync(join(storageDir(stateDir), `${REF3}.state`))).toBe(false);
    expect(existsSync(join(storageDir(stateDir), `${REF3}.mem`))).toBe(false);
  },
  VM_TEST_TIMEOUT_MS,
);

test(
  "a snapshot kept before an agent restart starts VMs after it",
  async () => {
    const src = (await m.create("bb", { kind: "sandbox" })).vmId;
    await shellIn(m, src, "mkdir -p /root && echo kept > /root/g");
    await m.takeSnapshot(src, REF2);
    await m.destroy(src, { force: true });
    await restartAgent();
    // What the gateway's reconciliation asks a host back from lost (`GET /snapshots`).
    expect(await m.listSnapshots()).toEqual([REF2]);
    const kid = (await m.createFromSnapshot(REF2, { kind: "sandbox" })).vmId;
    expect((await shellIn(m, kid, "cat /root/g")).trim()).toBe("kept");
    await m.destroy(kid, { force: true });
    await m.deleteSnapshot(REF2);
    expect(await m.listSnapshots()).toEqual([]);
    expect(existsSync(join(storageDir(stateDir), `${REF2}.state`))).toBe(false);
  },
  VM_TEST_TIMEOUT_MS,
);
