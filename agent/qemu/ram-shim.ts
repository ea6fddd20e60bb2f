/**
 * The library every jailed QEMU preloads (ram-readonly.c): it turns QEMU 7.2's read-write open of
 * a shared RAM file (a template's, a fork point's) into a read-only one, so that such a file can
 * be root's, 0444 and bound read-only into each child's jail. Built from its C source with the
 * host's gcc (bin/sandboxd installs it; the library must link against the glibc QEMU uses), once
 * per source: the file is named by the source's hash, so an edited source is a new build and a
 * built one is never rebuilt.
 */
import { createHash } from "node:crypto";
import { chmod, mkdir, readFile, rename, rm, stat } from "node:fs/promises";
import { join, resolve } from "node:path";
import { SandboxdError } from "../../contracts/errors.ts";
import { runTool } from "../host/tool.ts";

const SOURCE = join(import.meta.dir, "ram-readonly.c");
const BUILD_DIR = join(resolve(import.meta.dir, "..", ".."), "build", "host");
/** gcc on one 100-line file takes ~100 ms; the bound only absorbs a badly overloaded host. */
const BUILD_TIMEOUT_MS = 60_000;

/** Where, inside a jail, the shim's list (the one path it opens read-only) is read from. */
export const JAIL_READONLY_RAM_LIST = "/etc/sandboxd/readonly-ram";
/**
 * Where, inside a jail, the shim reads the guest's RAM size when QEMU's own memory may be merged
 * by KSM (SANDBOXD_KSM=qemu); absent, nothing is offered to KSM.
 */
export const JAIL_KSM_SETTING = "/etc/sandboxd/ksm";
/** glibc's dynamic loader preloads every library this file names, in every program it starts. */
export const JAIL_LD_PRELOAD = "/etc/ld.so.preload";

let built: Promise<string> | undefined;

/** The shim's path, built first if needed (once per process; a failed build is tried again). */
export function ensureRamShim(): Promise<string> {
  built ??= build().catch((err) => {
    built = undefined;
    throw err;
  });
  return built;
}

async function build(): Promise<string> {
  const source = await readFile(SOURCE);
  const out = join(
    BUILD_DIR,
    `ram-readonly-${createHash("sha256").update(source).digest("hex").slice(0, 16)}.so`,
  );
  if (
    await stat(out).then(
      (s) => s.isFile(),
      () => false,
    )
  )
    return out;
  await mkdir(BUILD_DIR, { recursive: true });
  const tmp = `${out}.${process.pid}.tmp`;
  try {
    await runTool(["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o", tmp, SOURCE], {
      timeoutMs: BUILD_TIMEOUT_MS,
      captureStdout: false,
    });
    // Read by every jail's uid (the jails bind it read-only); the umask may have left it 0700.
    await chmod(tmp, 0o755);
    await rename(tmp, out);
  } catch (err) {
    await rm(tmp, { force: true });
    throw new SandboxdError(
      "vm_launch_failed",
      `cannot build the jail's RAM-file shim (${SOURCE}) with gcc: install gcc`,
      { cause: err },
    );
  }
  return out;
}
