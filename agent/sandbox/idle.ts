/**
 * The idle pause of a sandbox's VM (manager.ts): its vCPUs are stopped once no call has used it
 * for `idlePauseMs`, unless a tunnel or a keep-awake process holds it awake, and restarted before
 * the next operation that needs the guest. Stop and cont go through the driver one at a time, in
 * call order.
 */

import { settled } from "../../contracts/best-effort.ts";
import { describeError } from "../../contracts/errors.ts";
import type { SandboxDriver } from "./drivers/driver.ts";
import type { Sandbox } from "./manager-types.ts";
import type { AgentSandboxState } from "./states.ts";

/** What the idle pause needs of the manager: the driver, its one state path, whether it let go. */
export interface IdleHost {
  driver: SandboxDriver;
  idlePauseMs: number;
  log: (msg: string) => void;
  setState(sb: Sandbox, to: AgentSandboxState): void;
  /** The manager let go of its VMs (`detach`): no timer is armed any more. */
  detached(): boolean;
}

export class IdlePause {
  constructor(private readonly h: IdleHost) {}

  arm(sb: Sandbox): void {
    this.clear(sb);
    if (this.h.detached()) return;
    sb.idleTimer = setTimeout(() => {
      sb.idleTimer = undefined;
      // Re-armed by tunnelsChanged once the last tunnel or keep-awake process ends.
      if (sb.state !== "running" || !sb.vm || this.keptAwake(sb)) return;
      this.h.setState(sb, "paused");
      this.vcpus(sb, true).catch((err) => {
        this.h.log(`sandbox ${sb.id}: idle pause failed: ${describeError(err)}`);
        if (sb.state === "paused") this.h.setState(sb, "running");
      });
    }, this.h.idlePauseMs);
    // An idle timer never keeps the agent process alive.
    sb.idleTimer.unref?.();
  }

  /** An open tunnel, or a running background process that asked (`keepAwake`), holds off the pause. */
  keptAwake(sb: Sandbox): boolean {
    return sb.tunnels.size > 0 || sb.tunnelOpens > 0 || sb.procs?.keepsAwake() === true;
  }

  /** The last tunnel or keep-awake process ended: the idle pause applies again. */
  tunnelsChanged(sb: Sandbox): void {
    if (!this.keptAwake(sb) && sb.state === "running" && !sb.idleTimer) this.arm(sb);
  }

  clear(sb: Sandbox): void {
    if (sb.idleTimer) clearTimeout(sb.idleTimer);
    sb.idleTimer = undefined;
  }

  /** Restarts stopped vCPUs before an operation that needs the guest. */
  async wake(sb: Sandbox): Promise<void> {
    await this.vcpus(sb, false);
  }

  /** Stops or restarts the vCPUs; one QMP stop/cont at a time, in call order. */
  vcpus(sb: Sandbox, stop: boolean): Promise<void> {
    // Each caller gets its own step's error; the chain goes on after a failed one.
    const next = settled(sb.vcpus).then(async () => {
      const vm = sb.vm;
      if (!vm || sb.stopped === stop) return;
      if (stop) await this.h.driver.pause(vm);
      else await this.h.driver.unpause(vm);
      sb.stopped = stop;
    });
    sb.vcpus = next;
    return next;
  }
}
