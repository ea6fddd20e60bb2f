/**
 * KSM and a sandbox's QEMU (docs/isolation.md "KSM: guest RAM never, QEMU's own memory by
 * choice"), shown from the host's /proc/PID/smaps of REAL VMs under TCG (`VmFlags`: `mg` marks a
 * mapping KSM may merge). With SANDBOXD_KSM=qemu (the jail settings' `ksmQemu`) a template's child
 * and a fork's child offer QEMU's heap to KSM and never their guest RAM; with the default, no
 * mapping of the process is offered (QEMU runs with mem-merge=off). Whether the host runs KSM
 * (/sys/kernel/mm/ksm/run) is the host's: the marks are what the agent decides, and what KSM reads.
 * Needs Linux 6.4+ (PR_SET_MEMORY_MERGE), as the shim does.
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { readFileSync } from "node:fs";
import { rm } from "node:fs/promises";
import type { SandboxManager } from "../../agent/sandbox/manager.ts";
import { defaultShmRoot } from "../../agent/snapshot/template.ts";
import {
  managerWithBusybox,
  removeBusyboxArchive,
  TEST_CACHE_DIR,
  tempStateDir,
} from "../support/real-vm.ts";

/** Two template builds (one per setting), spawns and a fork under TCG on a 2-core host. */
const VM_TEST_TIMEOUT_MS = 300_000;
const MEM_MIB = 128;

const dirs: string[] = [];
const managers: SandboxManager[] = [];

async function manager(ksmQemu: boolean): Promise<SandboxManager> {
  const stateDir = await tempStateDir();
  dirs.push(stateDir);
  const m = await managerWithBusybox({
    stateDir,
    cacheDir: TEST_CACHE_DIR,
    memMib: MEM_MIB,
    jail: { ksmQemu },
  });
  managers.push(m);
  return m;
}

let withKsm: SandboxManager;
let withoutKsm: SandboxManager;

beforeAll(async () => {
  withKsm = await manager(true);
  withoutKsm = await manager(false);
}, VM_TEST_TIMEOUT_MS);

afterAll(async () => {
  try {
    for (const m of managers) {
      for (const s of m.list()) await m.destroy(s.id, { force: true });
      await m.deleteTemplate("bb");
    }
  } finally {
    for (const d of dirs) {
      await rm(d, { recursive: true, force: true });
      await rm(defaultShmRoot(d), { recursive: true, force: true });
    }
    await removeBusyboxArchive();
  }
});

interface Mapping {
  range: string;
  bytes: number;
  name: string;
  vmFlags: string[];
}

/** Every mapping of `pid` with its size, name and VmFlags, from /proc/PID/smaps. */
function mappings(pid: number): Mapping[] {
  const out: Mapping[] = [];
  for (const line of readFileSync(`/proc/${pid}/smaps`, "utf8").split("\n")) {
    const h = /^([0-9a-f]+)-([0-9a-f]+) \S{4} \S+ \S+ \d+\s*(.*)$/.exec(line);
    if (h) {
      const bytes = Number.parseInt(h[2] as string, 16) - Number.parseInt(h[1] as string, 16);
      out.push({ range: `${h[1]}-${h[2]}`, bytes, name: (h[3] as string).trim(), vmFlags: [] });
    } else if (line.startsWith("VmFlags:") && out.length > 0) {
      (out.at(-1) as Mapping).vmFlags = line.slice("VmFlags:".length).trim().split(/\s+/);
    }
  }
  return out;
}

/** What of QEMU `pid` is offered to KSM: its guest RAM (the file mapping of the guest's size), its heap, any. */
function offered(pid: number): { guestRam: boolean; heap: boolean; mappings: number; ramFile: string } {
  const all = mappings(pid);
  const ram = all.find((m) => m.bytes === MEM_MIB * 1024 * 1024 && m.name.startsWith("/"));
  if (!ram) throw new Error(`QEMU ${pid} maps no ${MEM_MIB} MiB file`);
  const heap = all.find((m) => m.name === "[heap]");
  return {
    guestRam: ram.vmFlags.includes("mg"),
    heap: heap?.vmFlags.includes("mg") ?? false,
    mappings: all.filter((m) => m.vmFlags.includes("mg")).length,
    ramFile: ram.name,
  };
}

test(
  "SANDBOXD_KSM=qemu: a child's and a fork child's QEMU offer their heap to KSM and never guest RAM; off: nothing",
  async () => {
    const parent = await withKsm.create("bb", { kind: "sandbox" });
    const [child] = await withKsm.fork(parent.vmId, 1);
    const plain = await withoutKsm.create("bb", { kind: "sandbox" });
    const seen = {
      parent: offered(withKsm.info(parent.vmId).qemuPid as number),
      forkChild: offered(withKsm.info(child!.vmId).qemuPid as number),
      off: offered(withoutKsm.info(plain.vmId).qemuPid as number),
    };
    console.log(`KSM_MARKS ${JSON.stringify(seen)}`);
    for (const v of [seen.parent, seen.forkChild]) {
      expect(v.guestRam).toBe(false);
      expect(v.heap).toBe(true);
    }
    // The fork's child maps the fork point's RAM file, not the template's.
    expect(seen.forkChild.ramFile).not.toBe(seen.parent.ramFile);
    expect(seen.off).toMatchObject({ guestRam: false, heap: false, mappings: 0 });
  },
  VM_TEST_TIMEOUT_MS,
);
