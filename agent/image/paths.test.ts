import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { lstat, mkdir, mkdtemp, rm, symlink, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join, posix } from "node:path";
import fc from "fast-check";
import { isSafeEntryPath, normalizeEntryPath, resolveInRootfs, resolveInside } from "./paths.ts";

/** Path-ish strings: mostly the pieces that cause trouble, glued with slashes. */
const pathPiece = fc.oneof(
  fc.constantFrom("..", ".", "", "a", "b", "etc", "...", ". .", "..a", "a..", "\0", "/", "//"),
  fc.string({ maxLength: 6 }),
);
const pathish = fc.oneof(
  fc.array(pathPiece, { maxLength: 10 }).map((p) => p.join("/")),
  fc.array(pathPiece, { maxLength: 10 }).map((p) => `/${p.join("/")}`),
  fc.string({ maxLength: 40 }),
);

const ROOT = "/srv/rootfs";
function inside(rel: string): boolean {
  const joined = posix.join(ROOT, rel);
  return joined === ROOT || joined.startsWith(`${ROOT}/`);
}

describe("entry path safety", () => {
  test("a cleaned entry path never leaves the root (property)", () => {
    fc.assert(
      fc.property(pathish, fc.boolean(), (name, allowAbsolute) => {
        const r = normalizeEntryPath(name, { allowAbsolute });
        if (r === null) return true;
        return (
          !r.startsWith("/") &&
          !r.split("/").includes("..") &&
          !r.split("/").includes(".") &&
          !r.includes("\0") &&
          inside(r)
        );
      }),
      { numRuns: 5000 },
    );
  });

  test("names with a .. component are refused, wherever it is", () => {
    fc.assert(
      fc.property(fc.array(pathPiece, { maxLength: 6 }), fc.array(pathPiece, { maxLength: 6 }), (a, b) => {
        const name = [...a, "..", ...b].join("/");
        return !isSafeEntryPath(name, { allowAbsolute: true });
      }),
    );
  });

  test("examples", () => {
    expect(normalizeEntryPath("./etc/passwd", { allowAbsolute: false })).toBe("etc/passwd");
    expect(normalizeEntryPath("/etc/passwd", { allowAbsolute: false })).toBeNull();
    expect(normalizeEntryPath("/etc/passwd", { allowAbsolute: true })).toBe("etc/passwd");
    expect(normalizeEntryPath("a/../b", { allowAbsolute: true })).toBeNull();
    expect(normalizeEntryPath("../x", { allowAbsolute: true })).toBeNull();
    expect(normalizeEntryPath("./", { allowAbsolute: false })).toBe("");
    expect(normalizeEntryPath("", { allowAbsolute: false })).toBeNull();
    expect(normalizeEntryPath("a\0b", { allowAbsolute: true })).toBeNull();
    expect(normalizeEntryPath("..foo/bar..", { allowAbsolute: false })).toBe("..foo/bar..");
  });

  test("a symlink target resolved from inside never leaves the root (property)", () => {
    fc.assert(
      fc.property(pathish, pathish, (base, target) => {
        const b = normalizeEntryPath(base, { allowAbsolute: false });
        if (b === null) return true;
        const r = resolveInside(b, target);
        if (r === null) return true;
        // Same answer as plain lexical joining, which it must agree with whenever it accepts.
        const lexical = posix
          .normalize(b ? `${b}/${target}` : target)
          .replace(/\/+$/, "")
          .replace(/^\.$/, "");
        return !r.split("/").includes("..") && inside(r) && lexical === r;
      }),
      { numRuns: 5000 },
    );
  });

  test("resolveInside examples", () => {
    expect(resolveInside("a/b", "../c")).toBe("a/c");
    expect(resolveInside("a", "../../etc/passwd")).toBeNull();
    expect(resolveInside("", "/etc/passwd")).toBeNull();
    expect(resolveInside("blobs/sha256", "../sha256/x")).toBe("blobs/sha256/x");
  });
});

describe("resolveInRootfs", () => {
  let dir: string;
  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), "sandboxd-rootfs-prop-"));
  });
  afterAll(async () => {
    await rm(dir, { recursive: true, force: true });
  });

  /** True when every ancestor of `rel` under `root` exists as a directory, not a symlink (made if missing). */
  async function ancestorsAreRealDirs(root: string, rel: string): Promise<boolean> {
    const parts = rel.split("/").slice(0, -1);
    let cur = root;
    for (const part of parts) {
      cur = join(cur, part);
      const st = await lstat(cur).catch(() => undefined);
      if (st === undefined) await mkdir(cur);
      else if (!st.isDirectory() || st.isSymbolicLink()) return false;
    }
    return true;
  }

  test("hostile symlinks (absolute, .., loops) never resolve outside the root (property)", async () => {
    let n = 0;
    await fc.assert(
      fc.asyncProperty(
        fc.array(fc.tuple(fc.constantFrom("a", "b", "etc", "a/x", "etc/passwd", "b/y"), pathish), {
          maxLength: 6,
        }),
        pathish,
        async (links, query) => {
          const root = join(dir, `r${n++}`);
          await mkdir(join(root, "a"), { recursive: true });
          await mkdir(join(root, "etc"), { recursive: true });
          await writeFile(join(root, "etc/group"), "root:x:0:\n");
          for (const [at, target] of links) {
            if (target.includes("\0") || target === "") continue;
            // The links this test plants point anywhere, "/" included: a later link placed
            // *through* an earlier one (etc -> /, then etc/passwd) would rm and replace the
            // host's own files. Only touch paths whose every ancestor is a real directory
            // inside root (lstat, never following a link).
            if (!(await ancestorsAreRealDirs(root, at))) continue;
            await rm(join(root, at), { recursive: true, force: true }).catch(() => {});
            await symlink(target, join(root, at)).catch(() => {});
          }
          const r = await resolveInRootfs(root, query.replaceAll("\0", ""));
          await rm(root, { recursive: true, force: true });
          return r === null || r === root || r.startsWith(`${root}/`);
        },
      ),
      { numRuns: 300 },
    );
  });

  test("follows absolute links inside the root and stops .. at the root", async () => {
    const root = join(dir, "fixed");
    await mkdir(join(root, "real/etc"), { recursive: true });
    await writeFile(join(root, "real/etc/passwd"), "x");
    await symlink("/real/etc", join(root, "etc"));
    await symlink("../../../../../../etc/shadow", join(root, "up"));
    await symlink("loop", join(root, "loop"));
    expect(await resolveInRootfs(root, "/etc/passwd")).toBe(join(root, "real/etc/passwd"));
    expect(await resolveInRootfs(root, "/up")).toBe(join(root, "real/etc/shadow"));
    expect(await resolveInRootfs(root, "/loop")).toBeNull();
    expect(await resolveInRootfs(root, "/../../..")).toBe(root);
  });
});
