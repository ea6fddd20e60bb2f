/**
 * Fork, suspend and resume carried out (manager.ts keeps the sandbox table and calls these): the
 * operations that hand a sandbox's VM to the driver's snapshot engine and take the result back,
 * with their children's records, capacity and rollback.
 */
import type { CreatedVm, ResumeResult, SuspendResult } from "../../contracts/agent/api.ts";
import { bestEffort } from "../../contracts/best-effort.ts";
import type { SandboxdError } from "../../contracts/errors.ts";
import { newVmId } from "../vm/ids.ts";
import type { Capacity } from "./capacity.ts";
import type { DriverVm, SandboxDriver } from "./drivers/driver.ts";
import type { NewSandbox, Sandbox } from "./manager-types.ts";
import type { AgentSandboxState } from "./states.ts";

/** What fork, suspend and resume need of the manager: its driver, capacity, records and state path. */
export interface ForkSuspendHost {
  driver: SandboxDriver;
  capacity: Capacity;
  records: { flush(): Promise<void>; remove(id: string): Promise<void> };
  log: (msg: string) => void;
  setState(sb: Sandbox, to: AgentSandboxState): void;
  /** A new sandbox in the manager's table. */
  newSandbox(o: NewSandbox): Sandbox;
  /** Takes a sandbox out of the manager's table. */
  forget(id: string): void;
  persist(sb: Sandbox): Promise<void>;
  watchVm(sb: Sandbox, vm: DriverVm): void;
  refreshDisk(sb: Sandbox): Promise<void>;
  goneError(sb: Sandbox): SandboxdError;
  closeTunnels(sb: Sandbox, why: string): void;
  /** Restarts idle-paused vCPUs. */
  wake(sb: Sandbox): Promise<void>;
}

export async function forkSandbox(h: ForkSuspendHost, sb: Sandbox, count: number): Promise<CreatedVm[]> {
  h.setState(sb, "forking");
  const t0 = performance.now();
  const children: Sandbox[] = [];
  // The children's disk room, promised until they run (counted by the driver) or fail.
  let releaseDisk = () => {};
  try {
    // The children are held (state `creating`) from the admission on, with no await between:
    // a create or fork racing this one sees them counted and cannot be promised the same room.
    // Each child's overlay may grow to the disk's virtual size, the template's.
    releaseDisk = h.capacity.admit(sb.size, count, h.driver.newDiskBytes?.(sb.templateId) ?? 0);
    const now = Date.now();
    for (let i = 0; i < count; i++) {
      const childId = newVmId();
      const endpoints = Object.fromEntries(Object.keys(sb.endpoints).map((p) => [p, `${childId}:${p}`]));
      const child = h.newSandbox({
        id: childId,
        templateId: sb.templateId,
        kind: sb.kind,
        state: "creating",
        size: sb.size,
        endpoints,
        // Children keep the parent's egress: a fork must not widen what its parent could reach.
        egress: sb.egress,
        now,
      });
      children.push(child);
    }
    for (const child of children) await h.persist(child);
    await h.wake(sb);
    const op = h.driver.fork(
      sb.vm!,
      children.map((c) => c.id),
    );
    sb.op = op;
    const vms = await op.finally(releaseDisk);
    const forkMs = performance.now() - t0;
    for (const [i, child] of children.entries()) {
      child.vm = vms[i]!;
      h.watchVm(child, child.vm);
      h.setState(child, "running");
    }
    await Promise.all(children.map((c) => h.refreshDisk(c)));
    const created = children.map((child) => ({
      vmId: child.id,
      forkTimeMs: forkMs,
      createTimeMs: performance.now() - t0,
      endpoints: child.endpoints,
      resources: { ...child.size, diskBytes: child.meter.resources.diskBytes },
    }));
    await h.records.flush(); // the children's records are on disk before they are announced
    return created;
  } catch (err) {
    for (const c of children) {
      h.forget(c.id);
      c.meter.enter("destroyed", Date.now());
      await bestEffort(
        h.log,
        `destroying fork child ${c.id} after the fork failed`,
        h.driver.destroy(c.id, c.vm),
      );
      await h.records.remove(c.id);
    }
    throw err;
  } finally {
    releaseDisk();
    sb.op = undefined;
    if (sb.state === "forking") h.setState(sb, "running");
  }
}

export async function suspendSandbox(h: ForkSuspendHost, sb: Sandbox): Promise<SuspendResult> {
  h.setState(sb, "suspending");
  h.closeTunnels(sb, "is being suspended"); // its QEMU ends: no connection survives
  try {
    await h.wake(sb);
    // Background processes do not survive a suspend: the restored VM's guest channel is new.
    await sb.procs?.killAll();
    const op = h.driver.suspend(sb.vm!);
    sb.op = op;
    const r = await op;
    sb.vm = undefined;
    sb.memBytes = r.memBytes;
    sb.meter.memImageBytes = r.memBytes;
    if (sb.state === "suspending") h.setState(sb, "suspended");
    // A restart right after must find `suspended` (its snapshot kept), not a dead `running` VM.
    await h.records.flush();
    return r;
  } catch (err) {
    if (sb.state === "suspending") h.setState(sb, "running");
    throw err;
  } finally {
    sb.op = undefined;
  }
}

export async function resumeSandbox(h: ForkSuspendHost, sb: Sandbox): Promise<ResumeResult> {
  // Its disk room is promised until the resume ends (then the driver counts the running VM's).
  const releaseDisk = h.capacity.admit(sb.size, 1, h.driver.newDiskBytes?.(sb.templateId, sb.id) ?? 0);
  try {
    h.setState(sb, "resuming");
    const op = h.driver.resume(sb.id, sb.templateId, sb.size);
    sb.op = op;
    const vm = await op.finally(releaseDisk);
    sb.vm = vm;
    sb.stopped = false;
    h.watchVm(sb, vm);
    if (sb.state !== "resuming") throw h.goneError(sb);
    h.setState(sb, "running");
    await h.records.flush();
    return { memBytes: sb.memBytes, resources: { ...sb.size, diskBytes: sb.meter.resources.diskBytes } };
  } catch (err) {
    if (sb.state === "resuming") h.setState(sb, "suspended");
    throw err;
  } finally {
    releaseDisk();
    sb.op = undefined;
  }
}
