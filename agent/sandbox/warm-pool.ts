/**
 * Warm pools (docs/sandboxes.md "Rules of the sandboxes API" `expect` / `release`, bake `expected_width`): for a template whose next
 * burst the client announced, the agent keeps that many VMs already restored from the template
 * and paused, so a create only has to resume one (`cont` + clock, a few ms) instead of
 * restoring a snapshot. A create takes a pooled VM first and the pool refills in the background
 * to the announced width until `release` (or the template's deletion) drops it.
 *
 * Bounds: at most `MAX_WARM_PER_TEMPLATE` per template, and never beyond the host's capacity
 * (`fits`, capacity.ts, which counts pooled VMs like sandboxes); a create that
 * finds the host full evicts a pooled VM of another template first (`evictOne`). Pooled VMs
 * have no record: after an agent restart they are reaped like any unclaimed VM directory, and
 * the client announces its width again.
 */
import { describeError } from "../../contracts/errors.ts";
import { newVmId } from "../vm/ids.ts";
import { addHeld, type HeldResources } from "./capacity.ts";
import type { DriverVm, SandboxDriver, VmSize } from "./drivers/driver.ts";
import type { TemplateRegistry } from "./templates.ts";

/**
 * Per template. The API's fork cap is 64 children per call (Enterprise); a pool as wide as one
 * such call covers a rollout's first wave, and the host's capacity bounds it further.
 */
export const MAX_WARM_PER_TEMPLATE = 64;

interface Pool {
  want: number;
  vms: DriverVm[];
  /** Spawns in flight (counted against capacity like pooled VMs). */
  spawning: number;
  /** Settles when the spawn in flight ends (its VM pooled, or failed). */
  spawned?: Promise<void>;
  /** Creates waiting for a spawn in flight: each waits for one VM of its own. */
  waiting: number;
  size: VmSize;
  filling?: Promise<void>;
}

export interface WarmPoolDeps {
  driver: SandboxDriver;
  templates: TemplateRegistry;
  /**
   * One more VM of `size` of `templateId`, if it fits the host now (pooled VMs included, its disk
   * room too): the release of its disk room, promised until its spawn ends (then the driver counts
   * the running VM's); undefined when it does not fit.
   */
  admit(size: VmSize, templateId: string): (() => void) | undefined;
  sizeOf(templateId: string): VmSize;
  log: (msg: string) => void;
}

export class WarmPool {
  private readonly pools = new Map<string, Pool>();
  private closed = false;

  constructor(private readonly d: WarmPoolDeps) {}

  /** Keeps `width` warm VMs of the template (bounded); idempotent. Throws for unknown templates. */
  expect(templateId: string, width: number): void {
    this.d.templates.status(templateId); // not_found for a template this agent does not know
    const want = Math.max(0, Math.min(width, MAX_WARM_PER_TEMPLATE));
    let p = this.pools.get(templateId);
    if (!p) {
      p = { want, vms: [], spawning: 0, waiting: 0, size: this.d.sizeOf(templateId) };
      this.pools.set(templateId, p);
    }
    p.want = want;
    this.fill(templateId, p);
  }

  /** Drops the template's pool now (capacity relaxes at once, docs/sandboxes.md "Rules of the sandboxes API"); idempotent. */
  async release(templateId: string): Promise<void> {
    const p = this.pools.get(templateId);
    if (!p) return;
    this.pools.delete(templateId);
    p.want = 0;
    await Promise.all(p.vms.splice(0).map((vm) => this.drop(vm)));
  }

  /** A pooled VM of the template, resumed and ready to be a sandbox; undefined when none. */
  async take(templateId: string): Promise<DriverVm | undefined> {
    const p = this.pools.get(templateId);
    // None pooled yet but one being warmed (a bake just Live, a refill): that restore started
    // before this create and ends first, so the create waits for it instead of racing it with a
    // restore of its own. Once, and only for a VM no other waiting create has claimed: a burst
    // never queues behind the pool's one-at-a-time refill.
    if (p && p.vms.length === 0 && p.spawned && p.waiting < p.spawning) {
      p.waiting++;
      try {
        await p.spawned;
      } finally {
        p.waiting--;
      }
    }
    while (p && p.vms.length > 0) {
      const vm = p.vms.shift()!;
      this.fill(templateId, p);
      try {
        await this.d.driver.unpause(vm);
        return vm;
      } catch (err) {
        // It died while pooled (QEMU killed, host OOM): drop it and try the next.
        this.d.log(`warm VM ${vm.vmId} of ${templateId} is unusable: ${describeError(err)}`);
        await this.drop(vm);
      }
    }
    return undefined;
  }

  /** Frees one pooled VM of a template other than `except` to make room; false when none. */
  async evictOne(except: string): Promise<boolean> {
    for (const [id, p] of this.pools) {
      if (id === except || p.vms.length === 0) continue;
      const vm = p.vms.pop()!;
      await this.drop(vm);
      return true;
    }
    return false;
  }

  /** VMs held by pools (pooled and being spawned), for the host's capacity accounting. */
  used(): HeldResources {
    let held: HeldResources = { count: 0, vcpus: 0, memMib: 0 };
    for (const p of this.pools.values()) held = addHeld(held, p.size, p.vms.length + p.spawning);
    return held;
  }

  /** Pooled VMs per template (health, tests). */
  sizes(): Record<string, { want: number; warm: number }> {
    return Object.fromEntries([...this.pools].map(([id, p]) => [id, { want: p.want, warm: p.vms.length }]));
  }

  /** Stops filling and forgets the VMs without killing them (agent exit; a restart reaps them). */
  detach(): void {
    this.closed = true;
    this.pools.clear();
  }

  /** Destroys every pooled VM (manager shutdown). */
  async close(): Promise<void> {
    this.closed = true;
    const all = [...this.pools.values()].flatMap((p) => p.vms.splice(0));
    this.pools.clear();
    await Promise.all(all.map((vm) => this.drop(vm)));
  }

  private fill(templateId: string, p: Pool): void {
    if (p.filling) return;
    p.filling = (async () => {
      try {
        // A template still building: wait for its build, then fill (bake `expected_width`).
        await this.d.templates.settled(templateId);
        while (!this.closed && this.pools.get(templateId) === p && p.vms.length + p.spawning < p.want) {
          try {
            this.d.templates.ready(templateId);
          } catch {
            return; // failed or deleted: nothing to warm
          }
          const releaseDisk = this.d.admit(p.size, templateId);
          if (!releaseDisk) {
            this.d.log(`warm pool of ${templateId}: host full at ${p.vms.length} of ${p.want}`);
            return;
          }
          // One at a time: a refill never competes with the creates it is meant to speed up.
          p.spawning++;
          let spawned!: () => void;
          p.spawned = new Promise<void>((resolve) => {
            spawned = resolve;
          });
          let vm: DriverVm | undefined;
          try {
            vm = await this.d.driver.spawn(templateId, newVmId(), p.size);
            await this.d.driver.pause(vm);
          } catch (err) {
            this.d.log(`warm pool of ${templateId}: spawn failed: ${describeError(err)}`);
            if (vm) await this.drop(vm);
            return;
          } finally {
            releaseDisk();
            p.spawning--;
            // Pooled (below, before any waiter runs) or failed: a waiting create looks again.
            queueMicrotask(spawned);
          }
          if (this.closed || this.pools.get(templateId) !== p || p.vms.length >= p.want) {
            await this.drop(vm); // released (or shrunk) while it was being made
          } else {
            p.vms.push(vm);
          }
        }
      } finally {
        p.filling = undefined;
      }
    })();
  }

  private async drop(vm: DriverVm): Promise<void> {
    await this.d.driver
      .destroy(vm.vmId, vm)
      .catch((err) => this.d.log(`warm VM ${vm.vmId}: destroy failed: ${describeError(err)}`));
  }
}
