/**
 * Spawning a sandbox from a template: a new overlay backed by the template's frozen disk, a QEMU
 * with the SAME device ids (launchVm) mapping the template's RAM file private (copy-on-write, so
 * children share every page they do not write), `-incoming defer`, x-ignore-shared, load the
 * ~60 KB device state, `cont`, reconnect the guest agent and give it its own identity.
 *
 * Also `floorRestoreMs`: the same restore with nothing of ours but the argv (for the benchmark:
 * what the engine adds on top of QEMU itself).
 */

import { spawn } from "node:child_process";
import { mkdir, mkdtemp, readFile, rm } from "node:fs/promises";
import { createConnection, type Socket } from "node:net";
import { join, resolve } from "node:path";
import { SandboxdError } from "../../contracts/errors.ts";
import { FrameType, Op, Tag } from "../../contracts/guest-protocol.ts";
import { encodeFrame, TlvWriter } from "../guest/codec.ts";
import { JAIL_ENV } from "../qemu/jail.ts";
import { isHostnameLabel, jailedLaunchArgv, readHostPid, type VmProcess } from "../qemu/launch.ts";
import { openChainStore } from "../storage/chain.ts";
import { createOverlayFromBlank, createOverlayOn } from "../storage/qcow2.ts";
import type { VmHostSettings } from "../vm/host-settings.ts";
import { newVmId } from "../vm/ids.ts";
import { vmsRoot } from "../vm/workdir.ts";
import { asSnapshotError, fail, ok, type Result, SnapshotError } from "./errors.ts";
import type { TemplateMeta } from "./template.ts";
import {
  finishRestore,
  launchRestoreTarget,
  type RestoreTimings,
  SandboxVm,
  storageDir,
  type VmShape,
} from "./vm.ts";

export interface SpawnOptions {
  dataDir: string;
  template: TemplateMeta;
  /** `newVmId()` by default; must be an RFC 1123 label (it becomes the hostname). */
  id?: string;
  readyTimeoutMs?: number;
  /** Launch option: false for VMs that must outlive this process (see VmShape). Default true. */
  dieWithParent?: boolean;
  /** The operator's jail and disk-reserve settings; default DEFAULT_VM_HOST. */
  host?: VmHostSettings;
  log?: (m: string) => void;
}

export interface Spawned {
  vm: SandboxVm;
  timings: RestoreTimings;
}

export function shapeOf(dataDir: string, t: TemplateMeta): VmShape {
  return {
    dataDir: resolve(dataDir),
    shmRoot: t.shmRoot,
    artifacts: t.artifacts,
    accel: t.accel,
    memMib: t.memMib,
    vcpus: t.vcpus,
    baseDisk: t.baseDisk,
    diskBytes: t.diskBytes,
  };
}

/**
 * A QEMU launched ahead of its spawn (a pool's, agent/sandbox/prelaunch-pool.ts): everything a
 * spawn does before it reads the template's device state is done, so taking it costs only the
 * restore proper. It owns its VM id, directory, overlay, chain holds, jail (uid, cgroup) and
 * owner record exactly as a spawned VM does, and `discard` frees them as `SandboxVm.destroy` does.
 */
export interface Prelaunched {
  vm: SandboxVm;
  template: TemplateMeta;
  process: VmProcess;
  /** QEMU spawn to QMP connected and capabilities set, ms. */
  launchMs: number;
  discard(): Promise<void>;
}

/**
 * Spawn's first half for a template: overlay, VM directory, QEMU in its jail waiting for the
 * device state (`-incoming defer -S`), QMP and console drain connected. `spawnFromTemplate` with
 * `prelaunched` finishes it. The id is fixed here: it names the directory QEMU's argv refers to.
 */
export async function prelaunchFromTemplate(o: SpawnOptions): Promise<Result<Prelaunched>> {
  const t = o.template;
  if (t.state !== "ready")
    return fail(new SnapshotError("template_not_ready", `template ${t.id} is ${t.state}`));
  const id = o.id ?? newVmId();
  if (!isHostnameLabel(id))
    return fail(new SnapshotError("bad_request", `invalid sandbox id ${JSON.stringify(id)}`));
  const shape = shapeOf(o.dataDir, t);
  if (o.dieWithParent !== undefined) shape.dieWithParent = o.dieWithParent;
  if (o.host) shape.host = o.host;
  const disks = storageDir(shape.dataDir);
  const disk = join(disks, `${id}-0.qcow2`);
  const vm = new SandboxVm(id, join(vmsRoot(shape.dataDir), id), shape, disk, t.memPath, o.log);
  try {
    const chain = await openChainStore(shape.dataDir);
    // Hold the template's files first: a deleteTemplate racing us cannot free them under us.
    await chain.hold(vm.holder, [t.disk, t.memPath]);
    await mkdir(disks, { recursive: true, mode: 0o700 });
    await createOverlayFromBlank(t.disk, disk, t.diskBytes);
    await chain.add(disk, { kind: "overlay", deps: [t.disk], holder: vm.holder });
    const t0 = performance.now();
    const proc = await launchRestoreTarget(vm, { path: t.memPath, share: false }, true);
    // Not attached yet: a QEMU that dies while it waits is freed here, not by SandboxVm.attach.
    void proc.exited.then(() => {
      if (vm.process === undefined && vm.state === "starting") void vm.destroy();
    });
    return ok({
      vm,
      template: t,
      process: proc,
      launchMs: performance.now() - t0,
      discard: async () => {
        await proc.kill();
        await vm.destroy();
      },
    });
  } catch (err) {
    await vm.destroy();
    return fail(asSnapshotError(err, "spawn_failed", `spawning from template ${t.id} failed`));
  }
}

/**
 * A new VM from the template. With `prelaunched` (of this template, alive), only the restore
 * proper runs: its timings start at the take, and its VM keeps the id it was launched under.
 */
export async function spawnFromTemplate(
  o: SpawnOptions & { prelaunched?: Prelaunched },
): Promise<Result<Spawned>> {
  const t = o.template;
  let pre = o.prelaunched;
  // One launched for another template (or an older build of this one), for another id, or dead.
  const stale = (p: Prelaunched) =>
    p.template !== t ||
    (o.id !== undefined && o.id !== p.vm.id) ||
    !p.process.isAlive() ||
    p.vm.state !== "starting";
  if (pre && stale(pre)) {
    await pre.discard();
    pre = undefined;
  }
  const hit = pre !== undefined;
  if (!pre) {
    const r = await prelaunchFromTemplate(o);
    if (!r.ok) return r;
    pre = r.value;
  }
  const { vm, process: proc } = pre;
  const tLaunch = performance.now();
  // A cold spawn's timings start where its QEMU's launch did; a pre-launched one's at the take.
  const t0 = hit ? tLaunch : tLaunch - pre.launchMs;
  try {
    const timings = await finishRestore(
      {
        vm,
        mem: { path: t.memPath, share: false },
        statePath: t.statePath,
        ignoreShared: true,
        ...(o.readyTimeoutMs ? { readyTimeoutMs: o.readyTimeoutMs } : {}),
      },
      proc,
      t0,
      tLaunch,
    );
    vm.enter("running");
    o.log?.(
      `spawned ${vm.id} from ${t.id}${hit ? " (pre-launched)" : ""}: cont at ${timings.forkMs.toFixed(0)} ms, ready at ${timings.readyMs.toFixed(0)} ms`,
    );
    return ok({ vm, timings });
  } catch (err) {
    await vm.destroy();
    return fail(asSnapshotError(err, "spawn_failed", `spawning from template ${t.id} failed`));
  }
}

export interface FloorTimings {
  /** QEMU spawn to the guest's answer to PING. */
  totalMs: number;
  /** QEMU spawn to `cont` answered. */
  contMs: number;
}

/**
 * A bare restore of the template: the argv of launchVm, then a minimal QMP conversation written
 * out here (capabilities, migrate-incoming on a unix socket, the state file written into it, poll
 * query-migrate, cont) and one HELLO + PING on the agent socket. No retries, no identity, no
 * bookkeeping. The VM is killed and its files removed.
 */
export async function floorRestoreMs(o: {
  dataDir: string;
  template: TemplateMeta;
  host?: VmHostSettings;
}): Promise<FloorTimings> {
  const t = o.template;
  const root = join(resolve(o.dataDir), "tmp");
  await mkdir(root, { recursive: true, mode: 0o700 });
  const dir = await mkdtemp(join(root, "floor-"));
  const disk = join(dir, "disk.qcow2");
  await createOverlayOn(t.disk, disk, t.diskBytes);
  // Jailed exactly as launchVm jails a spawn (uid, cgroup, ownership, namespaces, pivot_root,
  // seccomp), the jail's preparation inside the timing as it is inside a spawn's, so
  // spawn_vs_floor compares like with like.
  const t0 = performance.now();
  const launch = await jailedLaunchArgv({
    dir,
    artifacts: t.artifacts,
    disk,
    memMib: t.memMib,
    vcpus: t.vcpus,
    accel: t.accel,
    hostname: "floor",
    memBackend: { path: t.memPath, share: false },
    incoming: true,
    paused: true,
    ...(o.host ? { jail: o.host.jail } : {}),
  });
  const [cmd, ...argv] = launch.argv as [string, ...string[]];
  const child = spawn(cmd, argv, { stdio: "ignore", env: { ...JAIL_ENV } });
  let qmpSock: Socket | undefined;
  let agent: Socket | undefined;
  let incoming: Socket | undefined;
  try {
    qmpSock = await connectRetry(join(dir, "qmp.sock"));
    const q = lineReader(qmpSock);
    await q.next(); // greeting
    const cmd = async (execute: string, args?: unknown) => {
      qmpSock?.write(`${JSON.stringify({ execute, arguments: args })}\n`);
      for (;;) {
        const m = JSON.parse(await q.next()) as { return?: unknown; error?: unknown; event?: string };
        if (m.event) continue;
        if (m.error) throw new SandboxdError("internal", `${execute}: ${JSON.stringify(m.error)}`);
        return m.return;
      }
    };
    await cmd("qmp_capabilities");
    await cmd("migrate-set-capabilities", { capabilities: [{ capability: "x-ignore-shared", state: true }] });
    const migrateSock = join(dir, "mig-in.sock");
    await cmd("migrate-incoming", { uri: `unix:${migrateSock}` });
    incoming = await connectRetry(migrateSock);
    incoming.end(await readFile(t.statePath));
    for (;;) {
      const r = (await cmd("query-migrate")) as { status?: string };
      if (r.status === "completed") break;
      if (r.status === "failed") throw new SandboxdError("internal", "floor restore: migration failed");
      await Bun.sleep(1);
    }
    agent = await connectRetry(join(dir, "agent.sock"));
    const a = frameWaiter(agent);
    agent.write(encodeFrame(FrameType.HELLO, 0, new TlvWriter().u32(Tag.PROTO_VERSION, 1).finish()));
    await cmd("cont");
    const contMs = performance.now() - t0;
    await a.waitType(FrameType.HELLO);
    agent.write(encodeFrame(FrameType.REQUEST, 1, new TlvWriter().u32(Tag.OP, Op.PING).finish()));
    await a.waitType(FrameType.RESPONSE);
    return { totalMs: performance.now() - t0, contMs };
  } finally {
    agent?.destroy();
    incoming?.destroy();
    qmpSock?.destroy();
    // QEMU first: unshare, its parent, reaps it and exits (as launchVm's stop does).
    const qemuPid = await readHostPid(dir);
    const exited = new Promise((r) =>
      child.exitCode !== null || child.signalCode !== null ? r(null) : child.once("exit", r),
    );
    if (qemuPid !== undefined) {
      try {
        process.kill(qemuPid, "SIGKILL");
      } catch {
        // already gone
      }
    }
    await Promise.race([exited, Bun.sleep(5_000)]);
    child.kill("SIGKILL");
    await exited;
    await launch.release();
    await rm(dir, { recursive: true, force: true });
  }
}

async function connectRetry(path: string, timeoutMs = 10_000): Promise<Socket> {
  const deadline = performance.now() + timeoutMs;
  for (;;) {
    try {
      return await new Promise<Socket>((res, rej) => {
        const s = createConnection({ path });
        s.once("connect", () => {
          s.removeAllListeners("error");
          res(s);
        });
        s.once("error", rej);
      });
    } catch (err) {
      if (performance.now() > deadline) throw err;
      await Bun.sleep(2);
    }
  }
}

function lineReader(s: Socket): { next(): Promise<string> } {
  let buf = "";
  const lines: string[] = [];
  let wake: (() => void) | undefined;
  s.on("data", (d: Buffer) => {
    buf += d.toString();
    let i = buf.indexOf("\n");
    while (i >= 0) {
      lines.push(buf.slice(0, i));
      buf = buf.slice(i + 1);
      i = buf.indexOf("\n");
    }
    wake?.();
  });
  return {
    async next() {
      while (lines.length === 0) await new Promise<void>((r) => (wake = r));
      return lines.shift() as string;
    },
  };
}

function frameWaiter(s: Socket): { waitType(type: number): Promise<void> } {
  let buf = Buffer.alloc(0);
  const seen: number[] = [];
  let wake: (() => void) | undefined;
  s.on("data", (d: Buffer) => {
    buf = Buffer.concat([buf, d]);
    while (buf.length >= 12) {
      const len = buf.readUInt32LE(8);
      if (buf.length < 12 + len) break;
      seen.push(buf.readUInt8(3));
      buf = buf.subarray(12 + len);
    }
    wake?.();
  });
  return {
    async waitType(type: number) {
      for (;;) {
        const i = seen.indexOf(type);
        if (i >= 0) {
          seen.splice(0, i + 1);
          return;
        }
        await new Promise<void>((r) => (wake = r));
      }
    },
  };
}
