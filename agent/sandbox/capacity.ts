/**
 * Admission on one host: how many VMs, vCPUs and MiB of guest RAM it may hand out, whether
 * `count` more VMs of a size fit what is held now, and what is left for the gateway's placement.
 * The manager asks before a create, a fork and a resume (`at_capacity`, 503 with a retry hint,
 * when they do not fit), the warm pool before each pre-spawn. What is held is counted by the
 * holder (`held`): sandboxes whose state holds a VM, plus pooled VMs. The three limits are
 * checked together: a VM that fits two of them does not fit.
 */
import { cpus, totalmem } from "node:os";
import type { AgentCapacity } from "../../contracts/agent/api.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import type { VmSize } from "./drivers/driver.ts";

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
    // Guest RAM is not overcommitted: 75% of host memory, the rest for QEMU, page cache, agent.
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

export class Capacity {
  constructor(
    readonly limits: HostCapacity,
    /** What is held now; asked on every check, never cached. */
    private readonly held: () => HeldResources,
  ) {}

  /** Whether `count` more VMs of `size` fit the host now. */
  fits(size: VmSize, count: number): boolean {
    return within(addHeld(this.held(), size, count), this.limits);
  }

  /** Throws `at_capacity` unless `count` more VMs of `size` fit the host now. */
  admit(size: VmSize, count: number): void {
    const used = this.held();
    if (within(addHeld(used, size, count), this.limits)) return;
    throw new SandboxdError("at_capacity", "no capacity on this host", {
      details: { used, capacity: this.limits, retryAfterSeconds: RETRY_AFTER_SECONDS },
    });
  }

  /** What is free now; `slotsFree` counts VMs of `unit` size that still fit all three limits. */
  free(unit: VmSize): AgentCapacity {
    const used = this.held();
    const c = this.limits;
    const vcpusFree = Math.max(0, c.vcpus - used.vcpus);
    const memMibFree = Math.max(0, c.memMib - used.memMib);
    const slotsFree = Math.max(
      0,
      Math.min(
        c.slots - used.count,
        Math.floor(vcpusFree / unit.vcpus),
        Math.floor(memMibFree / unit.memMib),
      ),
    );
    return { slotsFree, slotsTotal: c.slots, vcpusFree, memMibFree };
  }
}

function within(h: HeldResources, c: HostCapacity): boolean {
  return h.count <= c.slots && h.vcpus <= c.vcpus && h.memMib <= c.memMib;
}
