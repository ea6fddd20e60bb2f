/**
 * A host full of hostile guests: REAL VMs under TCG through SandboxManager + SnapshotDriver, with
 * the host's VM memory budget (`SANDBOXD_VM_MEMORY_BYTES`) set small enough for two VMs of
 * 128 MiB and the template's RAM file, and the VMs' common cgroup limited to the same budget
 * (as `sandboxd agent` does at start). One well-behaved sandbox and one hostile one that dirties
 * all its guest RAM; then:
 * - a third create is refused `at_capacity`, its message naming the VM memory figures;
 * - the agent (this process, oom_score_adj -900) is alive and answering, each QEMU is the OOM
 *   killer's preferred victim (+500), both read from the host's /proc;
 * - the well-behaved sandbox still runs commands;
 * - any OOM kill the kernel made on the host happened inside the VMs' cgroups.
 * It prints each QEMU's own PSS (all of it less its guest RAM mapping) and what each VM's cgroup
 * held at most (`HOST_MEMORY {...}`): the figures `QEMU_OVERHEAD_BYTES` (agent/qemu/cgroup.ts)
 * is measured with.
 *
 * Needs root (cgroups, jails); skipped otherwise.
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { mkdirSync, readFileSync, rmdirSync, writeFileSync } from "node:fs";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import {
  CGROUP_ROOT,
  cgroupVersion,
  limitVmMemory,
  ownV1Path,
  vmMemoryBytes,
} from "../../agent/qemu/cgroup.ts";
import { AGENT_OOM_SCORE_ADJ, protectAgentFromOom, QEMU_OOM_SCORE_ADJ } from "../../agent/qemu/oom.ts";
import type { SandboxManager } from "../../agent/sandbox/manager.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { managerWithBusybox, qemuPidsUnder, removeBusyboxArchive, shellIn } from "../support/real-vm.ts";

const MIB = 1024 * 1024;
const MEM_MIB = 128;
/** Per VM under TCG: guest RAM + QEMU's overhead + translation cache, as admission counts it. */
const VM_MIB = vmMemoryBytes(MEM_MIB, true) / MIB;
/** Two VMs and the template's RAM file (at most its guest RAM), with 64 MiB to spare: not three. */
const BUDGET_MIB = 2 * VM_MIB + MEM_MIB + 64;
const VM_TEST_TIMEOUT_MS = 300_000;

/**
 * Dirties all the RAM the guest has free, less 16 MiB: the guest's /dev/shm grown to all of RAM
 * and filled with zeros. Past that the guest's own OOM killer takes its init and the VM ends,
 * which is the guest's loss alone but no longer a full host.
 */
const HOSTILE =
  "avail=$(awk '/MemAvailable/ {print int($2 / 1024)}' /proc/meminfo); mount -o remount,size=100% /dev/shm; dd if=/dev/zero of=/dev/shm/fill bs=1M count=$((avail - 16)) 2>/dev/null; sync";

const enabled = process.getuid?.() === 0 && cgroupVersion() === 1;
let root: string;
let stateDir: string;
let m: SandboxManager;
let parent: string;
let agentAdj: { adj: number; refused?: string };

/** Whether this process may lower its oom_score_adj (CAP_SYS_RESOURCE, bit 24 of CapEff). */
function hasSysResource(): boolean {
  const hex = /CapEff:\s*([0-9a-f]+)/.exec(readFileSync("/proc/self/status", "utf8"))?.[1] ?? "0";
  return (BigInt(`0x${hex}`) & (1n << 24n)) !== 0n;
}
const oomKillsBefore = hostOomKills();

/** The kernel's count of OOM kills on the whole host since boot. */
function hostOomKills(): number {
  const line = readFileSync("/proc/vmstat", "utf8")
    .split("\n")
    .find((l) => l.startsWith("oom_kill "));
  return Number(line?.split(" ")[1] ?? 0);
}

/** A v1 memory cgroup's `memory.oom_control` field `oom_kill` (kills inside it). */
function oomKillsIn(dir: string): number {
  const m = /oom_kill (\d+)/.exec(readFileSync(join(dir, "memory.oom_control"), "utf8"));
  return Number(m?.[1] ?? 0);
}

/** The QEMU of sandbox `vmId`, from the host's /proc (its `-name` carries the VM directory's name). */
async function qemuOf(vmId: string): Promise<number> {
  for (const pid of await qemuPidsUnder(stateDir)) {
    if (
      readFileSync(`/proc/${pid}/cmdline`, "utf8")
        .split("\0")
        .some((a) => a.includes(vmId))
    )
      return pid;
  }
  throw new Error(`no QEMU for ${vmId}`);
}

/** The host path of `pid`'s v1 memory cgroup, from /proc/<pid>/cgroup. */
function memoryCgroupOf(pid: number): string {
  const line = readFileSync(`/proc/${pid}/cgroup`, "utf8")
    .split("\n")
    .find((l) => l.split(":")[1]?.split(",").includes("memory"));
  return join(CGROUP_ROOT, "memory", line?.split(":")[2] ?? "/");
}

/**
 * MiB of PSS `pid` holds beside guest RAM: its whole PSS less the mapping of its RAM file (a
 * template child maps the template's `.mem` file privately: its guest pages, shared or copied).
 */
function qemuOwnMib(pid: number): number {
  let total = 0;
  let guest = 0;
  let inGuest = false;
  for (const l of readFileSync(`/proc/${pid}/smaps`, "utf8").split("\n")) {
    if (/^[0-9a-f]+-[0-9a-f]+ /.test(l)) inGuest = l.trimEnd().endsWith(".mem");
    else if (l.startsWith("Pss:")) {
      const kb = Number(l.split(/\s+/)[1]);
      total += kb;
      if (inGuest) guest += kb;
    }
  }
  return Math.round((total - guest) / 1024);
}

const readNum = (dir: string, file: string) => Number(readFileSync(join(dir, file), "utf8").trim());

/**
 * Moves this process into a memory cgroup of its own (v1), as an operator runs each agent in its
 * own: the VMs' common parent is made under the agent's own memory cgroup (`<own>/sandboxd`), so
 * the small budget this test sets holds only its VMs, never those of test files running beside
 * it in the same CI cgroup. On v2 the parent is `/sys/fs/cgroup/sandboxd` for every agent and the
 * test shares it. Answers how to move back.
 */
function ownMemoryCgroup(): { dir: string; back: string } | undefined {
  if (cgroupVersion(CGROUP_ROOT) !== 1) return undefined;
  const back = join(CGROUP_ROOT, "memory", ownV1Path("memory", readFileSync("/proc/self/cgroup", "utf8")));
  const dir = join(back, `host-memory-test-${process.pid}`);
  mkdirSync(dir, { recursive: true });
  writeFileSync(join(dir, "cgroup.procs"), String(process.pid));
  return { dir, back };
}
let ownCgroup: { dir: string; back: string } | undefined;

beforeAll(async () => {
  if (!enabled) return;
  root = await mkdtemp(join(tmpdir(), "sbx-mem-"));
  stateDir = join(root, "state");
  // As `sandboxd agent` does before its manager opens (cli/serve.ts openAgentManager).
  ownCgroup = ownMemoryCgroup();
  agentAdj = await protectAgentFromOom();
  if (hasSysResource()) expect(agentAdj).toEqual({ adj: AGENT_OOM_SCORE_ADJ });
  parent = await limitVmMemory(BUDGET_MIB * MIB);
  // The parent outlives each test: its high-water mark starts from this test's VMs.
  writeFileSync(join(parent, "memory.max_usage_in_bytes"), "0");
  m = await managerWithBusybox({
    stateDir,
    cacheDir: join(root, "cache"),
    memMib: MEM_MIB,
    capacity: { memMib: BUDGET_MIB },
  });
}, VM_TEST_TIMEOUT_MS);

afterAll(async () => {
  if (!enabled) return;
  try {
    if (m) {
      for (const s of m.list()) await m.destroy(s.id, { force: true });
      await m.deleteTemplate("bb").catch(() => {}); // the test's outcome is already decided
      expect(await qemuPidsUnder(stateDir)).toEqual([]);
    }
  } finally {
    // The next test on this host gets the unlimited parent it had.
    await limitVmMemory(undefined);
    if (ownCgroup) {
      writeFileSync(join(ownCgroup.back, "cgroup.procs"), String(process.pid));
      // Empty once the VMs' cgroups are gone (their QEMUs have exited): removed, parent first.
      for (const d of [join(ownCgroup.dir, "sandboxd"), ownCgroup.dir]) {
        try {
          rmdirSync(d);
        } catch (err) {
          console.log(`host-memory test: ${d} left: ${(err as Error).message}`);
        }
      }
    }
    await rm(root, { recursive: true, force: true });
    await removeBusyboxArchive();
  }
});

test.skipIf(!enabled)(
  "a host full of hostile guests refuses the next VM, keeps its agent and its other tenants",
  async () => {
    const calm = (await m.create("bb", { kind: "sandbox" })).vmId;
    const hostile = (await m.create("bb", { kind: "sandbox" })).vmId;
    expect((await shellIn(m, calm, "echo calm")).trim()).toBe("calm");
    await shellIn(m, hostile, HOSTILE);
    const dirtied = Number(await shellIn(m, hostile, "du -m /dev/shm/fill | cut -f1"));
    expect(dirtied).toBeGreaterThan(MEM_MIB / 4);

    // Admission: the third VM would pass the budget.
    const refused = await m.create("bb", { kind: "sandbox" }).catch((e: unknown) => e);
    expect(refused).toBeInstanceOf(SandboxdError);
    expect((refused as SandboxdError).code).toBe("at_capacity");
    expect((refused as SandboxdError).message).toContain(`MiB > ${BUDGET_MIB} MiB budget`);

    // Each VM's cgroup is exactly what admission counted for it, inside the parent's budget.
    const calmPid = await qemuOf(calm);
    const hostilePid = await qemuOf(hostile);
    const calmCg = memoryCgroupOf(calmPid);
    const hostileCg = memoryCgroupOf(hostilePid);
    for (const cg of [calmCg, hostileCg]) {
      expect(cg.startsWith(`${parent}/`)).toBe(true);
      expect(readNum(cg, "memory.limit_in_bytes")).toBe(VM_MIB * MIB);
    }
    expect(readNum(parent, "memory.limit_in_bytes")).toBe(BUDGET_MIB * MIB);

    // OOM preference, from the host's /proc.
    // Without CAP_SYS_RESOURCE (a container's root) the agent keeps its own; the QEMUs still rank first.
    const agentNow = Number(readFileSync(`/proc/${process.pid}/oom_score_adj`, "utf8"));
    expect(agentNow).toBe(hasSysResource() ? AGENT_OOM_SCORE_ADJ : agentAdj.adj);
    expect(agentNow).toBeLessThan(QEMU_OOM_SCORE_ADJ);
    for (const pid of [calmPid, hostilePid])
      expect(Number(readFileSync(`/proc/${pid}/oom_score_adj`, "utf8"))).toBe(QEMU_OOM_SCORE_ADJ);

    // The agent answers and the well-behaved tenant runs on.
    expect(m.capacityNow().slotsFree).toBe(0);
    expect((await shellIn(m, calm, "echo still-here")).trim()).toBe("still-here");
    expect(m.info(calm).state).toBe("running");
    expect(m.info(hostile).state).not.toBe("failed");

    // Any OOM kill on the host since the test began was inside the VMs' cgroups.
    const hostKills = hostOomKills() - oomKillsBefore;
    const vmKills = oomKillsIn(calmCg) + oomKillsIn(hostileCg) + oomKillsIn(parent);
    expect(hostKills).toBeLessThanOrEqual(vmKills);

    const maxMib = (cg: string) => Math.round(readNum(cg, "memory.max_usage_in_bytes") / MIB);
    console.log(
      `HOST_MEMORY ${JSON.stringify({
        vm_mib_admitted: VM_MIB,
        agent_oom_score_adj: agentNow,
        budget_mib: BUDGET_MIB,
        ram_files_mib: Math.round((m.capacity.memory.filesMib() * MIB) / MIB),
        calm_qemu_own_pss_mib: qemuOwnMib(calmPid),
        hostile_qemu_own_pss_mib: qemuOwnMib(hostilePid),
        // A cgroup's usage leaves out the template's pages a child still shares (charged where
        // the template's QEMU wrote them): the PSS figures above are QEMU's own.
        calm_cgroup_max_usage_mib: maxMib(calmCg),
        hostile_cgroup_max_usage_mib: maxMib(hostileCg),
        hostile_dirtied_mib: dirtied,
        hostile_failcnt: readNum(hostileCg, "memory.failcnt"),
        parent_max_usage_mib: Math.round(readNum(parent, "memory.max_usage_in_bytes") / MIB),
        parent_failcnt: readNum(parent, "memory.failcnt"),
        host_oom_kills: hostKills,
        vm_cgroup_oom_kills: vmKills,
      })}`,
    );
  },
  VM_TEST_TIMEOUT_MS,
);
