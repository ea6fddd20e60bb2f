import { join } from "node:path";
import { SandboxdError } from "../../contracts/errors.ts";
import type { GuestArtifacts } from "../guest/artifacts.ts";
import { GuestClient } from "../guest/client.ts";
import type { ImportedImage } from "../image/import.ts";
import { consoleTail } from "../qemu/console.ts";
import type { JailSettings } from "../qemu/jail-setup.ts";
import { launchVm, type VmProcess } from "../qemu/launch.ts";
import { createOverlayOn } from "../storage/qcow2.ts";
import { newVmId } from "./ids.ts";
import { claimVm } from "./process.ts";
import { createVmDir, removeVmDir } from "./workdir.ts";

export interface BootOptions {
  dataDir: string;
  image: ImportedImage;
  artifacts: GuestArtifacts;
  accel: "kvm" | "tcg";
  memMib: number;
  vcpus: number;
  /** Bring-up deadline: QEMU start to the guest agent's HELLO. */
  bringupTimeoutMs: number;
  id?: string;
  /** The operator's jail settings; default DEFAULT_JAIL. */
  jail?: JailSettings;
  log?: (msg: string) => void;
}

/** A booted VM with its guest agent connected; `destroy()` frees everything it owns. */
export interface BootedVm {
  id: string;
  dir: string;
  vm: VmProcess;
  guest: GuestClient;
  /** QEMU spawn to the first HELLO answer, ms. */
  bootMs: number;
  destroy(): Promise<void>;
}

/** How long one HELLO waits for its answer during boot: a booted guest answers in ~50 ms under TCG. */
const HELLO_WAIT_MS = 1000;
/** Pause between HELLO attempts when the socket refused us (QEMU not listening yet). */
const HELLO_RETRY_MS = 100;
/** How much of the console a boot failure carries in its details. */
const CONSOLE_TAIL_BYTES = 4000;

export async function bootVm(opts: BootOptions): Promise<BootedVm> {
  const id = opts.id ?? newVmId();
  const dir = await createVmDir(opts.dataDir, id);
  let vm: VmProcess | undefined;
  let guest: GuestClient | undefined;
  const destroy = async () => {
    guest?.close();
    if (vm) await vm.kill();
    await removeVmDir(dir);
  };
  try {
    const disk = join(dir, "disk.qcow2");
    await createOverlayOn(opts.image.disk, disk);
    const started = performance.now();
    vm = await launchVm({
      dir,
      artifacts: opts.artifacts,
      disk,
      memMib: opts.memMib,
      vcpus: opts.vcpus,
      accel: opts.accel,
      hostname: id,
      ...(opts.jail ? { jail: opts.jail } : {}),
    });
    await claimVm(dir, vm.pid, vm.jailUid);
    guest = await connectGuest(vm, opts.bringupTimeoutMs);
    const bootMs = performance.now() - started;
    opts.log?.(`vm ${id} booted under ${opts.accel} in ${bootMs.toFixed(0)} ms`);
    return { id, dir, vm, guest, bootMs, destroy };
  } catch (err) {
    await destroy();
    throw err;
  }
}

/**
 * Connects to the guest agent and waits for its HELLO. The agent socket exists as soon as QEMU
 * runs, but the guest answers only once its kernel has booted and PID 1 opened the port, so
 * HELLO is retried until the bring-up deadline. A QEMU that exits meanwhile fails at once.
 */
export async function connectGuest(
  vm: Pick<VmProcess, "agentSocket" | "exited" | "consoleLog">,
  timeoutMs: number,
  opts: { onLog?: (line: string) => void } = {},
): Promise<GuestClient> {
  const deadline = performance.now() + timeoutMs;
  let exited = false;
  vm.exited.then(() => {
    exited = true;
  });
  let lastErr: unknown;
  while (performance.now() < deadline) {
    if (exited) throw await vmDiedError(vm, lastErr);
    let client: GuestClient | undefined;
    try {
      // connect() sends HELLO. Bytes written before PID 1 opens the port are dropped by QEMU (no
      // guest side to deliver to), so a HELLO sent during boot is never answered: wait a short
      // while for the answer, then reconnect and send a fresh HELLO, until the deadline.
      const remaining = Math.max(1, deadline - performance.now());
      client = await GuestClient.connect(vm.agentSocket, {
        helloTimeoutMs: Math.min(remaining, HELLO_WAIT_MS),
        onLog: opts.onLog,
      });
      return client;
    } catch (err) {
      lastErr = err;
      client?.close();
      await Bun.sleep(HELLO_RETRY_MS);
    }
  }
  if (exited) throw await vmDiedError(vm, lastErr);
  throw new SandboxdError("bringup_timeout", `guest agent did not answer within ${timeoutMs} ms`, {
    cause: lastErr,
    details: { console: await vmConsoleTail(vm) },
  });
}

async function vmDiedError(
  vm: Pick<VmProcess, "exited" | "consoleLog">,
  cause: unknown,
): Promise<SandboxdError> {
  const status = await vm.exited;
  return new SandboxdError("spawn_failed", `QEMU exited during boot (${JSON.stringify(status)})`, {
    cause,
    details: { console: await vmConsoleTail(vm) },
  });
}

function vmConsoleTail(vm: Pick<VmProcess, "consoleLog">): Promise<string> {
  return consoleTail(vm.consoleLog, CONSOLE_TAIL_BYTES);
}
