/**
 * Helpers for the tests that drive REAL VMs through the manager (tests/vm/agent-*.test.ts and their kin): the
 * busybox fixture image as a docker-archive, a private state dir per test, and the leak check
 * every such test ends with (no QEMU, socket or VM directory left behind). Test code only.
 */
import { mkdtemp, readdir, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { ensureGuestArtifacts } from "../../agent/guest/artifacts.ts";
import type { JailSettings } from "../../agent/qemu/jail-setup.ts";
import type { HostCapacity } from "../../agent/sandbox/capacity.ts";
import { SnapshotDriver } from "../../agent/sandbox/drivers/snapshot.ts";
import { SandboxManager } from "../../agent/sandbox/manager.ts";
import { DEFAULT_VM_HOST } from "../../agent/vm/host-settings.ts";
import { qemuPidsNaming } from "../../agent/vm/process.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { busyboxImageSpec, makeDockerArchive } from "../fixtures/images.ts";

const REPO = resolve(import.meta.dir, "../..");
/** Guest artifacts and imported images are cached here across runs (kernel download, agent build). */
export const TEST_CACHE_DIR = process.env.SANDBOXD_TEST_DATA ?? join(REPO, ".data", "test");

let archive: { dir: Promise<string>; path: Promise<string> } | undefined;

/** The canonical busybox docker-archive, built once per test file in a temp dir. */
export function busyboxArchive(): Promise<string> {
  if (!archive) {
    const dir = mkdtemp(join(tmpdir(), "sbx-img-"));
    const path = dir.then(async (d) => {
      const spec = await busyboxImageSpec(d);
      const built = await makeDockerArchive(join(d, "busybox.tar"), spec);
      await rm(join(d, "busybox-rootfs"), { recursive: true, force: true });
      return built.path;
    });
    archive = { dir, path };
  }
  return archive.path;
}

/** Removes the archive's temp dir; call from `afterAll`. */
export async function removeBusyboxArchive(): Promise<void> {
  const a = archive;
  archive = undefined;
  if (a) await rm(await a.dir, { recursive: true, force: true });
}

/** A fresh state dir (records + VM dirs) under /tmp: short paths keep unix sockets < 108 bytes. */
export function tempStateDir(): Promise<string> {
  return mkdtemp(join(tmpdir(), "sbx-state-"));
}

/** Pids of the QEMUs whose arguments name a path inside `dir` (zombies have exited: not listed). */
export function qemuPidsUnder(dir: string): Promise<number[]> {
  return qemuPidsNaming([dir]);
}

/** What a state dir still holds: live QEMUs and VM directories (sockets live inside them). */
export async function leftovers(stateDir: string): Promise<{ qemus: number[]; vmDirs: string[] }> {
  let vmDirs: string[] = [];
  try {
    vmDirs = await readdir(join(stateDir, "vms"));
  } catch {
    vmDirs = [];
  }
  return { qemus: await qemuPidsUnder(stateDir), vmDirs };
}

/** Polls until `cond` holds or `timeoutMs` passes; returns whether it held. */
export async function waitFor(cond: () => boolean | Promise<boolean>, timeoutMs: number): Promise<boolean> {
  const deadline = performance.now() + timeoutMs;
  while (performance.now() < deadline) {
    if (await cond()) return true;
    await Bun.sleep(25);
  }
  return cond();
}

/** The code a call fails with ("ok" when it succeeds), for one-line expectations on refusals. */
export async function codeOf(p: Promise<unknown>): Promise<string> {
  try {
    await p;
    return "ok";
  } catch (err) {
    return err instanceof SandboxdError ? err.code : `not a SandboxdError: ${String(err)}`;
  }
}

/**
 * A manager on a snapshot driver in `stateDir` (guest artifacts from the test cache) with the
 * busybox template `bb` of `memMib` built and ready: the setup of the tests that fill a disk.
 */
export async function managerWithBusybox(o: {
  stateDir: string;
  cacheDir: string;
  memMib: number;
  shmRoot?: string;
  /** The free-space reserve (`SANDBOXD_DISK_RESERVE_BYTES`) of a test that fills a small filesystem. */
  diskReserveBytes?: number;
  log?: (line: string) => void;
  /** The host's admission limits (`SANDBOXD_VM_MEMORY_BYTES` is `memMib`); the defaults otherwise. */
  capacity?: Partial<HostCapacity>;
  /** The operator's jail settings (`SANDBOXD_KSM`, ...); the defaults otherwise. */
  jail?: Partial<JailSettings>;
}): Promise<SandboxManager> {
  const host = {
    ...DEFAULT_VM_HOST,
    ...(o.diskReserveBytes !== undefined ? { diskReserveBytes: o.diskReserveBytes } : {}),
    jail: { ...DEFAULT_VM_HOST.jail, ...o.jail },
  };
  const driver = await SnapshotDriver.create({
    cacheDir: o.cacheDir,
    stateDir: o.stateDir,
    ...(o.shmRoot !== undefined ? { shmRoot: o.shmRoot } : {}),
    host,
    artifacts: await ensureGuestArtifacts({ dataDir: TEST_CACHE_DIR }),
    ...(o.log !== undefined ? { log: o.log } : {}),
  });
  const m = await SandboxManager.open({
    driver,
    stateDir: o.stateDir,
    ...(o.capacity !== undefined ? { capacity: o.capacity } : {}),
  });
  m.buildTemplate("bb", { kind: "archive", path: await busyboxArchive() }, { memMib: o.memMib });
  await m.templates.settled("bb");
  const st = m.templates.status("bb");
  if (st.status !== "ready") throw new Error(`template bb: ${st.status}: ${st.error ?? ""}`);
  return m;
}

/** A shell command in sandbox `id`: its stdout, or a throw naming the exit code and stderr. */
export async function shellIn(m: Pick<SandboxManager, "exec">, id: string, command: string): Promise<string> {
  const r = await m.exec(id, { files: [], run: { kind: "shell", command } });
  if (r.exitCode !== 0) throw new Error(`${command}: exit ${r.exitCode}: ${r.stderr}`);
  return r.stdout;
}

/**
 * A guest process counting up in /tmp/c ten times a second, for tests that check a VM's running
 * state survives a fork, suspend or restart. Each value is written to a new file and renamed over
 * the old one: a plain `echo > /tmp/c` truncates first, and a snapshot taken between the
 * truncation and the write gave a restored child an empty file to read (a flaky 0).
 */
export const COUNTER =
  "sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/c.new && mv /tmp/c.new /tmp/c; sleep 0.1; done' >/dev/null 2>&1 &";
