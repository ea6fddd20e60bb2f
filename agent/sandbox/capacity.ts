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
 * VM's guest RAM counts, plus what each standby QEMU (launched ahead of a VM's rollback) holds
 * while it waits (`STANDBY_HELD_BYTES`, agent/qemu/cgroup.ts). `memMib` is that budget; the VMs' common cgroup carries the same figure
 * (`limitVmMemory`), so a wrong per-VM figure still cannot reach past it.
 *
 * Disk counts what the VMs may still write (`DiskAccounting`): every running VM's qcow2 overlay
 * can grow to its disk's virtual size, so the VMs fit only while the free space of the
 * filesystem holding their disks, less the reserve, covers each running VM's room to grow (its
 * virtual size less what its overlay holds) plus each new VM's room (its disk's virtual size).
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
  /** MiB each standby QEMU (launched for a VM's next rollback) holds while it waits. */
  standbyMib: number;
  /** Standby QEMUs held now; asked on every check. */
  standbys: () => number;
}

/** Bytes free where the VMs' disks are and the room the running VMs' overlays still have. */
export interface DiskRoom {
  /** Bytes an unprivileged writer may still use on the filesystem holding the VMs' disks. */
  freeBytes: number;
  /** Free space kept back there for what must not fail when the disk is tight (SANDBOXD_DISK_RESERVE_BYTES). */
  reserveBytes: number;
  /** Sum over running VMs of their disk's virtual size less what their overlay holds. */
  growBytes: number;
}

/**
 * What disk admission counts (see the header). Not overcommitted: a guest that fills its disk
 * writes for as long as the host lets it, and a qcow2 overlay that meets ENOSPC stops its VM
 * with an I/O error (QEMU's `werror=enospc` default pauses it), so a promise the filesystem
 * cannot keep breaks a running sandbox, not a create that could have been refused.
 */
export interface DiskAccounting {
  /** Asked on every check (a statfs and a stat per running VM: microseconds for 64 VMs, no cache). */
  room: () => DiskRoom;
}

/** Guest RAM alone: for a caller that counts nothing else (a unit test's fixed host). */
export const GUEST_RAM_ONLY: MemoryAccounting = {
  overheadMib: 0,
  filesMib: () => 0,
  standbyMib: 0,
  standbys: () => 0,
};

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

/** Bytes as MiB for messages, rounded up (and the free figure down): a refusal never reads as fitting. */
function mibOf(bytes: number): number {
  return Math.ceil(bytes / 2 ** 20);
}

/** `held` plus `count` VMs of `size`. */
export function addHeld(held: HeldResources, size: VmSize, count = 1): HeldResources {
  return {
    count: held.count + count,
    vcpus: held.vcpus + size.vcpus * count,
    memMib: held.memMib + size.memMib * count,
  };
}

/** What the VMs of `h` hold on the host, in MiB, with the RAM files `filesMib` and the standby QEMUs. */
export function hostMemMib(h: HeldResources, mem: MemoryAccounting, filesMib = mem.filesMib()): number {
  return h.memMib + h.count * mem.overheadMib + mem.standbys() * mem.standbyMib + filesMib;
}

export class Capacity {
  /**
   * Disk room promised to VMs admitted but not yet running (their overlays are not in the
   * driver's `growBytes` until the spawn, fork or resume ends): without it, creates racing on a
   * nearly full disk would each see the same free space and all pass.
   */
  private pendingDiskBytes = 0;

  constructor(
    readonly limits: HostCapacity,
    /** What is held now; asked on every check, never cached. */
    private readonly held: () => HeldResources,
    readonly memory: MemoryAccounting = GUEST_RAM_ONLY,
    /** None: disk growth is not counted (a unit test's host, a driver with no disks). */
    readonly disk?: DiskAccounting,
  ) {}

  /**
   * Whether `count` more VMs of `size` fit the host now; `diskBytes` is the room each new VM's
   * overlay may grow into (0: a caller that does not know it, such as a pool's refill).
   */
  fits(size: VmSize, count: number, diskBytes = 0): boolean {
    const disk = this.diskOver(count, diskBytes);
    return this.within(addHeld(this.held(), size, count)) && disk === undefined;
  }

  /** Whether `diskBytes` more of room to grow fits the disk now (pending promises included). */
  diskFits(diskBytes: number): boolean {
    return this.diskOver(1, diskBytes) === undefined;
  }

  /**
   * Promises `bytes` of disk room until the returned release is called (once the VMs they are for
   * run, counted by the driver, or failed). Releasing twice releases once.
   */
  reserveDisk(bytes: number): () => void {
    this.pendingDiskBytes += bytes;
    let held = true;
    return () => {
      if (!held) return;
      held = false;
      this.pendingDiskBytes -= bytes;
    };
  }

  /**
   * Throws `at_capacity` unless `count` more VMs of `size` (each with `diskBytes` of room to grow
   * on disk) fit the host now; its message names each limit they would pass, with the figures.
   * Admitted, their disk room is reserved until the returned release is called (reserveDisk);
   * their memory is the caller's to hold (a record made with no await in between).
   */
  admit(size: VmSize, count: number, diskBytes = 0): () => void {
    const used = this.held();
    const files = this.memory.filesMib();
    const after = addHeld(used, size, count);
    const c = this.limits;
    const over: string[] = [];
    if (after.count > c.slots) over.push(`${after.count} VMs > ${c.slots} slots`);
    if (after.vcpus > c.vcpus) over.push(`${after.vcpus} vCPUs > ${c.vcpus}`);
    const mem = hostMemMib(after, this.memory, files);
    if (mem > c.memMib) over.push(`VM memory ${mem} MiB > ${c.memMib} MiB budget`);
    const disk = this.diskOver(count, diskBytes);
    if (disk)
      over.push(
        `VM disk growth ${mibOf(disk.growBytes)} MiB > ${Math.floor(disk.usableBytes / 2 ** 20)} MiB free`,
      );
    if (over.length === 0) return this.reserveDisk(count * diskBytes);
    throw new SandboxdError("at_capacity", `no capacity on this host: ${over.join(", ")}`, {
      details: {
        used: { ...used, hostMemMib: hostMemMib(used, this.memory, files) },
        capacity: c,
        ...(disk ? { disk } : {}),
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

  /**
   * The disk figures when the running VMs' room to grow plus `count` new VMs' `diskBytes` each
   * pass the free space less the reserve; undefined when they fit or disk is not counted.
   */
  private diskOver(count: number, diskBytes: number): { growBytes: number; usableBytes: number } | undefined {
    if (!this.disk) return undefined;
    const room = this.disk.room();
    const growBytes = room.growBytes + this.pendingDiskBytes + count * diskBytes;
    const usableBytes = Math.max(0, room.freeBytes - room.reserveBytes);
    return growBytes > usableBytes ? { growBytes, usableBytes } : undefined;
  }

  private within(h: HeldResources): boolean {
    const c = this.limits;
    return h.count <= c.slots && h.vcpus <= c.vcpus && hostMemMib(h, this.memory) <= c.memMib;
  }
}
