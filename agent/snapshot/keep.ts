/**
 * Kept snapshots (docs/snapshots.md): a running VM's memory and disk at one instant, kept by the
 * agent under a name (`ref`, the gateway's `snap_` id) until dropped, and VMs started from it.
 *
 * Taking one is the first half of a fork (fork.ts `captureParent`: the same stall, the parent runs
 * on, its old top overlay frozen read-only). Then, instead of starting children:
 * - the RAM stream is copied from tmpfs to the data disk (`storage/<ref>.state`): a snapshot may be
 *   kept for months, and tmpfs is host memory;
 * - past `MAX_CHAIN_DEPTH` the frozen overlay is flattened onto the image base (as fork children's
 *   base is), so VMs started from it never run on a deeper chain than the bound;
 * - the chain store holds the state file (which depends on the RAM file the parent mapped) and the
 *   disk base under `kept:<ref>`; the fork's own hold is released.
 * - `<dataDir>/kept/<ref>.json` records what a start needs; `reclaimSnapshotStorage` keeps the
 *   holder while that file exists, so a kept snapshot survives agent restarts.
 *
 * A VM from it restores as a direct fork child does: the full RAM stream over a private mapping of
 * the RAM file, a new overlay on the kept base, held by `vm:<id>`. Dropping releases `kept:<ref>`
 * and removes the record: the chain store frees each file once no VM holds it any more, so a drop
 * while VMs made from the snapshot run frees their files with the last of them.
 */
import { copyFile, mkdir, readdir, readFile, rename, rm, stat, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { z } from "zod";
import type { FreeBytes } from "../../contracts/disk-space.ts";
import { type ChainStore, openChainStore } from "../storage/chain.ts";
import { createOverlayOn, flattenOnto, MAX_CHAIN_DEPTH } from "../storage/qcow2.ts";
import { vmsRoot } from "../vm/workdir.ts";
import { asSnapshotError, fail, ok, type Result, SnapshotError } from "./errors.ts";
import { checkedChain } from "./fork/chain.ts";
import { captureParent } from "./fork.ts";
import type { ForkMethod } from "./fork-method.ts";
import { type RestoreTimings, restoreInto, SandboxVm, storageDir, type VmShape } from "./vm.ts";

/** A kept snapshot's name: the gateway's snapshot id (contracts/agent/schemas.ts SnapshotRefParam). */
export const KEPT_REF = /^snap_[a-z0-9]{1,60}$/;

const KeptRecord = z.object({
  version: z.literal(1),
  ref: z.string().regex(KEPT_REF),
  /** The disk base of VMs started from it (read-only; held by `kept:<ref>`). */
  base: z.string(),
  /** The full RAM + device state, restored over a private mapping of `memPath`. */
  statePath: z.string(),
  memPath: z.string(),
  /** The source VM's shape without its host settings (the restoring agent's own apply). */
  shape: z.custom<VmShape>((v) => typeof v === "object" && v !== null),
  /** The owner's notes (the driver's template, size, image config), kept and not read here. */
  notes: z.record(z.string(), z.unknown()),
  sizeBytes: z.number(),
});
export type KeptRecord = z.infer<typeof KeptRecord>;

export const keptRoot = (dataDir: string) => join(dataDir, "kept");
const recordPath = (dataDir: string, ref: string) => join(keptRoot(dataDir), `${ref}.json`);
export const keptHolder = (ref: string) => `kept:${ref}`;

export interface Kept {
  record: KeptRecord;
  parentStallMs: number;
}

/** Takes snapshot `ref` of running `parent` (see the file's comment); the parent runs on either way. */
export async function keepVm(
  parent: SandboxVm,
  ref: string,
  o: { method: ForkMethod; notes: Record<string, unknown>; log?: (m: string) => void; freeBytes?: FreeBytes },
): Promise<Result<Kept>> {
  const log = o.log ?? (() => {});
  if (!KEPT_REF.test(ref)) return fail(new SnapshotError("bad_request", `bad snapshot name ${ref}`));
  const dataDir = parent.shape.dataDir;
  const chain = await openChainStore(dataDir);
  if (chain.list().some((f) => f.holders.includes(keptHolder(ref))))
    return fail(new SnapshotError("bad_request", `snapshot ${ref} exists`));
  const captured = await captureParent(parent, "direct", o.method, log, o.freeBytes);
  if (!captured.ok) return captured;
  const { run, frozen, forkHolder, parentStallMs } = captured.value;
  const holder = keptHolder(ref);
  const disks = storageDir(dataDir);
  const statePath = join(disks, `${ref}.state`);
  try {
    let base = frozen;
    if (chain.depth(frozen) >= MAX_CHAIN_DEPTH) {
      const below = await checkedChain(chain, frozen, parent.shape.baseDisk);
      base = join(disks, `${ref}-flat.qcow2`);
      await flattenOnto(frozen, below, base, parent.shape.diskBytes);
      await chain.add(base, { kind: "overlay", holder, depth: 1 });
    } else {
      await chain.hold(holder, [frozen]);
    }
    await copyFile(run.statePath, statePath);
    await chain.add(statePath, { kind: "state", holder, deps: [parent.memPath] });
    const { host: _host, ...shape } = parent.shape;
    const sizeBytes = (await stat(statePath)).size + (await allocated(base));
    const record: KeptRecord = {
      version: 1,
      ref,
      base,
      statePath,
      memPath: parent.memPath,
      shape,
      notes: o.notes,
      sizeBytes,
    };
    await writeRecord(dataDir, record);
    return ok({ record, parentStallMs });
  } catch (err) {
    await chain.release(holder);
    await rm(statePath, { force: true });
    return fail(asSnapshotError(err, "fork_failed", `keeping snapshot ${ref} of ${parent.id} failed`));
  } finally {
    await chain.release(forkHolder);
  }
}

/** A VM `id` from kept snapshot `record`, running, its identity set (a new machine). */
export async function startFromKept(
  record: KeptRecord,
  id: string,
  o: { host?: VmShape["host"]; log?: (m: string) => void; readyTimeoutMs?: number },
): Promise<Result<{ vm: SandboxVm; timings: RestoreTimings }>> {
  const shape: VmShape = { ...record.shape, ...(o.host ? { host: o.host } : {}) };
  const chain: ChainStore = await openChainStore(shape.dataDir);
  const disk = join(storageDir(shape.dataDir), `${id}-0.qcow2`);
  const vm = new SandboxVm(id, join(vmsRoot(shape.dataDir), id), shape, disk, record.memPath, o.log);
  try {
    await chain.hold(vm.holder, [record.base, record.memPath]);
    await createOverlayOn(record.base, disk, shape.diskBytes);
    await chain.add(disk, { kind: "overlay", deps: [record.base], holder: vm.holder });
    const timings = await restoreInto({
      vm,
      mem: { path: record.memPath, share: false },
      statePath: record.statePath,
      ignoreShared: false,
      ...(o.readyTimeoutMs ? { readyTimeoutMs: o.readyTimeoutMs } : {}),
    });
    vm.enter("running");
    return ok({ vm, timings });
  } catch (err) {
    await vm.destroy();
    return fail(asSnapshotError(err, "spawn_failed", `VM ${id} did not start from snapshot ${record.ref}`));
  }
}

/** Drops kept snapshot `ref` (idempotent): its files go with the last VM that still holds them. */
export async function dropKept(dataDir: string, ref: string): Promise<void> {
  await rm(recordPath(dataDir, ref), { force: true });
  const chain = await openChainStore(dataDir);
  await chain.release(keptHolder(ref));
}

/** Every kept snapshot recorded in `dataDir` (an agent's start reloads them); unreadable ones are named. */
export async function listKept(dataDir: string): Promise<{ kept: KeptRecord[]; bad: string[] }> {
  let names: string[] = [];
  try {
    names = await readdir(keptRoot(dataDir));
  } catch {
    return { kept: [], bad: [] };
  }
  const kept: KeptRecord[] = [];
  const bad: string[] = [];
  for (const n of names.filter((x) => x.endsWith(".json"))) {
    try {
      kept.push(KeptRecord.parse(JSON.parse(await readFile(join(keptRoot(dataDir), n), "utf8"))));
    } catch (err) {
      bad.push(`${n}: ${err instanceof Error ? err.message : String(err)}`);
    }
  }
  return { kept, bad };
}

async function writeRecord(dataDir: string, record: KeptRecord): Promise<void> {
  await mkdir(keptRoot(dataDir), { recursive: true, mode: 0o700 });
  const path = recordPath(dataDir, record.ref);
  await writeFile(`${path}.tmp`, JSON.stringify(record), { mode: 0o600 });
  await rename(`${path}.tmp`, path);
}

async function allocated(path: string): Promise<number> {
  try {
    return (await stat(path)).blocks * 512;
  } catch {
    return 0;
  }
}
