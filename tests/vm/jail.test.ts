/**
 * Every QEMU is jailed (agent/qemu/jail.ts), checked from the host with real VMs through the real
 * agent (SandboxManager + SnapshotDriver under TCG): with two sandboxes running, each QEMU runs as
 * its own non-zero uid, with no capabilities, seccomp filtering and no-new-privs, in mount, net
 * and pid namespaces of its own, under a root that is not the host's, in a cgroup with finite
 * memory and pids limits; exec, fork and suspend/resume work jailed; destroy leaves no cgroup,
 * mount or uid. A jail that cannot be built fails the create clearly and starts no QEMU.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { readdirSync, readFileSync, readlinkSync, statSync } from "node:fs";
import { rm } from "node:fs/promises";
import { join } from "node:path";
import { ensureGuestArtifacts } from "../../agent/guest/artifacts.ts";
import { vmCgroupDirs } from "../../agent/qemu/cgroup.ts";
import { DEFAULT_UID_RANGE, UID_LOCK_DIR, uidsInUse } from "../../agent/qemu/uids.ts";
import { SnapshotDriver } from "../../agent/sandbox/drivers/snapshot.ts";
import { SandboxManager } from "../../agent/sandbox/manager.ts";
import { spawnFromTemplate } from "../../agent/snapshot/spawn.ts";
import { defaultShmRoot, listTemplates } from "../../agent/snapshot/template.ts";
import { DEFAULT_VM_HOST } from "../../agent/vm/host-settings.ts";
import { describeError } from "../../contracts/errors.ts";
import {
  busyboxArchive,
  qemuPidsUnder,
  removeBusyboxArchive,
  TEST_CACHE_DIR,
  tempStateDir,
} from "../support/real-vm.ts";

/** Template build, two spawns, a fork and a suspend/resume under TCG on a 2-core host. */
const VM_TEST_TIMEOUT_MS = 240_000;
const TEMPLATE = "busybox";

let stateDir: string;
let m: SandboxManager;

beforeAll(async () => {
  stateDir = await tempStateDir();
  const artifacts = await ensureGuestArtifacts({ dataDir: TEST_CACHE_DIR });
  const driver = await SnapshotDriver.create({ cacheDir: TEST_CACHE_DIR, stateDir, artifacts });
  m = await SandboxManager.open({ driver, stateDir });
  m.buildTemplate(TEMPLATE, { kind: "archive", path: await busyboxArchive() });
  await m.templates.settled(TEMPLATE);
  expect(m.templates.status(TEMPLATE)).toMatchObject({ status: "ready" });
}, VM_TEST_TIMEOUT_MS);

afterAll(async () => {
  try {
    if (m) {
      for (const s of m.list()) await m.destroy(s.id, { force: true });
      await m.deleteTemplate(TEMPLATE);
    }
  } finally {
    await rm(stateDir, { recursive: true, force: true });
    await rm(defaultShmRoot(stateDir), { recursive: true, force: true });
    await removeBusyboxArchive();
  }
});

const vmDir = (vmId: string) => join(stateDir, "vms", vmId);

async function qemuPidOf(vmId: string): Promise<number> {
  const pids = await qemuPidsUnder(vmDir(vmId));
  expect(pids).toHaveLength(1);
  return pids[0] as number;
}

function status(pid: number): Record<string, string> {
  const out: Record<string, string> = {};
  for (const line of readFileSync(`/proc/${pid}/status`, "utf8").split("\n")) {
    const i = line.indexOf(":");
    if (i > 0) out[line.slice(0, i)] = line.slice(i + 1).trim();
  }
  return out;
}

/** The cgroup limit files of `pid`, read through the host's cgroup mounts (v1 or v2). */
function cgroupLimits(pid: number): { memory: string; pids: string } {
  const lines = readFileSync(`/proc/${pid}/cgroup`, "utf8").trim().split("\n");
  const pathOf = (ctrl: string) =>
    lines.find((l) => l.split(":")[1]?.split(",").includes(ctrl))?.split(":")[2];
  const v2 = lines.find((l) => l.startsWith("0::"))?.slice(3);
  const memV1 = pathOf("memory");
  const pidsV1 = pathOf("pids");
  if (memV1 !== undefined && pidsV1 !== undefined) {
    return {
      memory: readFileSync(join("/sys/fs/cgroup/memory", memV1, "memory.limit_in_bytes"), "utf8").trim(),
      pids: readFileSync(join("/sys/fs/cgroup/pids", pidsV1, "pids.max"), "utf8").trim(),
    };
  }
  return {
    memory: readFileSync(join("/sys/fs/cgroup", v2 ?? "/", "memory.max"), "utf8").trim(),
    pids: readFileSync(join("/sys/fs/cgroup", v2 ?? "/", "pids.max"), "utf8").trim(),
  };
}

async function sh(id: string, command: string): Promise<string> {
  const r = await m.exec(id, { files: [], run: { kind: "shell", command } });
  if (r.exitCode !== 0) throw new Error(`${command}: exit ${r.exitCode}: ${r.stderr}`);
  return r.stdout;
}

/** What a VM's jail leaves on the host if it is not freed: its cgroup, a mount, its uid. */
function jailLeftovers(vmId: string, uid: number): string[] {
  const out: string[] = [];
  for (const d of vmCgroupDirs(vmDir(vmId))?.dirs ?? []) {
    try {
      statSync(d);
      out.push(`cgroup ${d}`);
    } catch {
      // gone: good
    }
  }
  for (const line of readFileSync("/proc/self/mountinfo", "utf8").split("\n"))
    if (line.includes(vmDir(vmId))) out.push(`mount ${line}`);
  if (uidsInUse({ base: uid, count: 1 }).has(uid)) out.push(`a process runs as uid ${uid}`);
  if (readdirSync(UID_LOCK_DIR).includes(String(uid))) out.push(`uid lock ${uid}`);
  return out;
}

describe("jailed QEMU", () => {
  test(
    "two sandboxes: own uids, no capabilities, seccomp, own namespaces and root, finite cgroup limits; exec, fork, suspend/resume work; destroy leaves nothing",
    async () => {
      const a = (await m.create(TEMPLATE, { kind: "sandbox" })).vmId;
      const b = (await m.create(TEMPLATE, { kind: "sandbox" })).vmId;
      const pa = await qemuPidOf(a);
      const pb = await qemuPidOf(b);
      const range = DEFAULT_UID_RANGE;
      const uids: number[] = [];
      for (const pid of [pa, pb]) {
        const st = status(pid);
        const uid = Number(st.Uid?.split(/\s+/)[0]);
        expect(uid).toBeGreaterThan(0);
        expect(uid).toBeGreaterThanOrEqual(range.base);
        // real, effective, saved and filesystem uid alike
        expect(new Set(st.Uid?.split(/\s+/))).toEqual(new Set([String(uid)]));
        uids.push(uid);
        expect(st.CapEff).toBe("0000000000000000");
        expect(st.CapPrm).toBe("0000000000000000");
        expect(st.CapBnd).toBe("0000000000000000");
        expect(st.Seccomp).toBe("2");
        expect(st.NoNewPrivs).toBe("1");
        for (const ns of ["mnt", "net", "pid"])
          expect(readlinkSync(`/proc/${pid}/ns/${ns}`)).not.toBe(readlinkSync(`/proc/self/ns/${ns}`));
        // Its root is not the host's: another directory, holding only the jail's few entries.
        const root = statSync(`/proc/${pid}/root`);
        const hostRoot = statSync("/");
        expect(`${root.dev}:${root.ino}`).not.toBe(`${hostRoot.dev}:${hostRoot.ino}`);
        const entries = readdirSync(`/proc/${pid}/root`);
        // Its /etc is not the host's: a child of the template holds only what the agent wrote
        // for its RAM-file shim (agent/qemu/ram-readonly.c), nothing of the host's.
        expect(readdirSync(`/proc/${pid}/root/etc`).sort()).toEqual(["ld.so.preload", "sandboxd"]);
        expect(readdirSync(`/proc/${pid}/root/etc/sandboxd`)).toEqual(["readonly-ram"]);
        expect(entries).not.toContain("home");
        expect(entries).toContain("usr");
        const lim = cgroupLimits(pid);
        expect(lim.pids).toMatch(/^\d+$/);
        expect(Number(lim.pids)).toBeLessThan(1000);
        expect(lim.memory).toMatch(/^\d+$/);
        expect(Number(lim.memory)).toBeLessThan(2 ** 40);
      }
      expect(uids[0]).not.toBe(uids[1]);

      // Exec, fork and suspend/resume, jailed.
      expect(await sh(a, "echo hi")).toBe("hi\n");
      await sh(a, "echo kept > /root/f");
      const [child] = await m.fork(a, 1);
      const c = child!.vmId;
      expect(await sh(c, "cat /root/f")).toBe("kept\n");
      const pc = await qemuPidOf(c);
      expect(uids).not.toContain(Number(status(pc).Uid?.split(/\s+/)[0]));
      expect(await sh(a, "cat /root/f")).toBe("kept\n");
      await m.suspend(b);
      expect(await qemuPidsUnder(vmDir(b))).toEqual([]);
      await m.resume(b);
      expect(await sh(b, "echo back")).toBe("back\n");
      const pb2 = await qemuPidOf(b);
      expect(status(pb2).Seccomp).toBe("2");

      const jails = await Promise.all(
        [a, b, c].map(async (id) => ({ id, uid: Number(status(await qemuPidOf(id)).Uid?.split(/\s+/)[0]) })),
      );
      for (const { id } of jails) await m.destroy(id, { force: true });
      for (const { id, uid } of jails) expect(jailLeftovers(id, uid)).toEqual([]);
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "a jail that cannot be built fails the create with a clear error and starts no QEMU",
    async () => {
      const running = await qemuPidsUnder(join(stateDir, "vms"));
      // The manager's template, spawned under the operator's jail settings set wrong.
      const template = (await listTemplates(stateDir)).find((t) => t.state === "ready");
      if (!template) throw new Error("no ready template");
      const jail = DEFAULT_VM_HOST.jail;
      for (const [bad, says] of [
        [{ ...jail, uidRange: { ...jail.uidRange, count: 0 } }, "uid range is empty"],
        [{ ...jail, unshare: "/nonexistent/unshare" }, "/nonexistent/unshare"],
      ] as const) {
        const r = await spawnFromTemplate({
          dataDir: stateDir,
          template,
          host: { ...DEFAULT_VM_HOST, jail: bad },
        });
        expect(r.ok).toBe(false);
        const text = r.ok ? "" : describeError(r.error);
        expect(text).toContain("jail");
        expect(text).toContain(says);
        expect(await qemuPidsUnder(join(stateDir, "vms"))).toEqual(running);
        expect(m.list().filter((s) => s.state === "running")).toEqual([]);
      }
    },
    VM_TEST_TIMEOUT_MS,
  );
});
