/**
 * The sandbox table (manager.ts): every sandbox this agent holds and the bookkeeping around it:
 * the one place state changes (checked against states.ts, metered, recorded, idle re-armed), its
 * record on disk, the watch on its VM (QEMU's exit, a guest that misbehaves), the resources the
 * VMs hold, and the templates reclaimed once their last VM ends. The manager's operations and the
 * hosts it hands fork-suspend.ts, restart.ts, idle.ts and guest-access.ts reach sandboxes here.
 */

import { settled } from "../../contracts/best-effort.ts";
import { describeError, SandboxdError } from "../../contracts/errors.ts";
import { EgressPolicy } from "../egress/policy.ts";
import { addHeld, type HeldResources } from "./capacity.ts";
import type { DriverVm, SandboxDriver, VmExitInfo } from "./drivers/driver.ts";
import {
  type ManagerOptions,
  makeSandbox,
  type NewSandbox,
  recordOf,
  type Sandbox,
} from "./manager-types.ts";
import type { RecordStore, SandboxRecord } from "./records.ts";
import { type AgentSandboxState, checkTransition, holdsVm, isTerminal } from "./states.ts";
import { baseTemplateId, type TemplateRegistry } from "./templates.ts";

/** What the table needs of the manager: its driver, records, templates, pools and idle pause. */
export interface TableHost {
  driver: SandboxDriver;
  records: RecordStore<SandboxRecord>;
  templates: TemplateRegistry;
  log: (msg: string) => void;
  /** The deployment's egress default, for records that carry no allow-list. */
  egressDefault: EgressPolicy;
  /** Where a sandbox's usage intervals and VM events go. */
  opts: Pick<ManagerOptions, "onUsage" | "onEvent">;
  /** The pools whose VMs hold capacity beside the sandboxes'. */
  warm: { used(): HeldResources };
  prelaunch: { used(): HeldResources };
  idle: { arm(sb: Sandbox): void; clear(sb: Sandbox): void };
}

export class SandboxTable {
  readonly sandboxes = new Map<string, Sandbox>();
  /** The manager let go of its VMs (`SandboxManager.detach`): nothing is recorded or watched any more. */
  detached = false;

  constructor(private readonly h: TableHost) {}

  goneError(sb: Sandbox): SandboxdError {
    const why = sb.reason ? `: ${sb.reason}` : "";
    return new SandboxdError("gone", `sandbox ${sb.id} is ${sb.state}${why}`, {
      details: { id: sb.id, state: sb.state },
    });
  }

  private onVmExit(sb: Sandbox, info: VmExitInfo): void {
    if (this.detached) return;
    sb.died = info;
    for (const w of sb.onDied.splice(0)) w();
    if (isTerminal(sb.state)) return;
    this.h.log(`sandbox ${sb.id}: ${info.reason}`);
    sb.reason = info.reason;
    this.h.idle.clear(sb);
    this.closeTunnels(sb, `failed: ${info.reason}`);
    sb.vm?.guest.close(); // in-flight guest requests reject now, not at their timeout
    this.setState(sb, "failed");
  }

  /**
   * Watches a VM the sandbox now holds: its QEMU's exit, and its guest channel. A channel that
   * ends with a `protocol_error` was ended by the guest's own bytes (agent/guest/client.ts: a
   * malformed frame, DATA beyond credit, or one of the bounds on what a guest can make the host
   * hold): the sandbox fails with `guest_misbehaved: <why>` and its QEMU is killed, as if it had
   * died; a failed sandbox holds no capacity, so its VM must not run on.
   */
  watchVm(sb: Sandbox, vm: DriverVm): void {
    this.h.driver.onExit(vm, (info) => this.onVmExit(sb, info));
    vm.guest.onClose((err) => {
      if (err.code !== "protocol_error" || sb.vm !== vm || this.detached || isTerminal(sb.state)) return;
      this.onVmExit(sb, { reason: `guest_misbehaved: ${err.message}` });
      void (async () => {
        await settled(sb.op); // the operation's caller gets its outcome
        await this.h.driver.destroy(sb.id, vm);
      })().catch((e) =>
        this.h.log(`sandbox ${sb.id}: killing the misbehaving VM failed: ${describeError(e)}`),
      );
    });
  }

  /** Ends every tunnel of the sandbox now (destroy, failure, suspend): the VM is going away. */
  closeTunnels(sb: Sandbox, why: string): void {
    const err = new SandboxdError("gone", `sandbox ${sb.id} ${why}`, { details: { id: sb.id } });
    for (const t of [...sb.tunnels]) t.abort(err);
    sb.tunnels.clear();
  }

  markLost(sb: Sandbox, reason: string): void {
    this.h.log(`sandbox ${sb.id}: lost: ${reason}`);
    sb.reason = reason;
    sb.state = "lost";
    sb.meter.enter("lost", Date.now(), reason);
    void this.persist(sb);
    this.reclaimTemplates();
  }

  /** The one place state changes: checked against the table, metered, recorded, idle re-armed. */
  setState(sb: Sandbox, to: AgentSandboxState): void {
    const check = checkTransition(sb.id, sb.state, to);
    if (!check.ok) throw check.error;
    sb.state = to;
    sb.meter.enter(to, Date.now(), sb.reason);
    if (to === "running") this.h.idle.arm(sb);
    else this.h.idle.clear(sb);
    if (to !== "destroyed") void this.persist(sb);
    if (isTerminal(to)) this.reclaimTemplates();
  }

  /** VMs of sandboxes and of warm pools. */
  used(): HeldResources {
    const w = this.h.warm.used();
    const p = this.h.prelaunch.used();
    let held = { count: w.count + p.count, vcpus: w.vcpus + p.vcpus, memMib: w.memMib + p.memMib };
    for (const sb of this.sandboxes.values()) if (holdsVm(sb.state)) held = addHeld(held, sb.size);
    return held;
  }

  async refreshDisk(sb: Sandbox): Promise<void> {
    try {
      sb.meter.setDisk(await this.h.driver.diskBytes(sb.id), Date.now());
    } catch {
      // metering is best effort; the last value stays
    }
  }

  mustGet(id: string): Sandbox {
    const sb = this.sandboxes.get(id);
    if (!sb) throw new SandboxdError("not_found", `sandbox ${id} is unknown to this agent`);
    return sb;
  }

  newSandbox(o: NewSandbox): Sandbox {
    const sb = makeSandbox(o, {
      onUsage: (iv) => this.h.opts.onUsage?.(iv),
      onEvent: (e) => this.h.opts.onEvent?.(e),
    });
    this.sandboxes.set(o.id, sb);
    return sb;
  }

  fromRecord(r: SandboxRecord): Sandbox {
    const sb = this.newSandbox({
      id: r.id,
      templateId: r.templateId,
      kind: r.kind,
      state: r.state,
      size: r.size,
      endpoints: r.endpoints,
      // Records from before egress existed: the deployment default of today.
      egress: r.egressAllow !== undefined ? EgressPolicy.fromAllowList(r.egressAllow) : this.h.egressDefault,
      now: Date.now(),
    });
    sb.createdAtMs = r.createdAtMs;
    sb.lastUsedAtMs = r.lastUsedAtMs;
    sb.execCount = r.execCount;
    if (r.reason !== undefined) sb.reason = r.reason;
    return sb;
  }

  /** Writes the record; in-flight states are written as the state a restart should assume. */
  persist(sb: Sandbox): Promise<void> {
    if (this.detached) return Promise.resolve();
    const record = recordOf(sb);
    return this.h.records.write(record).catch((err) => {
      this.h.log(`sandbox ${sb.id}: cannot write its record: ${describeError(err)}`);
    });
  }

  /** Whether a live VM runs on template `id`, at any of its size classes (templates.ts `sizedTemplateId`). */
  templateInUse(id: string): boolean {
    return [...this.sandboxes.values()].some(
      (s) => baseTemplateId(s.templateId) === id && !isTerminal(s.state),
    );
  }

  /** Removes each template marked deleting whose VMs have all ended. */
  reclaimTemplates(): void {
    for (const id of this.h.templates.deletingIds()) {
      if (this.templateInUse(id)) continue;
      void this.h.templates.delete(id, false).then(
        () => this.h.log(`template ${id}: deleted, the last VM on it has ended`),
        (err: unknown) => this.h.log(`template ${id}: deleting it failed: ${describeError(err)}`),
      );
    }
  }
}
