/**
 * A create carried out (manager.ts keeps the table and calls this): a warm VM of the template if
 * one is pooled, else a QEMU pre-launched for it, else room made (other templates' pooled VMs
 * evicted while the host is full) and a VM restored; recorded before the VM is handed over.
 */
import type { CreatedVm, CreateVmOpts } from "../../contracts/agent/api.ts";
import { bestEffort } from "../../contracts/best-effort.ts";
import { EgressPolicy } from "../egress/policy.ts";
import { newVmId } from "../vm/ids.ts";
import type { Capacity } from "./capacity.ts";
import type { SandboxDriver, VmSize } from "./drivers/driver.ts";
import type { PrelaunchPool } from "./prelaunch-pool.ts";
import type { SandboxTable } from "./table.ts";
import type { TemplateRegistry } from "./templates.ts";
import type { WarmPool } from "./warm-pool.ts";

/** What a create needs of the manager: its pools, capacity, table, records and defaults. */
export interface CreateHost {
  driver: SandboxDriver;
  templates: TemplateRegistry;
  warm: WarmPool;
  prelaunch: PrelaunchPool;
  capacity: Capacity;
  table: SandboxTable;
  records: { flush(): Promise<void>; remove(id: string): Promise<void> };
  log: (msg: string) => void;
  defaultSize: VmSize;
  egressDefault: EgressPolicy;
}

export async function createSandbox(
  h: CreateHost,
  templateId: string,
  opts: CreateVmOpts,
): Promise<CreatedVm> {
  const t0 = performance.now();
  // The size class asked for (docs/templates.md "Size classes"); its own frozen template when it
  // is not the default one. Pools (warm, pre-launched) hold VMs of the default size only.
  const want = {
    ...(opts.vcpus !== undefined ? { vcpus: opts.vcpus } : {}),
    ...(opts.memMib !== undefined ? { memMib: opts.memMib } : {}),
  };
  const tpl = h.templates.ready(templateId, want, h.defaultSize);
  const size: VmSize = { ...h.defaultSize, ...tpl.size };
  // The driver's template this VM restores (and is recorded with): the class's own.
  const spawnId = tpl.id;
  const pools = spawnId === templateId;
  // A malformed allow-list is refused before anything is reserved.
  const egress =
    opts.egressAllow !== undefined ? EgressPolicy.fromAllowList(opts.egressAllow) : h.egressDefault;
  // A warm VM of this template first (already restored and paused: only `cont` and the clock);
  // it was counted against capacity while pooled. Else make room, evicting another template's
  // warm VMs when the host is full, and restore one.
  const tTake = performance.now();
  const pooled = pools ? await h.warm.take(spawnId) : undefined;
  const takeMs = performance.now() - tTake;
  // Its overlay may grow to the template disk's virtual size (capacity.ts DiskAccounting). A
  // warm VM's is counted already (it runs); a pre-launched one's only from its take on.
  const diskBytes = pooled ? 0 : (h.driver.newDiskBytes?.(spawnId) ?? 0);
  // Else a QEMU already launched in its jail for this template, which held its capacity too,
  // taken only while its disk room fits (else the cold path below says at_capacity with figures).
  const prelaunched =
    pooled || !pools || !h.capacity.diskFits(diskBytes) ? undefined : h.prelaunch.take(spawnId, size);
  let releaseDisk = prelaunched ? h.capacity.reserveDisk(diskBytes) : () => {};
  if (!pooled && !prelaunched) {
    while (
      !h.capacity.fits(size, 1, diskBytes) &&
      ((await h.warm.evictOne(spawnId)) || (await h.prelaunch.evictOne(spawnId)))
    ) {
      // each round frees one pooled VM of another template
    }
    releaseDisk = h.capacity.admit(size, 1, diskBytes);
  }
  const id = pooled?.vmId ?? prelaunched ?? newVmId();
  const now = Date.now();
  const endpoints = Object.fromEntries(tpl.prepared.exposedPorts.map((p) => [String(p), `${id}:${p}`]));
  const sb = h.table.newSandbox({
    id,
    templateId: spawnId,
    kind: opts.kind,
    state: "creating",
    size,
    endpoints,
    egress,
    now,
  });
  // Refilled once this sandbox holds its capacity (a refill only launches into what is left).
  h.prelaunch.fill(templateId);
  // The record lands before the VM is handed to it (a pre-launched VM's directory exists, but
  // it is taken from the pool only by this record), so a restart never reaps a VM being made.
  // Its failure is the create's (the catch below gives back what was held).
  sb.op = (async () => {
    await h.table.persist(sb);
    sb.vm = pooled ?? (await h.driver.spawn(spawnId, id, size));
  })();
  try {
    await sb.op;
  } catch (err) {
    releaseDisk();
    // Nobody knows this id yet: nothing to keep but the error.
    h.table.sandboxes.delete(id);
    h.table.reclaimTemplates();
    sb.meter.enter("destroyed", Date.now());
    await bestEffort(
      h.log,
      `destroying sandbox ${id} after its failed create`,
      h.driver.destroy(id, undefined),
    );
    await h.records.remove(id);
    throw err;
  }
  releaseDisk(); // the driver counts the running VM's room to grow from here
  const vm = sb.vm!;
  h.table.watchVm(sb, vm);
  if (sb.state !== "creating") throw h.table.goneError(sb); // destroyed or died meanwhile
  h.table.setState(sb, "running");
  // What a caller was told exists survives an agent exit right after: the record is on disk.
  await h.records.flush();
  await h.table.refreshDisk(sb); // the answer carries the measured disk: metering starts with it
  return {
    vmId: id,
    forkTimeMs: pooled ? takeMs : vm.spawnMs,
    createTimeMs: performance.now() - t0,
    endpoints,
    resources: { ...size, diskBytes: sb.meter.resources.diskBytes },
  };
}
