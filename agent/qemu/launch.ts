import { type ChildProcess, spawn } from "node:child_process";
import { readFile, rm } from "node:fs/promises";
import { constants as osConstants } from "node:os";
import { SandboxdError } from "../../contracts/errors.ts";
import { buildQemuArgs, type LaunchOptions, vmPaths } from "./args.ts";
import { type ConsoleDrain, consoleTail, startConsoleDrain } from "./console.ts";
import { JAIL_ENV, jailArgv, sandboxOption } from "./jail.ts";
import { prepareJail, releaseJail } from "./jail-setup.ts";
import { QmpClient } from "./qmp/client.ts";

export {
  type Accel,
  buildQemuArgs,
  DEVICE_IDS,
  isHostnameLabel,
  kernelCmdline,
  type LaunchOptions,
  type MemBackend,
  machineArgs,
  vmPaths,
} from "./args.ts";

/**
 * Starts one QEMU `microvm` for one sandbox (its command line: args.ts). Everything the VM owns on the host lives in its own
 * directory (`dir`): the QMP, agent and console sockets, the console log (console.ts) and `qemu.pid`, so that
 * killing the process and removing the directory frees it all (agent/vm/workdir.ts reclaims the
 * directories of a crashed agent through `qemu.pid`).
 */

export const QEMU_BINARY = "qemu-system-x86_64";

/**
 * Budget from spawn to a negotiated QMP connection. QEMU reaches its greeting in ~25-35 ms on
 * 2-core TCG hosts; 10 s only absorbs a badly overloaded CI machine. Past it, QEMU is
 * stuck, and the launch fails (and kills it) instead of hanging the caller.
 */
const QMP_CONNECT_TIMEOUT_MS = 10_000;

/** How long to wait for QEMU's exit status after its QMP socket hung up during start. */
const EXIT_AFTER_HANGUP_MS = 1_000;

/** How much of QEMU's stderr and of the console we keep for error messages. */
const STDERR_TAIL_BYTES = 8192;
const CONSOLE_TAIL_BYTES = 4096;

/**
 * Removes what a QEMU leaves in its directory once it is gone (its sockets and pid file): stale
 * sockets would make the next QEMU's connect reach nothing, a stale pid file names a dead pid.
 */
export async function removeQemuFiles(dir: string): Promise<void> {
  const { qmpSocket, agentSocket, consoleSocket, pidFile, hostPidFile } = vmPaths(dir);
  await Promise.all(
    [qmpSocket, agentSocket, consoleSocket, pidFile, hostPidFile].map((p) => rm(p, { force: true })),
  );
}

export interface VmExit {
  code: number | null;
  signal: NodeJS.Signals | null;
}

export interface VmProcess {
  pid: number;
  dir: string;
  qmp: QmpClient;
  agentSocket: string;
  consoleLog: string;
  pidFile: string;
  /** Resolves when QEMU has exited (never rejects). */
  exited: Promise<VmExit>;
  /** SIGKILL, wait for the exit, close QMP, remove the sockets and pid file. Idempotent. */
  kill(): Promise<void>;
  isAlive(): boolean;
  /** Last bytes QEMU wrote to stderr (for diagnostics). */
  stderrTail(): string;
  /** The uid its jail runs it as (recorded in the VM's owner record for adoption). */
  jailUid?: number;
  /**
   * How a migration socket the agent listens on must be made for this QEMU to connect to it:
   * owned by its jail's uid (agent/snapshot/stream.ts).
   */
  migrationSocket?: { mode: number; uid: number; gid: number };
}

/** QEMU exited or never answered while starting. Carries what QEMU and the guest said last. */
export class VmLaunchError extends SandboxdError {
  constructor(
    message: string,
    details: { stderrTail: string; consoleTail: string; exit?: VmExit },
    cause?: unknown,
  ) {
    const tails = [
      details.stderrTail.trim() && `qemu stderr:\n${details.stderrTail.trim()}`,
      details.consoleTail.trim() && `console:\n${details.consoleTail.trim()}`,
    ]
      .filter(Boolean)
      .join("\n");
    super("vm_launch_failed", tails ? `${message}\n${tails}` : message, { cause, details });
    this.name = "VmLaunchError";
  }
}

/**
 * QEMU 7.2 has no `-run-with` to tie its life to ours, so the jail is started through `setpriv
 * --pdeathsig KILL` (util-linux): the kernel SIGKILLs it when the process that spawned it dies,
 * even by SIGKILL, and the jail's own parent-death signal takes QEMU with it. `dieWithParent:
 * false` skips it (the agent's sandboxes, re-adopted after a restart).
 */
const SETPRIV = "/usr/bin/setpriv";

/** How long unshare may take to exit after its QEMU was killed (it follows within milliseconds). */
const UNSHARE_EXIT_WAIT_MS = 5_000;

/** How long the jail may take to write QEMU's host pid after QMP answered (it writes it first). */
const HOST_PID_WAIT_MS = 2_000;

/** The argv (program first) of QEMU with the seccomp sandbox every jailed QEMU runs under. */
export function sandboxedQemuArgv(opts: LaunchOptions): string[] {
  return [QEMU_BINARY_PATH, ...buildQemuArgs(opts), "-sandbox", sandboxOption()];
}

/** The absolute path of QEMU: the jail has no PATH search to rely on. */
export const QEMU_BINARY_PATH = `/usr/bin/${QEMU_BINARY}`;

/**
 * Readies the jail of `opts`'s VM (uid, cgroup, file ownership) and returns the argv that starts
 * its QEMU in it, wrapped for `dieWithParent`. Throws JailError (`vm_launch_failed`) when an
 * ingredient is missing; `release` frees what it took once QEMU is gone.
 */
export async function jailedLaunchArgv(
  opts: LaunchOptions,
): Promise<{ argv: string[]; uid: number; release: () => Promise<void> }> {
  const { dir } = opts;
  const jail = await prepareJail({
    dir,
    vmlinux: opts.artifacts.vmlinux,
    initramfs: opts.artifacts.initramfs,
    ...(opts.disk ? { disk: opts.disk } : {}),
    ...(opts.backing ? { backing: opts.backing } : {}),
    ...(opts.memBackend ? { mem: opts.memBackend } : {}),
    memMib: opts.memMib,
    vcpus: opts.vcpus,
    kvm: opts.accel === "kvm",
    hostPidFile: vmPaths(dir).hostPidFile,
    ...(opts.jail ? { settings: opts.jail } : {}),
  });
  const argv = jailArgv(jail.spec, sandboxedQemuArgv(opts));
  const dieWithParent = opts.dieWithParent ?? true;
  return {
    argv: dieWithParent ? [SETPRIV, "--pdeathsig", "KILL", "--", ...argv] : argv,
    uid: jail.uid,
    release: () => releaseJail(dir, jail.uid),
  };
}

/** QEMU's host pid as the jail wrote it; undefined when it is not there (yet). */
export async function readHostPid(dir: string, waitMs = 0): Promise<number | undefined> {
  const deadline = performance.now() + waitMs;
  for (;;) {
    try {
      const text = (await readFile(vmPaths(dir).hostPidFile, "utf8")).trim();
      if (/^\d+$/.test(text) && Number(text) > 0) return Number(text);
    } catch {
      // not written yet
    }
    if (performance.now() >= deadline) return undefined;
    await Bun.sleep(5);
  }
}

export async function launchVm(opts: LaunchOptions): Promise<VmProcess> {
  const log = opts.log ?? (() => {});
  const { dir } = opts;
  const { qmpSocket, consoleSocket, consoleLog } = vmPaths(dir);
  // Left by an earlier QEMU in this directory.
  await removeQemuFiles(dir);

  const dieWithParent = opts.dieWithParent ?? true;
  const jail = await jailedLaunchArgv(opts);
  const [cmd, ...argv] = jail.argv as [string, ...string[]];
  log(
    `starting ${QEMU_BINARY} jailed as uid ${jail.uid} (${opts.accel}, ${opts.memMib} MiB, ${opts.vcpus} vCPU) in ${dir}`,
  );
  let child: ChildProcess;
  try {
    child = spawn(cmd, argv, {
      cwd: dir,
      env: { ...JAIL_ENV },
      detached: !dieWithParent,
      stdio: ["ignore", "ignore", "pipe"],
    });
  } catch (err) {
    await jail.release();
    throw err;
  }
  let qemuPid: number | undefined;
  // Connects while QMP does: a cold boot's QEMU waits for this reader before it goes on.
  const consoleDrain = startConsoleDrain(consoleSocket, consoleLog, log);

  const { started, exited, exitInfo, isAlive, stderrTail } = watchChild(child);

  const stop = async () => {
    qemuPid ??= await readHostPid(dir);
    if (isAlive() && qemuPid !== undefined) {
      // QEMU only: unshare, its parent, reaps it and then exits. Killing unshare too would leave
      // QEMU's exit status to whoever adopts orphans, and the pid visible until they collect it.
      killQuietly(qemuPid);
      await Promise.race([exited, Bun.sleep(UNSHARE_EXIT_WAIT_MS)]);
    }
    if (isAlive()) child.kill("SIGKILL"); // QEMU never started, or unshare did not follow it
    await exited;
    await jail.release();
  };
  const launchError = async (message: string, cause?: unknown) => {
    await stop();
    // Let the stderr pipe drain after the exit so the tail holds QEMU's last words.
    await new Promise((r) => setTimeout(r, 20));
    await consoleDrain.close();
    await removeQemuFiles(dir);
    return new VmLaunchError(
      message,
      {
        stderrTail: stderrTail(),
        consoleTail: await consoleTail(consoleLog, CONSOLE_TAIL_BYTES),
        ...(exitInfo() ? { exit: exitInfo() } : {}),
      },
      cause,
    );
  };

  let qmp: QmpClient;
  try {
    qmp = await QmpClient.connect(qmpSocket, {
      timeoutMs: QMP_CONNECT_TIMEOUT_MS,
      signal: started.signal,
      log,
    });
  } catch (err) {
    // QEMU dying closes the QMP socket, which may reach us before its exit status does; give
    // the exit a moment (it follows within milliseconds) so the error says what happened.
    await Promise.race([exited, new Promise((r) => setTimeout(r, EXIT_AFTER_HANGUP_MS))]);
    const exit = exitInfo();
    const why = exit
      ? `qemu exited during start (${exit.signal ?? `code ${exit.code}`})`
      : "qemu did not answer on QMP";
    throw await launchError(why, err);
  }
  qemuPid = await readHostPid(dir, HOST_PID_WAIT_MS);
  if (qemuPid === undefined) {
    qmp.close();
    throw await launchError("the jail did not report QEMU's host pid");
  }
  const pid = qemuPid;
  log(`qemu pid ${pid} (uid ${jail.uid}) up, QMP connected`);
  // QMP answering means every chardev exists: the drain is connected (or the QEMU has none),
  // before a restored guest is let run.
  await consoleDrain.ready;

  return vmProcess(pid, dir, qmp, exited, { stop, isAlive, stderrTail, consoleDrain }, jail.uid);
}

/**
 * Watches the spawned jail from its start: the tail of its stderr, and its exit, which also
 * aborts `started` (a launch waiting on QMP gives up at once).
 */
function watchChild(child: ChildProcess): {
  started: AbortController;
  exited: Promise<VmExit>;
  exitInfo: () => VmExit | undefined;
  isAlive: () => boolean;
  stderrTail: () => string;
} {
  let stderr = "";
  child.stderr?.on("data", (d: Buffer) => {
    stderr = (stderr + d.toString()).slice(-STDERR_TAIL_BYTES);
  });
  const started = new AbortController();
  let exitInfo: VmExit | undefined;
  const exited = new Promise<VmExit>((resolve) => {
    child.on("exit", (code, signal) => {
      exitInfo = jailExit(code, signal);
      started.abort(new Error(`qemu exited (${signal ?? `code ${code}`})`));
      resolve(exitInfo);
    });
    child.on("error", (err) => {
      // spawn itself failed (binary missing): there will be no exit event.
      stderr += `\n${err.message}`;
      exitInfo = { code: null, signal: null };
      started.abort(err);
      resolve(exitInfo);
    });
  });
  return {
    started,
    exited,
    exitInfo: () => exitInfo,
    isAlive: () => exitInfo === undefined,
    stderrTail: () => stderr,
  };
}

/**
 * QEMU's exit as the jail reports it: its pid 1 exits with 128 + the signal that killed QEMU
 * (jail.ts), which reads back as that signal.
 */
export function jailExit(code: number | null, signal: NodeJS.Signals | null): VmExit {
  if (code !== null && code > 128 && code < 128 + 65) {
    const name = Object.entries(osConstants.signals).find(([, n]) => n === code - 128)?.[0];
    if (name) return { code: null, signal: name as NodeJS.Signals };
  }
  return { code, signal };
}

function killQuietly(pid: number): void {
  try {
    process.kill(pid, "SIGKILL");
  } catch {
    // already gone
  }
}

/**
 * The `VmProcess` of a running QEMU, ours (launchVm) or adopted (agent/vm/process.ts): `stop`
 * kills it and waits for it; `kill` runs that once, then closes QMP and the console drain and
 * removes QEMU's files. An adopted QEMU's console is drained from here on (`consoleDrain` omitted:
 * a drain is started), so a VM that outlived its agent keeps a bounded console under the next one.
 */
export function vmProcess(
  pid: number,
  dir: string,
  qmp: QmpClient,
  exited: Promise<VmExit>,
  o: {
    stop: () => Promise<void>;
    isAlive: () => boolean;
    stderrTail: () => string;
    consoleDrain?: ConsoleDrain;
  },
  jailUid?: number,
): VmProcess {
  const { agentSocket, consoleSocket, consoleLog, pidFile } = vmPaths(dir);
  const consoleDrain = o.consoleDrain ?? startConsoleDrain(consoleSocket, consoleLog);
  // The console is drained while this process holds the QEMU's QMP: every way of letting go of a
  // QEMU (kill, its death, a detach that leaves it to the next agent) closes QMP, and a drain left
  // connected would keep QEMU's one console client slot from the agent that adopts it.
  void qmp.closed.then(() => consoleDrain.close());
  let killing: Promise<void> | undefined;
  const kill = () => {
    killing ??= (async () => {
      await o.stop();
      qmp.close();
      await consoleDrain.close();
      await removeQemuFiles(dir);
    })();
    return killing;
  };
  const { isAlive, stderrTail } = o;
  return {
    pid,
    dir,
    qmp,
    agentSocket,
    consoleLog,
    pidFile,
    exited,
    kill,
    isAlive,
    stderrTail,
    ...(jailUid === undefined
      ? {}
      : { jailUid, migrationSocket: { mode: 0o600, uid: jailUid, gid: jailUid } }),
  };
}
