/**
 * Kept snapshots carried out for the manager (docs/snapshots.md): take one of a sandbox's VM,
 * start a sandbox from one, drop one. The engine's part is agent/snapshot/keep.ts, reached through
 * the driver; a driver without it (the boot driver) answers `unsupported`.
 */
import type { CreatedVm, CreateVmOpts, SnapshotRestored, SnapshotTaken } from "../../contracts/agent/api.ts";
import { bestEffort } from "../../contracts/best-effort.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { EgressPolicy } from "../egress/policy.ts";
import type { ForkSuspendHost } from "./fork-suspend.ts";
import type { Sandbox } from "./manager-types.ts";

export interface KeptHost extends ForkSuspendHost {
  egressDefault: EgressPolicy;
}

function unsupported(): SandboxdError {
  return new SandboxdError("unsupported", "this agent's driver keeps no snapshots");
}

/** Snapshot `ref` of running `sb`: a fork's stall, then it runs on (state `forking` meanwhile). */
export async function keepSandbox(h: KeptHost, sb: Sandbox, ref: string): Promise<SnapshotTaken> {
  const keep = h.driver.keep?.bind(h.driver);
  if (!keep) throw unsupported();
  h.setState(sb, "forking");
  try {
    await h.wake(sb);
    const op = keep(sb.vm!, ref, Object.keys(sb.endpoints));
    sb.op = op;
    const r = await op;
    return {
      snapshot: ref,
      sizeBytes: r.sizeBytes,
      stallMs: r.stallMs,
      resources: { ...sb.size, diskBytes: sb.meter.resources.diskBytes },
    };
  } finally {
    sb.op = undefined;
    if (sb.state === "forking") h.setState(sb, "running");
  }
}

/**
 * Rolls sandbox `sb` back to kept snapshot `ref` in place (docs/snapshots.md "Restore in place"):
 * the same sandbox id, endpoints, egress and lifetime; memory, processes and files as they were
 * in the snapshot. A snapshot of another size is refused before anything changes. Its tunnels
 * and background processes lived in the memory being replaced: they are ended first, saying so.
 * A failure after the old VM stopped fails the sandbox, with the reason (`details.lost`).
 */
export async function restoreSandbox(h: KeptHost, sb: Sandbox, ref: string): Promise<SnapshotRestored> {
  const restore = h.driver.restoreKept?.bind(h.driver);
  if (!restore) throw unsupported();
  const size = await h.driver.keptSize?.(ref);
  if (!size) throw new SandboxdError("not_found", `snapshot ${ref} is not kept on this agent`);
  if (size.vcpus !== sb.size.vcpus || size.memMib !== sb.size.memMib)
    throw new SandboxdError(
      "conflict",
      `snapshot ${ref} is of a ${size.vcpus} vCPU, ${size.memMib} MiB sandbox; ${sb.id} is ${sb.size.vcpus} vCPU, ${sb.size.memMib} MiB`,
      { details: { snapshot: size, sandbox: sb.size } },
    );
  h.setState(sb, "restoring");
  // Short: a WebSocket's close reason carries it, and the gateway cuts reasons at 123 bytes.
  h.closeTunnels(sb, `restored to snapshot ${ref}`);
  try {
    await sb.procs?.killAll();
    const op = restore(sb.vm!, ref);
    sb.op = op;
    const r = await op;
    sb.vm = r.vm;
    sb.stopped = false;
    h.watchVm(sb, r.vm);
    if (sb.state !== "restoring") throw h.goneError(sb);
    h.setState(sb, "running");
    await h.records.flush();
    await h.refreshDisk(sb);
    return {
      snapshot: ref,
      restoreMs: r.restoreMs,
      downMs: r.downMs,
      standby: r.standby,
      resources: { ...sb.size, diskBytes: sb.meter.resources.diskBytes },
    };
  } catch (err) {
    const lost =
      err instanceof SandboxdError && (err.details as { lost?: boolean } | undefined)?.lost === true;
    if (sb.state === "restoring") {
      if (lost) {
        sb.reason = `restore to ${ref} failed: ${err instanceof Error ? err.message : String(err)}`;
        sb.vm = undefined;
        h.setState(sb, "failed");
        await h.records.flush();
      } else h.setState(sb, "running");
    }
    throw err;
  } finally {
    sb.op = undefined;
  }
}

/** A new sandbox from kept snapshot `ref`, admitted like a create (its size is the source's). */
export async function createFromKept(
  h: KeptHost,
  ref: string,
  vmId: string,
  opts: CreateVmOpts,
): Promise<CreatedVm> {
  const spawn = h.driver.spawnFromKept?.bind(h.driver);
  if (!spawn) throw unsupported();
  const t0 = performance.now();
  const egress =
    opts.egressAllow !== undefined ? EgressPolicy.fromAllowList(opts.egressAllow) : h.egressDefault;
  let sb: Sandbox | undefined;
  const size = await h.driver.keptSize?.(ref);
  if (!size) throw new SandboxdError("not_found", `snapshot ${ref} is not kept on this agent`);
  // Admitted before it starts, as a create is (at_capacity when the host is full). Its overlay
  // may grow to the source's disk size, which the driver counts once the VM runs.
  const release = h.capacity.admit(size, 1, 0);
  try {
    const { vm, ports } = await spawn(ref, vmId);
    const endpoints = Object.fromEntries(ports.map((p) => [p, `${vmId}:${p}`]));
    sb = h.newSandbox({
      id: vmId,
      templateId: vm.templateId,
      kind: opts.kind,
      state: "creating",
      size: vm.size,
      endpoints,
      egress,
      now: Date.now(),
    });
    await h.persist(sb);
    sb.vm = vm;
    h.watchVm(sb, vm);
    h.setState(sb, "running");
    await h.records.flush();
    await h.refreshDisk(sb);
    return {
      vmId,
      forkTimeMs: vm.spawnMs,
      createTimeMs: performance.now() - t0,
      endpoints,
      resources: { ...vm.size, diskBytes: sb.meter.resources.diskBytes },
    };
  } catch (err) {
    if (sb) {
      h.forget(vmId);
      sb.meter.enter("destroyed", Date.now());
      await h.records.remove(vmId);
    }
    await bestEffort(
      h.log,
      `destroying ${vmId} after its start from ${ref} failed`,
      h.driver.destroy(vmId, sb?.vm),
    );
    throw err;
  } finally {
    release();
  }
}

export async function dropKeptSnapshot(h: KeptHost, ref: string): Promise<void> {
  const drop = h.driver.dropKept?.bind(h.driver);
  if (!drop) throw unsupported();
  await drop(ref);
}
