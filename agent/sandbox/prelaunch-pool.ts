/**
 * Pre-launched QEMUs: per template, `width` QEMUs already started in their jail and waiting for
 * the template's device state (`-incoming defer -S`, QMP and console drain connected, overlay
 * made, VM id, directory, uid and cgroup assigned; agent/snapshot/spawn.ts
 * `prelaunchFromTemplate`). A create takes one and only restores into it, which leaves the jail's
 * set-up (~40 ms under TCG: uid, cgroup, namespaces, pivot_root, QEMU's start) off its path; the
 * pool refills in the background, one launch at a time.
 *
 * Unlike the warm pool (warm-pool.ts), nothing of the template's guest runs yet: a VM taken from
 * here is restored, reseeded and named exactly as a cold spawn is, so it is indistinguishable
 * from one afterwards.
 *
 * Ownership: each id here is one VM of the driver (`SandboxDriver.prelaunch`), freed by
 * `driver.destroy(id)` like any VM: when the template is deleted (`drain`), when the agent stops
 * (`close`), when a create needs the room (`evictOne`). Nothing records them, so after a crash the
 * next agent's reap kills them as unclaimed VM directories. They count against the host's
 * capacity (`used`), pooled and launching alike, so a slot is never promised twice.
 */

import { settled } from "../../contracts/best-effort.ts";
import { describeError } from "../../contracts/errors.ts";
import { newVmId } from "../vm/ids.ts";
import { addHeld, type HeldResources } from "./capacity.ts";
import type { SandboxDriver, VmSize } from "./drivers/driver.ts";
import type { TemplateRegistry } from "./templates.ts";

/** Pre-launched QEMUs per template at most: each holds a slot of the host's capacity. */
export const MAX_PRELAUNCH_PER_TEMPLATE = 8;

interface Pool {
  ids: string[];
  /** Launches in flight (counted against capacity like pooled ones). */
  launching: number;
  size: VmSize;
  filling?: Promise<void>;
  /** The launch in flight: a drain waits for it (not for a build the fill may be waiting on). */
  launch?: Promise<void>;
}

export interface PrelaunchPoolDeps {
  driver: SandboxDriver;
  templates: TemplateRegistry;
  /** Pre-launched QEMUs wanted per template; 0 turns the pool off. */
  width: number;
  /** Whether one more VM of `size` fits the host now (this pool's included). */
  fits(size: VmSize): boolean;
  sizeOf(templateId: string): VmSize;
  log: (msg: string) => void;
}

export class PrelaunchPool {
  private readonly pools = new Map<string, Pool>();
  private readonly width: number;
  private closed = false;

  constructor(private readonly d: PrelaunchPoolDeps) {
    this.width = d.driver.prelaunch ? Math.max(0, Math.min(d.width, MAX_PRELAUNCH_PER_TEMPLATE)) : 0;
  }

  /** Fills the template's pool in the background once it is built (idempotent). */
  fill(templateId: string): void {
    if (this.width === 0 || this.closed) return;
    let p = this.pools.get(templateId);
    if (!p) {
      p = { ids: [], launching: 0, size: this.d.sizeOf(templateId) };
      this.pools.set(templateId, p);
    }
    this.run(templateId, p);
  }

  /**
   * The id of a QEMU pre-launched for the template at `size`, now the caller's (its capacity
   * moves with it: count it before the next await); undefined when none. `fill` refills.
   */
  take(templateId: string, size: VmSize): string | undefined {
    const p = this.pools.get(templateId);
    if (!p || p.size.vcpus !== size.vcpus || p.size.memMib !== size.memMib) return undefined;
    return p.ids.shift();
  }

  /** Frees one pre-launched QEMU of a template other than `except`; false when none. */
  async evictOne(except: string): Promise<boolean> {
    for (const [id, p] of this.pools) {
      if (id === except || p.ids.length === 0) continue;
      await this.drop(p.ids.pop()!);
      return true;
    }
    return false;
  }

  /** Stops the template's pool and frees its QEMUs, a launch in flight included (template deleted). */
  async drain(templateId: string): Promise<void> {
    const p = this.pools.get(templateId);
    if (!p) return;
    this.pools.delete(templateId);
    const inFlight = p.launch;
    if (inFlight) {
      // The loop drops what that launch made (its pool is gone) and stops: wait for both.
      await settled(inFlight);
      await p.filling;
    }
    await Promise.all(p.ids.splice(0).map((id) => this.drop(id)));
  }

  /** VMs held here (pooled and launching), for the host's capacity accounting. */
  used(): HeldResources {
    let held: HeldResources = { count: 0, vcpus: 0, memMib: 0 };
    for (const p of this.pools.values()) held = addHeld(held, p.size, p.ids.length + p.launching);
    return held;
  }

  /** Pre-launched QEMUs per template (tests, logs). */
  sizes(): Record<string, number> {
    return Object.fromEntries([...this.pools].map(([id, p]) => [id, p.ids.length]));
  }

  /** Stops filling and frees every pre-launched QEMU, launches in flight included (agent stop). */
  async close(): Promise<void> {
    this.closed = true;
    await Promise.all([...this.pools.keys()].map((id) => this.drain(id)));
  }

  private run(templateId: string, p: Pool): void {
    if (p.filling || this.closed) return;
    p.filling = (async () => {
      try {
        await this.d.templates.settled(templateId);
        while (!this.closed && this.pools.get(templateId) === p && p.ids.length + p.launching < this.width) {
          try {
            this.d.templates.ready(templateId);
          } catch {
            return; // failed or deleted: nothing to launch for
          }
          if (!this.d.fits(p.size)) return; // the host is full; the next take or create retries
          const id = newVmId();
          p.launching++;
          try {
            p.launch = this.d.driver.prelaunch!(templateId, id, p.size);
            await p.launch;
          } catch (err) {
            this.d.log(`pre-launch for ${templateId} failed: ${describeError(err)}`);
            await this.drop(id);
            return;
          } finally {
            p.launching--;
            p.launch = undefined;
          }
          if (this.closed || this.pools.get(templateId) !== p) await this.drop(id);
          else p.ids.push(id);
        }
      } finally {
        p.filling = undefined;
      }
    })();
  }

  private async drop(id: string): Promise<void> {
    await this.d.driver
      .destroy(id, undefined)
      .catch((err) => this.d.log(`pre-launched VM ${id}: destroy failed: ${describeError(err)}`));
  }
}
