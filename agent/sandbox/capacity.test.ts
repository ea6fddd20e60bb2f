/** Host admission without VMs: the limits, the fit of one or many VMs, the refusal, what is free. */
import { describe, expect, test } from "bun:test";
import { SandboxdError } from "../../contracts/errors.ts";
import {
  addHeld,
  Capacity,
  type HeldResources,
  type HostCapacity,
  hostCapacity,
  hostMemMib,
} from "./capacity.ts";

const GiB = 2 ** 30;
const limits: HostCapacity = { slots: 4, vcpus: 8, memMib: 2048 };
const small = { vcpus: 1, memMib: 256 };

/** A Capacity whose held resources are whatever `held.now` is when asked. */
function ledger(c: HostCapacity = limits) {
  const held = { now: { count: 0, vcpus: 0, memMib: 0 } as HeldResources };
  return { held, cap: new Capacity(c, () => held.now) };
}

describe("hostCapacity", () => {
  test("defaults from the machine: 64 slots, 4 vCPUs per core, 75% of RAM for guests", () => {
    expect(hostCapacity(undefined, { cpus: 2, memBytes: 8 * GiB })).toEqual({
      slots: 64,
      vcpus: 8,
      memMib: 6144,
    });
    expect(hostCapacity({}, { cpus: 16, memBytes: 1 * GiB + 3 })).toEqual({
      slots: 64,
      vcpus: 64,
      memMib: 768,
    });
  });

  test("what the operator gives wins, limit by limit", () => {
    expect(hostCapacity({ slots: 2 }, { cpus: 2, memBytes: 8 * GiB })).toEqual({
      slots: 2,
      vcpus: 8,
      memMib: 6144,
    });
    expect(hostCapacity({ slots: 1, vcpus: 3, memMib: 100 }, { cpus: 2, memBytes: 8 * GiB })).toEqual({
      slots: 1,
      vcpus: 3,
      memMib: 100,
    });
  });

  test("without a host given, this machine's", () => {
    const c = hostCapacity(undefined);
    expect(c.slots).toBe(64);
    expect(c.vcpus).toBeGreaterThan(0);
    expect(c.memMib).toBeGreaterThan(0);
  });
});

describe("addHeld", () => {
  test("adds count VMs of a size; one by default", () => {
    const zero = { count: 0, vcpus: 0, memMib: 0 };
    expect(addHeld(zero, { vcpus: 2, memMib: 512 })).toEqual({ count: 1, vcpus: 2, memMib: 512 });
    expect(addHeld({ count: 1, vcpus: 1, memMib: 256 }, { vcpus: 2, memMib: 512 }, 3)).toEqual({
      count: 4,
      vcpus: 7,
      memMib: 1792,
    });
    expect(addHeld(zero, small, 0)).toEqual(zero);
  });
});

describe("Capacity.fits / admit", () => {
  test("an empty host takes what fits all three limits, exactly up to each", () => {
    const { cap } = ledger();
    expect(cap.fits(small, 4)).toBe(true); // 4 slots, 4 vCPUs, 1024 MiB
    expect(cap.fits({ vcpus: 2, memMib: 512 }, 4)).toBe(true); // all three at their limit
    expect(() => cap.admit({ vcpus: 2, memMib: 512 }, 4)).not.toThrow();
  });

  test("each limit refuses on its own", () => {
    const { cap } = ledger();
    expect(cap.fits(small, 5)).toBe(false); // slots
    expect(cap.fits({ vcpus: 3, memMib: 1 }, 3)).toBe(false); // vCPUs: 9 > 8
    expect(cap.fits({ vcpus: 1, memMib: 1025 }, 2)).toBe(false); // memory: 2050 > 2048
  });

  test("what is held counts, asked anew on every check", () => {
    const { held, cap } = ledger();
    held.now = { count: 3, vcpus: 7, memMib: 1792 };
    expect(cap.fits(small, 1)).toBe(true);
    expect(cap.fits(small, 2)).toBe(false);
    expect(cap.fits({ vcpus: 2, memMib: 1 }, 1)).toBe(false);
    held.now = { count: 0, vcpus: 0, memMib: 0 };
    expect(cap.fits(small, 2)).toBe(true);
  });

  test("a refusal is at_capacity with what is held, the limits and a retry hint", () => {
    const { held, cap } = ledger();
    held.now = { count: 4, vcpus: 4, memMib: 1024 };
    let err: unknown;
    try {
      cap.admit(small, 1);
    } catch (e) {
      err = e;
    }
    expect(err).toBeInstanceOf(SandboxdError);
    const e = err as SandboxdError;
    expect(e.code).toBe("at_capacity");
    expect(e.message).toBe("no capacity on this host: 5 VMs > 4 slots");
    expect(e.details).toEqual({
      used: { ...held.now, hostMemMib: 1024 },
      capacity: limits,
      retryAfterSeconds: 5,
    });
  });

  test("admit lets through exactly what fits says", () => {
    const { held, cap } = ledger();
    for (const h of [
      { count: 0, vcpus: 0, memMib: 0 },
      { count: 3, vcpus: 7, memMib: 1792 },
      { count: 3, vcpus: 8, memMib: 0 },
      { count: 0, vcpus: 0, memMib: 2000 },
    ]) {
      held.now = h;
      for (const n of [1, 2]) {
        const admitted = (() => {
          try {
            cap.admit(small, n);
            return true;
          } catch {
            return false;
          }
        })();
        expect(admitted).toBe(cap.fits(small, n));
      }
    }
  });
});

describe("memory counts what a VM makes the host hold", () => {
  // 2048 MiB budget; each VM holds 128 MiB beside its guest RAM; RAM files on tmpfs hold 512.
  const files = { mib: 512 };
  const standby = { count: 0 };
  const mem = { overheadMib: 128, filesMib: () => files.mib, standbyMib: 64, standbys: () => standby.count };

  test("guest RAM + overhead per VM + RAM files, each VM's own overhead", () => {
    const held = { count: 2, vcpus: 2, memMib: 512 };
    expect(hostMemMib(held, mem)).toBe(512 + 2 * 128 + 512);
    const cap = new Capacity(limits, () => held, mem);
    // 1280 held: one more 256 MiB VM (384) fits, two (768) pass 2048 by 0.
    expect(cap.fits(small, 2)).toBe(true);
    files.mib = 513;
    expect(cap.fits(small, 2)).toBe(false);
    expect(() => cap.admit(small, 2)).toThrow("VM memory 2049 MiB > 2048 MiB budget");
    expect(cap.free(small)).toMatchObject({ memMibFree: 767, slotsFree: 1 });
    files.mib = 512;
  });

  test("each standby QEMU (launched for a VM's next rollback) counts what it holds while it waits", () => {
    const held = { count: 2, vcpus: 2, memMib: 512 };
    const cap = new Capacity(limits, () => held, mem);
    expect(cap.fits(small, 2)).toBe(true);
    standby.count = 1;
    expect(hostMemMib(held, mem)).toBe(512 + 2 * 128 + 64 + 512);
    // 1344 held: two more 256 MiB VMs (768) pass 2048; one fits.
    expect(cap.fits(small, 2)).toBe(false);
    expect(cap.fits(small, 1)).toBe(true);
    expect(() => cap.admit(small, 2)).toThrow("VM memory 2112 MiB > 2048 MiB budget");
    expect(cap.free(small)).toMatchObject({ memMibFree: 704, slotsFree: 1 });
    standby.count = 0;
  });

  test("guest RAM alone fits where the whole VM does not", () => {
    const held = { count: 0, vcpus: 0, memMib: 0 };
    expect(new Capacity(limits, () => held).fits({ vcpus: 1, memMib: 1000 }, 2)).toBe(true);
    expect(
      new Capacity(limits, () => held, { ...mem, filesMib: () => 0 }).fits({ vcpus: 1, memMib: 1000 }, 2),
    ).toBe(false);
  });
});

describe("Capacity.free", () => {
  test("an empty host: slots free is bounded by each limit in units of the default size", () => {
    expect(ledger().cap.free(small)).toEqual({ slotsFree: 4, slotsTotal: 4, vcpusFree: 8, memMibFree: 2048 });
    expect(ledger().cap.free({ vcpus: 4, memMib: 256 })).toMatchObject({ slotsFree: 2 }); // vCPUs bind
    expect(ledger().cap.free({ vcpus: 1, memMib: 1000 })).toMatchObject({ slotsFree: 2 }); // memory binds
  });

  test("what is held is subtracted", () => {
    const { held, cap } = ledger();
    held.now = { count: 1, vcpus: 1, memMib: 256 };
    expect(cap.free(small)).toEqual({ slotsFree: 3, slotsTotal: 4, vcpusFree: 7, memMibFree: 1792 });
  });

  test("never below zero, even when more is held than the limits (limits lowered at a restart)", () => {
    const { held, cap } = ledger();
    held.now = { count: 6, vcpus: 10, memMib: 4096 };
    expect(cap.free(small)).toEqual({ slotsFree: 0, slotsTotal: 4, vcpusFree: 0, memMibFree: 0 });
  });
});

describe("Capacity with disk accounting", () => {
  const MiB = 2 ** 20;
  /** A Capacity whose disk room is whatever `room.now` is when asked. */
  function diskLedger() {
    const room = { now: { freeBytes: 1000 * MiB, reserveBytes: 100 * MiB, growBytes: 300 * MiB } };
    const held: HeldResources = { count: 0, vcpus: 0, memMib: 0 };
    const cap = new Capacity(limits, () => held, undefined, { room: () => room.now });
    return { room, cap };
  }

  test("new VMs fit while the running VMs' room plus theirs is covered by free space less the reserve", () => {
    const { cap } = diskLedger();
    // 300 MiB held room + 600 MiB new = 900 MiB = 1000 free - 100 reserve: exactly fits.
    expect(cap.fits(small, 1, 600 * MiB)).toBe(true);
    expect(() => cap.admit(small, 1, 600 * MiB)).not.toThrow();
    expect(cap.fits(small, 1, 600 * MiB + 1)).toBe(false);
  });

  test("a refusal is at_capacity and names the disk figures", () => {
    const { cap } = diskLedger();
    const err = (() => {
      try {
        cap.admit(small, 1, 700 * MiB);
      } catch (e) {
        return e;
      }
    })();
    expect(err).toBeInstanceOf(SandboxdError);
    expect((err as SandboxdError).code).toBe("at_capacity");
    expect((err as SandboxdError).message).toContain("VM disk growth 1000 MiB > 900 MiB free");
    expect((err as SandboxdError).message).not.toContain("VM memory");
  });

  test("a fork counts each child's room", () => {
    const { cap } = diskLedger();
    // 3 children of 200 MiB: 300 + 600 = 900 fits; a fourth passes the free space.
    expect(cap.fits(small, 3, 200 * MiB)).toBe(true);
    expect(() => cap.admit(small, 4, 200 * MiB)).toThrow("VM disk growth 1100 MiB > 900 MiB free");
  });

  test("the room is asked on every check: a running VM's growth and freed space count at once", () => {
    const { room, cap } = diskLedger();
    expect(cap.fits(small, 1, 500 * MiB)).toBe(true);
    room.now = { ...room.now, growBytes: 500 * MiB };
    expect(cap.fits(small, 1, 500 * MiB)).toBe(false);
    room.now = { ...room.now, freeBytes: 2000 * MiB };
    expect(cap.fits(small, 1, 500 * MiB)).toBe(true);
  });

  test("free space below the reserve refuses any VM with a disk; a caller that names none is not refused for disk", () => {
    const { room, cap } = diskLedger();
    room.now = { freeBytes: 50 * MiB, reserveBytes: 100 * MiB, growBytes: 0 };
    expect(() => cap.admit(small, 1, 1)).toThrow("VM disk growth 1 MiB > 0 MiB free");
    expect(cap.fits(small, 1)).toBe(true);
  });

  test("racing admissions: the room promised to one not yet running is not promised again; its release frees it", () => {
    const { cap } = diskLedger();
    // 600 MiB of the 600 free beyond the running VMs' 300: one admission takes all of it.
    const release = cap.admit(small, 1, 600 * MiB);
    // The driver does not count the first VM until it runs: the promise does.
    expect(cap.diskFits(1)).toBe(false);
    expect(() => cap.admit(small, 1, 600 * MiB)).toThrow("VM disk growth 1500 MiB > 900 MiB free");
    release();
    release(); // a second release gives back nothing more
    expect(cap.diskFits(600 * MiB)).toBe(true);
    expect(cap.diskFits(600 * MiB + 1)).toBe(false);
    const held = cap.reserveDisk(100 * MiB);
    expect(cap.diskFits(500 * MiB + 1)).toBe(false);
    held();
    expect(cap.diskFits(600 * MiB)).toBe(true);
  });
});
