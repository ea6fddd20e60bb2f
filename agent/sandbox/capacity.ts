/**
 * Admission on one host: how many VMs, vCPUs and MiB of guest RAM it may hand out, whether
 * `count` more VMs of a size fit what is held now, and what is left for the gateway's placement.
 * The manager asks before a create, a fork and a resume (`at_capacity`, 503 with a retry hint,
 * when they do not fit), the warm pool before each pre-spawn. What is held is counted by the
 * holder (`held`): sandboxes whose state holds a VM, plus pooled VMs. The three limits are
 * checked together: a VM that fits two of them does not fit.
 *
 * Memory counts what the VMs can make the host hold, not guest RAM alone: each VM's guest RAM
 * plus its QEMU's overhead and TCG translation cache (`vmMemoryBytes`, agent/qemu/cgroup.ts, the
 * exact limit of the VM's cgroup), plus the RAM files on tmpfs (templates', forks'), which no
 * VM's guest RAM counts. `memMib` is that budget; the VMs' common cgroup carries the same figure
 * (`limitVmMemory`), so a wrong per-VM figure still cannot reach past it.
 */
import { cpus, totalmem } from "node:os";
import type { AgentCapacity } from "../../contracts/agent/api.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import type { VmSize } from "./drivers/driver.ts";

/** What memory admission counts beside guest RAM (see the header). */
export interface MemoryAccounting {
  /** MiB each VM holds beside its guest RAM (QEMU's overhead and translation cache). */
  overheadMib: number;
  /** MiB the RAM files on tmpfs hold now; asked on every check. */
  filesMib: () => number;
}

/** Guest RAM alone: for a caller that counts nothing else (a unit test's fixed host). */
export const GUEST_RAM_ONLY: MemoryAccounting = { overheadMib: 0, filesMib: () => 0 };

export interface HostCapacity {
  slots: number;
  vcpus: number;
  memMib: number;
}

/** VMs held now and what they hold. */
export interface HeldResources {
  count: number;
  vcpus: number;
  memMib: number;
}

/** How long a caller refused `at_capacity` should wait: VMs come and go within seconds. */
const RETRY_AFTER_SECONDS = 5;

/** The limits of this host: what `given` says, else defaults sized from the machine. */
export function hostCapacity(
  given: Partial<HostCapacity> | undefined,
  host: { cpus: number; memBytes: number } = { cpus: cpus().length, memBytes: totalmem() },
): HostCapacity {
  return {
    // 64 VMs: a bound on QEMU processes and sockets per host, not on memory.
    slots: given?.slots ?? 64,
    // vCPUs are overcommitted 4x: idle sandboxes are paused and use no CPU (docs/idle-lifetimes.md "Idle pause of the VM after 2 s").
    vcpus: given?.vcpus ?? host.cpus * 4,
    // VM memory (guest RAM, QEMU, translation cache, RAM files) is not overcommitted: 75% of
    // host memory; the rest is the agent's, the gateway's and the host's page cache.
    memMib: given?.memMib ?? Math.floor((host.memBytes / 2 ** 20) * 0.75),
  };
}

/** `held` plus `count` VMs of `size`. */
export function addHeld(held: HeldResources, size: VmSize, count = 1): HeldResources {
  return {
    count: held.count + count,
    vcpus: held.vcpus + size.vcpus * count,
    memMib: held.memMib + size.memMib * count,
  };
}

/** What the VMs of `h` hold on the host, in MiB, with the RAM files `filesMib`. */
export function hostMemMib(h: HeldResources, mem: MemoryAccounting, filesMib = mem.filesMib()): number {
  return h.memMib + h.count * mem.overheadMib + filesMib;
}

export class Capacity {
  constructor(
    readonly limits: HostCapacity,
    /** What is held now; asked on every check, never cached. */
    private readonly held: () => HeldResources,
    readonly memory: MemoryAccounting = GUEST_RAM_ONLY,
  ) {}

  /** Whether `count` more VMs of `size` fit the host now. */
  fits(size: VmSize, count: number): boolean {
    return this.within(addHeld(this.held(), size, count));
  }

  /**
   * Throws `at_capacity` unless `count` more VMs of `size` fit the host now; its message names
   * each limit they would pass, with the figures.
   */
  admit(size: VmSize, count: number): void {
    const used = this.held();
    const files = this.memory.filesMib();
    const after = addHeld(used, size, count);
    const c = this.limits;
    const over: string[] = [];
    if (after.count > c.slots) over.push(`${after.count} VMs > ${c.slots} slots`);
    if (after.vcpus > c.vcpus) over.push(`${after.vcpus} vCPUs > ${c.vcpus}`);
    const mem = hostMemMib(after, this.memory, files);
    if (mem > c.memMib) over.push(`VM memory ${mem} MiB > ${c.memMib} MiB budget`);
    if (over.length === 0) return;
    throw new SandboxdError("at_capacity", `no capacity on this host: ${over.join(", ")}`, {
      details: {
        used: { ...used, hostMemMib: hostMemMib(used, this.memory, files) },
        capacity: c,
        retryAfterSeconds: RETRY_AFTER_SECONDS,
      },
    });
  }

  /** What is free now; `slotsFree` counts VMs of `unit` size that still fit all three limits. */
  free(unit: VmSize): AgentCapacity {
    const used = this.held();
    const c = this.limits;
    const vcpusFree = Math.max(0, c.vcpus - used.vcpus);
    const memMibFree = Math.max(0, c.memMib - hostMemMib(used, this.memory));
    const slotsFree = Math.max(
      0,
      Math.min(
        c.slots - used.count,
        Math.floor(vcpusFree / unit.vcpus),
        Math.floor(memMibFree / (unit.memMib + this.memory.overheadMib)),
      ),
    );
    return { slotsFree, slotsTotal: c.slots, vcpusFree, memMibFree };
  }

  private within(h: HeldResources): boolean {
    const c = this.limits;
    return h.count <= c.slots && h.vcpus <= c.vcpus && hostMemMib(h, this.memory) <= c.memMib;
  }
}
