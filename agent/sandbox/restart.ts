/**
 * The sandbox records read back after an agent restart (manager.ts `SandboxManager.open`): a
 * `running` record whose VM still answers is adopted and running again, a VM caught mid-create is
 * `lost`, a suspended one keeps its snapshot, and a destroy the dead agent began is finished.
 */
import { describeError } from "../../contracts/errors.ts";
import type { DriverVm, SandboxDriver } from "./drivers/driver.ts";
import type { Sandbox } from "./manager-types.ts";
import type { SandboxRecord } from "./records.ts";

/** What re-adopting needs of the manager: its driver and records, and its table's entry points. */
export interface RestartHost {
  driver: SandboxDriver;
  records: { remove(id: string): Promise<void> };
  log: (msg: string) => void;
  /** The record's sandbox, now in the manager's table. */
  fromRecord(r: SandboxRecord): Sandbox;
  watchVm(sb: Sandbox, vm: DriverVm): void;
  markLost(sb: Sandbox, reason: string): void;
  armIdle(sb: Sandbox): void;
  /** Takes a sandbox out of the manager's table. */
  forget(id: string): void;
}

/** Brings every record back into the manager; answers the VM ids the reap must keep. */
export async function readoptAll(h: RestartHost, records: readonly SandboxRecord[]): Promise<Set<string>> {
  const keep = new Set<string>();
  for (const r of records) {
    const sb = h.fromRecord(r);
    switch (r.state) {
      case "running": {
        try {
          const vm = await h.driver.adopt({
            vmId: r.id,
            templateId: r.templateId,
            size: r.size,
            qemuPid: r.qemuPid ?? -1,
            paused: false,
          });
          sb.vm = vm;
          h.watchVm(sb, vm);
          keep.add(r.id);
          h.log(`sandbox ${r.id}: re-adopted (QEMU pid ${vm.qemuPid})`);
          h.armIdle(sb);
        } catch (err) {
          h.markLost(sb, `not re-adopted after an agent restart: ${describeError(err)}`);
        }
        break;
      }
      case "creating":
        h.markLost(sb, "the agent restarted while the VM was being created");
        break;
      case "suspended":
        keep.add(r.id); // its snapshot lives in the VM directory
        break;
      case "destroying":
        await h.driver.destroy(r.id, undefined);
        await h.records.remove(r.id);
        h.forget(r.id);
        break;
      default:
        // failed / lost stay (with their reason) until destroyed; their VMs are reaped after this (`SandboxManager.open`).
        break;
    }
  }
  return keep;
}
