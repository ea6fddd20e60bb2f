/**
 * Hostile path checks (pure, or reading only the tree they check): tar entry names, symlink and
 * hardlink targets inside an archive's namespace, and lookups inside an unpacked rootfs that
 * must never leave it. Property-tested in paths.test.ts.
 */
import type { Stats } from "node:fs";
import { lstat, readlink } from "node:fs/promises";
import { join } from "node:path";

/**
 * Cleans a tar entry name into a root-relative path ('' = the root itself), or null when it is
 * unsafe: NUL bytes, any `..` component (no legitimate archive needs one, and refusing them all
 * means a later symlink can never turn `a/..` into an escape), or an absolute name where the
 * caller does not allow one. In layers absolute names are joined under the rootfs, as Docker does.
 */
export function normalizeEntryPath(name: string, opts: { allowAbsolute: boolean }): string | null {
  if (name.length === 0 || name.includes("\0")) return null;
  if (name.startsWith("/") && !opts.allowAbsolute) return null;
  const parts: string[] = [];
  for (const p of name.split("/")) {
    if (p === "" || p === ".") continue;
    if (p === "..") return null;
    parts.push(p);
  }
  return parts.join("/");
}

export function isSafeEntryPath(
  name: string,
  opts: { allowAbsolute: boolean } = { allowAbsolute: false },
): boolean {
  return normalizeEntryPath(name, opts) !== null;
}

/**
 * Resolves a relative symlink `target` found in directory `baseDir` (root-relative, already
 * clean) lexically; null when it is absolute or climbs above the root. The result never holds
 * `.` or `..` components, so joining it under any root stays inside that root.
 */
export function resolveInside(baseDir: string, target: string): string | null {
  if (target.length === 0 || target.includes("\0") || target.startsWith("/")) return null;
  const stack = baseDir.split("/").filter((p) => p !== "" && p !== ".");
  if (stack.includes("..")) return null;
  for (const p of target.split("/")) {
    if (p === "" || p === ".") continue;
    if (p === "..") {
      if (stack.length === 0) return null;
      stack.pop();
    } else stack.push(p);
  }
  return stack.join("/");
}

/** Symlink hops allowed while resolving one path: the kernel's own limit (MAXSYMLINKS). */
export const MAX_SYMLINK_HOPS = 40;

/**
 * Resolves `path` inside the directory `root` as the guest kernel would with `root` as `/`:
 * symlinks (absolute ones too) are followed relative to `root`, and `..` stops at `root`. Returns
 * a host path that is always `root` or below it, or null for loops, too many hops or a
 * non-directory in the middle. A missing final component resolves to where it would be.
 * We read /etc/passwd and /etc/group of untrusted rootfs trees through this.
 */
export async function resolveInRootfs(root: string, path: string): Promise<string | null> {
  let pending = path.split("/").filter((p) => p !== "" && p !== ".");
  const done: string[] = [];
  let hops = 0;
  while (pending.length > 0) {
    const comp = pending[0] as string;
    pending = pending.slice(1);
    if (comp === "..") {
      done.pop();
      continue;
    }
    const host = join(root, ...done, comp);
    let st: Stats;
    try {
      st = await lstat(host);
    } catch (err) {
      const code = (err as NodeJS.ErrnoException).code;
      if (code === "ENOENT" && pending.length === 0) {
        done.push(comp);
        break;
      }
      return null;
    }
    if (st.isSymbolicLink()) {
      if (++hops > MAX_SYMLINK_HOPS) return null;
      const target = await readlink(host);
      if (target.startsWith("/")) done.length = 0;
      pending = [...target.split("/").filter((p) => p !== "" && p !== "."), ...pending];
      continue;
    }
    if (pending.length > 0 && !st.isDirectory()) return null;
    done.push(comp);
  }
  return done.length === 0 ? root : join(root, ...done);
}
