/**
 * Free-space checks for everything that writes a large file: the gateway's upload staging and,
 * on the agent, uploads, registry pulls, imports, suspends and template builds. Each asks before
 * it writes (`requireFreeSpace`: what it will write plus a reserve), so a short disk is refused
 * with `insufficient_storage` (507) before a byte lands, and a write that still meets ENOSPC
 * (another writer was faster) is turned into the same error by `asNoSpace` after its caller
 * removed the partial file. The reserve keeps room for what must not fail when the disk is tight:
 * the database (it shares the disk), VM records, console rings and running VMs' overlays.
 */
import { statfsSync } from "node:fs";
import { statfs } from "node:fs/promises";
import { dirname } from "node:path";
import { SandboxdError } from "./errors.ts";

/** Default free space kept back on every data filesystem (`SANDBOXD_DISK_RESERVE_BYTES`). */
export const DEFAULT_DISK_RESERVE_BYTES = 256 * 1024 * 1024;

/** A non-negative integer byte count from the environment, else `fallback`; junk is an error. */
export function bytesSetting(
  env: Record<string, string | undefined>,
  name: string,
  fallback: number,
): number {
  const raw = env[name];
  if (raw === undefined || raw.trim() === "") return fallback;
  const n = Number(raw);
  if (!Number.isSafeInteger(n) || n < 0)
    throw new SandboxdError("bad_request", `${name} must be a byte count, got ${JSON.stringify(raw)}`);
  return n;
}

/** Bytes an unprivileged writer may still use on the filesystem holding `path`. */
export async function freeBytes(path: string): Promise<number> {
  // The nearest existing ancestor: callers ask before they create their directory.
  let p = path;
  for (;;) {
    try {
      const s = await statfs(p);
      return s.bavail * s.bsize;
    } catch (err) {
      const parent = dirname(p);
      if ((err as NodeJS.ErrnoException).code !== "ENOENT" || parent === p) throw err;
      p = parent;
    }
  }
}

/**
 * `freeBytes`, synchronous: for a check that must not yield between the reading and its decision
 * (admission counts what is held and what is free in one step).
 */
export function freeBytesSync(path: string): number {
  let p = path;
  for (;;) {
    try {
      const s = statfsSync(p);
      return s.bavail * s.bsize;
    } catch (err) {
      const parent = dirname(p);
      if ((err as NodeJS.ErrnoException).code !== "ENOENT" || parent === p) throw err;
      p = parent;
    }
  }
}

export interface SpaceNeed {
  /** What is about to be written, for the message: "the image upload", "suspending vm-1". */
  what: string;
  /** Bytes it will write (an estimate from above). */
  bytes: number;
  /** Free space that must remain afterwards. */
  reserveBytes: number;
}

/** How free space is measured: `freeBytes` (statfs); tests pass their own. */
export type FreeBytes = (path: string) => Promise<number>;

/**
 * Throws `insufficient_storage` unless the filesystem holding `path` has `need.bytes` plus the
 * reserve free. Never writes anything.
 */
export async function requireFreeSpace(
  path: string,
  need: SpaceNeed,
  measure: FreeBytes = freeBytes,
): Promise<void> {
  const free = await measure(path);
  const want = need.bytes + need.reserveBytes;
  if (free < want) {
    throw new SandboxdError(
      "insufficient_storage",
      `not enough disk space for ${need.what}: ${mib(need.bytes)} MiB needed plus a ${mib(need.reserveBytes)} MiB reserve, ${mib(free)} MiB free`,
      { details: { needBytes: need.bytes, reserveBytes: need.reserveBytes, freeBytes: free } },
    );
  }
}

/** `requireFreeSpace` in positional form: the agent's, its reserve from `SANDBOXD_DISK_RESERVE_BYTES`. */
export function needFreeSpace(
  path: string,
  what: string,
  bytes: number,
  reserveBytes: number,
  measure: FreeBytes = freeBytes,
): Promise<void> {
  return requireFreeSpace(path, { what, bytes, reserveBytes }, measure);
}

/** How a tool (skopeo, mkfs, qemu-img) says it: strerror(ENOSPC) and strerror(EDQUOT). */
const NO_SPACE_TEXT = /no space left on device|disk quota exceeded/i;

/** True for a write that failed because the filesystem (or the quota on it) is full. */
export function isNoSpace(err: unknown): boolean {
  if (typeof err === "string") return NO_SPACE_TEXT.test(err);
  for (let e: unknown = err, i = 0; e && i < 8; e = (e as { cause?: unknown }).cause, i++) {
    const code = (e as NodeJS.ErrnoException).code;
    if (code === "ENOSPC" || code === "EDQUOT") return true;
    const msg = e instanceof Error ? e.message : "";
    if (NO_SPACE_TEXT.test(msg)) return true;
  }
  return false;
}

/** `err` as `insufficient_storage` when it is a full disk; otherwise `err` itself. */
export function asNoSpace(err: unknown, what: string): unknown {
  if (err instanceof SandboxdError && err.code === "insufficient_storage") return err;
  if (!isNoSpace(err)) return err;
  return new SandboxdError("insufficient_storage", `not enough disk space for ${what}: the disk filled up`, {
    cause: err,
  });
}

function mib(n: number): string {
  return (n / (1024 * 1024)).toFixed(1);
}
