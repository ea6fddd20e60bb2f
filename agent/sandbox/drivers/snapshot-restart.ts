/**
 * What lets the snapshot driver's VMs (snapshot.ts) outlive the agent process: each VM's record
 * `snapshot-vm.json` written and read back, a running VM's QEMU and guest re-attached by a new
 * agent (`attachRunning`), and the snapshot files a dead agent left behind (`reapSnapshotFiles`).
 */
import { readdir, rm } from "node:fs/promises";
import { basename, join } from "node:path";
import { settled } from "../../../contracts/best-effort.ts";
import { describeError, SandboxdError } from "../../../contracts/errors.ts";
import { GuestClient } from "../../guest/client.ts";
import type { VmProcess } from "../../qemu/launch.ts";
import type { Result } from "../../snapshot/errors.ts";
import {
  checkVmRecord,
  readVmRecord,
  restoreVm,
  saveVm,
  type VmRecord,
  type VmRecordPlaces,
  writeVmRecord,
} from "../../snapshot/persist.ts";
import { reclaimSnapshotStorage } from "../../snapshot/recover.ts";
import { listTemplates, templatesRoot } from "../../snapshot/template.ts";
import { type SandboxVm, storageDir } from "../../snapshot/vm.ts";
import { openChainStore } from "../../storage/chain.ts";
import type { VmHostSettings } from "../../vm/host-settings.ts";
import { adoptQemu, claimVm, killRecordedStandby } from "../../vm/process.ts";
import { vmsRoot } from "../../vm/workdir.ts";
import type { DriverVm } from "./driver.ts";
import type { SnapshotTemplates } from "./snapshot-templates.ts";

/**
 * HELLO budget on adoption: a running guest answers in ~50 ms under TCG, but it first has to
 * notice the old connection's hang-up; one attempt is bounded, the whole by this.
 */
const ADOPT_HELLO_TIMEOUT_MS = 15_000;
const ADOPT_HELLO_ATTEMPT_MS = 2_000;

// ---- the VM's record -----------------------------------------------------------------------

/** The VM's record (agent/snapshot/persist.ts) with this driver's notes. */
export function recordOf(
  sbx: SandboxVm,
  h: Pick<DriverVm, "templateId" | "image" | "size">,
  memBytes?: number,
) {
  return saveVm(sbx, {
    templateId: h.templateId,
    image: h.image,
    size: h.size,
    ...(memBytes === undefined ? {} : { memBytes }),
  });
}

export function saveRecord(
  sbx: SandboxVm,
  h: Pick<DriverVm, "templateId" | "image" | "size">,
): Promise<void> {
  return writeVmRecord(sbx.dir, recordOf(sbx, h));
}

/**
 * The record of `vmId`, read and held to this agent's places (`checkVmRecord`); an unreadable or
 * failing one is logged (and answered as the error).
 */
export async function loadRecord(
  at: Omit<VmRecordPlaces, "dir" | "chain">,
  vmId: string,
  log: (msg: string) => void,
): Promise<Result<VmRecord | undefined>> {
  const dir = join(vmsRoot(at.stateDir), vmId);
  const read = await readVmRecord(dir);
  const r =
    read.ok && read.value
      ? await checkVmRecord(read.value, { ...at, dir, chain: await openChainStore(at.stateDir) })
      : read;
  if (!r.ok) log(`VM ${vmId}: ${r.error.message}`);
  return r;
}

/**
 * This driver's VMs outlive the agent process (re-adopted after a restart), whatever was saved;
 * they obey this agent's jail and disk-reserve settings.
 */
export function restoreRecord(
  stateDir: string,
  record: VmRecord,
  host: VmHostSettings,
  log: (msg: string) => void,
): SandboxVm {
  const shape = { ...record.shape, dieWithParent: false, host };
  return restoreVm({ ...record, shape }, join(vmsRoot(stateDir), record.vmId), log);
}

// ---- adoption ------------------------------------------------------------------------------

/**
 * Re-attaches to the running QEMU `pid` that an earlier agent launched in `dir`: its QMP, its
 * vCPUs running again, the guest's HELLO and clock; then claims the VM directory for this process.
 */
export async function attachRunning(
  dir: string,
  pid: number,
): Promise<{ proc: VmProcess; guest: GuestClient }> {
  // A standby the earlier agent had armed (snapshot/standby.ts) is nobody's now.
  await killRecordedStandby(dir, { sweep: true });
  const proc = await adoptQemu(pid, dir);
  const qmp = proc.qmp;
  let guest: GuestClient | undefined;
  try {
    const status = await qmp.execute<{ running: boolean; status: string }>("query-status");
    if (!status.running) {
      // Idle-paused (or caught in a save the dead agent never finished): run it again.
      // A cancel with nothing to cancel is no error; a QEMU that cannot run fails the `cont`.
      await settled(qmp.execute("migrate_cancel"));
      await qmp.execute("cont");
    }
    guest = await connectAdopted(proc);
    await guest.setClock(new Date());
  } catch (err) {
    guest?.close();
    qmp.close();
    throw new SandboxdError("vm_lost", "the adopted VM does not answer", { cause: err });
  }
  await claimVm(dir, pid);
  return { proc, guest };
}

/** HELLO to a running guest whose agent may still be noticing the old host's hang-up. */
async function connectAdopted(proc: VmProcess): Promise<GuestClient> {
  const deadline = performance.now() + ADOPT_HELLO_TIMEOUT_MS;
  let lastErr: unknown;
  while (performance.now() < deadline) {
    if (!proc.isAlive()) break;
    try {
      return await GuestClient.connect(proc.agentSocket, {
        helloTimeoutMs: Math.min(ADOPT_HELLO_ATTEMPT_MS, Math.max(1, deadline - performance.now())),
      });
    } catch (err) {
      lastErr = err;
      await Bun.sleep(50);
    }
  }
  throw new SandboxdError("vm_lost", `guest agent did not answer HELLO: ${describeError(lastErr)}`, {
    cause: lastErr,
  });
}

// ---- the files a dead agent left -----------------------------------------------------------

/** What the reap of snapshot files needs of the driver. */
export interface ReapContext {
  stateDir: string;
  shmRoot: string;
  templates: SnapshotTemplates;
  log: (msg: string) => void;
}

/**
 * The template builds a dead agent was running, the chain store's holders whose VM directory is
 * gone (`reclaimSnapshotStorage`), and the files the chain store does not know.
 */
export async function reapSnapshotFiles(ctx: ReapContext): Promise<void> {
  // Builds the dead agent was running (its records say failed): their files go.
  for (const t of await listTemplates(ctx.stateDir)) {
    if (t.state !== "building" || ctx.templates.building.has(t.id)) continue;
    await rm(join(templatesRoot(ctx.stateDir), t.id), { recursive: true, force: true });
    await rm(t.memPath, { force: true });
  }
  const freed = await reclaimSnapshotStorage(ctx.stateDir);
  const swept = await sweepUnregistered(ctx);
  if (freed.length + swept.length > 0)
    ctx.log(`reclaimed snapshot files: ${[...freed, ...swept].map((p) => basename(p)).join(", ")}`);
}

/**
 * Files in the engine's directories that the chain store does not know: a crash between
 * creating one and registering it (a fork's state or fork-point RAM, a half-written overlay or
 * suspend state). Template RAM files of builds in progress here are not registered yet.
 */
async function sweepUnregistered(ctx: ReapContext): Promise<string[]> {
  const chain = await openChainStore(ctx.stateDir);
  const known = new Set(chain.list().map((f) => f.path));
  for (const p of ctx.templates.memPaths()) known.add(p);
  const building = new Set([...ctx.templates.building].map((id) => join(ctx.shmRoot, `tpl-${id}.mem`)));
  const swept: string[] = [];
  const dirs = [ctx.shmRoot, storageDir(ctx.stateDir), join(ctx.stateDir, "storage", "suspended")];
  for (const d of dirs) {
    let names: string[] = [];
    try {
      names = await readdir(d);
    } catch {
      continue;
    }
    for (const n of names) {
      const p = join(d, n);
      if (known.has(p) || building.has(p)) continue;
      await rm(p, { force: true });
      swept.push(p);
    }
  }
  return swept;
}
