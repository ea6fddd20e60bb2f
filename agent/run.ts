import { ensureGuestArtifacts } from "./guest/artifacts.ts";
import { importImage, resolveCommand } from "./image/import.ts";
import { probeAccelerator } from "./qemu/accel.ts";
import { bootVm } from "./vm/boot.ts";
import { DEFAULT_VM_HOST, type VmHostSettings } from "./vm/host-settings.ts";
import { reapOrphanVms } from "./vm/workdir.ts";

export interface RunOnceOptions {
  dataDir: string;
  image: string;
  /** CMD as `docker run IMAGE CMD...` takes it; empty = the image's Entrypoint+Cmd. */
  cmd: string[];
  memMib: number;
  vcpus: number;
  timeoutSec: number;
  stdin?: Buffer;
  log?: (msg: string) => void;
  onStdout?: (chunk: Buffer) => void;
  onStderr?: (chunk: Buffer) => void;
  /** Aborting kills the command's process group and tears the VM down. */
  signal?: AbortSignal;
  /** The operator's `SANDBOXD_ACCEL` (auto, kvm, tcg); default auto, the probe. */
  accelSetting?: string;
  /** The operator's jail and disk-reserve settings; default DEFAULT_VM_HOST. */
  host?: VmHostSettings;
}

export interface RunOnceResult {
  exitCode: number | null;
  signal: number | null;
  timedOut: boolean;
  timings: { importMs: number; bootMs: number; execMs: number; totalMs: number };
  accel: "kvm" | "tcg";
}

/** Bring-up deadline for a cold boot: TCG boots in ~3 s here; 60 s leaves room for a loaded CI host. */
const COLD_BOOT_TIMEOUT_MS = 60_000;

/**
 * `sandboxd run`: import the image (cached by digest), boot a fresh VM on a private overlay,
 * run the command as the image's config says, stream its output, and remove every trace.
 */
export async function runOnce(opts: RunOnceOptions): Promise<RunOnceResult> {
  const t0 = performance.now();
  const host = opts.host ?? DEFAULT_VM_HOST;
  await reapOrphanVms(opts.dataDir, host.jail.uidRange);
  const [artifacts, accel, image] = await Promise.all([
    ensureGuestArtifacts({ dataDir: opts.dataDir, log: opts.log }),
    probeAccelerator({
      log: opts.log,
      ...(opts.accelSetting !== undefined ? { setting: opts.accelSetting } : {}),
    }),
    // The operator's own file on the command line.
    importImage({
      source: opts.image,
      dataDir: opts.dataDir,
      log: opts.log,
      trustedSource: true,
      diskReserveBytes: host.diskReserveBytes,
    }),
  ]);
  const importMs = performance.now() - t0;
  const argv = resolveCommand(image.config, opts.cmd);
  const booted = await bootVm({
    dataDir: opts.dataDir,
    image,
    artifacts,
    accel: accel.accel,
    memMib: opts.memMib,
    vcpus: opts.vcpus,
    bringupTimeoutMs: COLD_BOOT_TIMEOUT_MS,
    jail: host.jail,
    log: opts.log,
  });
  const onAbort = () => void booted.destroy();
  opts.signal?.addEventListener("abort", onAbort, { once: true });
  try {
    const t1 = performance.now();
    const res = await booted.guest.exec({
      argv,
      env: image.config.env,
      cwd: image.config.workingDir,
      uid: image.config.user.uid,
      gid: image.config.user.gid,
      timeoutMs: opts.timeoutSec * 1000,
      stdin: opts.stdin,
      onStdout: opts.onStdout,
      onStderr: opts.onStderr,
    });
    const execMs = performance.now() - t1;
    return {
      exitCode: res.exitCode,
      signal: res.signal,
      timedOut: res.timedOut,
      accel: accel.accel,
      timings: { importMs, bootMs: booted.bootMs, execMs, totalMs: performance.now() - t0 },
    };
  } finally {
    opts.signal?.removeEventListener("abort", onAbort);
    await booted.destroy();
  }
}
