/**
 * The steps of a template build (template.ts `buildTemplate`) once its VM is launched: waiting
 * for the guest, the ready command, saving the device state of the stopped VM, and registering
 * the frozen files with the chain store so that restores can hold them.
 */
import { SandboxdError } from "../../contracts/errors.ts";
import type { GuestClient } from "../guest/client.ts";
import type { ImageConfig } from "../image/import.ts";
import type { VmProcess } from "../qemu/launch.ts";
import { openChainStore } from "../storage/chain.ts";
import { connectGuest } from "../vm/boot.ts";
import { asSnapshotError, SnapshotError } from "./errors.ts";
import { qmp, setCapabilities } from "./migrate.ts";
import { migrationByteCap, saveToFile } from "./stream.ts";

/** Saving the device state of a stopped VM with shared RAM: ~11 ms; 60 s means QEMU is stuck. */
const SAVE_TIMEOUT_MS = 60_000;

/** The build VM's guest, once it answers; a guest late past `bringupMs` is `bringup_timeout`. */
export async function connectBuildGuest(vm: VmProcess, bringupMs: number): Promise<GuestClient> {
  try {
    return await connectGuest(vm, bringupMs);
  } catch (err) {
    // A guest that did not answer in time is the bring-up bound (sessions API `wait_secs`) running
    // out, a code the tenant's error names; anything else is a failed start.
    const late = err instanceof SandboxdError && err.code === "bringup_timeout";
    throw asSnapshotError(
      err,
      late ? "bringup_timeout" : "template_build_failed",
      `template VM did not come up within ${bringupMs} ms`,
    );
  }
}

/**
 * Runs the ready command in the image's env, cwd and user; a non-zero exit, a signal or the
 * deadline fails the build with `template_ready_failed` and the tail of its output.
 */
export async function runReadyCommand(
  guest: GuestClient,
  readyCmd: string[],
  config: ImageConfig,
  o: { timeoutMs: number; env: Record<string, string> | undefined; signal: AbortSignal | undefined },
): Promise<void> {
  const { timeoutMs } = o;
  const r = await guest.exec({
    argv: readyCmd,
    env: withEnv(config.env, o.env),
    cwd: config.workingDir,
    uid: config.user.uid,
    gid: config.user.gid,
    timeoutMs,
    ...(o.signal ? { signal: o.signal } : {}),
  });
  if (o.signal?.aborted) throw new SnapshotError("template_build_failed", "the build was cancelled");
  if (r.timedOut || r.exitCode !== 0) {
    const why = r.timedOut
      ? `timed out after ${timeoutMs} ms`
      : r.exitCode !== null
        ? `exited with code ${r.exitCode}`
        : `was killed by signal ${r.signal}`;
    throw new SnapshotError("template_ready_failed", `ready command ${JSON.stringify(readyCmd)} ${why}`, {
      details: {
        exitCode: r.exitCode,
        signal: r.signal,
        timedOut: r.timedOut,
        stdout: r.stdout.toString("utf8").slice(-2000),
        stderr: r.stderr.toString("utf8").slice(-2000),
      },
    });
  }
}

/** `KEY=value` list of the image with `extra` added; a key in both takes `extra`'s value. */
function withEnv(env: string[], extra: Record<string, string> | undefined): string[] {
  if (!extra || Object.keys(extra).length === 0) return env;
  const keep = env.filter((kv) => !Object.hasOwn(extra, kv.slice(0, Math.max(0, kv.indexOf("=")))));
  return [...keep, ...Object.entries(extra).map(([k, v]) => `${k}=${v}`)];
}

/**
 * Stops the VM and writes its device state to `statePath`, leaving its shared RAM out (the RAM is
 * already in its file); answers the state's size in bytes.
 */
export async function saveDeviceState(vm: VmProcess, statePath: string, memMib: number): Promise<number> {
  await qmp(vm, "stop");
  await setCapabilities(vm, { events: true, "x-ignore-shared": true });
  // No fsync: the state is useless without the RAM file on tmpfs, which a host crash loses
  // too; an agent crash leaves the written pages in the page cache.
  return await saveToFile(vm, {
    path: statePath,
    maxBytes: migrationByteCap(memMib),
    timeoutMs: SAVE_TIMEOUT_MS,
  });
}

/** Registers the template's frozen files with the chain store, held by `template:<id>`. */
export async function registerTemplateFiles(
  dataDir: string,
  id: string,
  files: { memPath: string; disk: string; statePath: string },
): Promise<void> {
  const chain = await openChainStore(dataDir);
  const holder = `template:${id}`;
  await chain.add(files.memPath, { kind: "ram", holder });
  await chain.add(files.disk, { kind: "overlay", holder, depth: 1 });
  await chain.add(files.statePath, { kind: "state", holder, deps: [files.memPath] });
}
