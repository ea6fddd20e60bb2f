import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { lstat, mkdir, mkdtemp, rm, symlink, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join, posix } from "node:path";
import fc from "fast-check";
import { DEFAULT_PATH, normalizeConfig, type RawImageConfig, resolveCommand, resolveUser } from "./config.ts";
import { ImageError } from "./errors.ts";
import { DEFAULT_DISK_SIZING, diskSizeFor } from "./ext4.ts";
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

describe("config normalisation", () => {
  const passwd = "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1001:app:/home/app:/bin/sh\n# comment\nbroken\n";
  const group = "root:x:0:\napps:x:1001:\nstaff:x:50:\n";
  const raw = (config: NonNullable<RawImageConfig["config"]>): RawImageConfig => ({
    config,
    rootfs: { diff_ids: [] },
  });
  const digest = `sha256:${"a".repeat(64)}`;

  test("Docker's defaults: PATH, WorkingDir /, root, HOME from passwd", () => {
    const c = normalizeConfig(raw({ Cmd: ["sh"] }), digest, passwd, group);
    expect(c.env).toEqual([`PATH=${DEFAULT_PATH}`, "HOME=/root"]);
    expect(c.workingDir).toBe("/");
    expect(c.user).toEqual({ uid: 0, gid: 0, name: "root" });
    expect(c.entrypoint).toEqual([]);
    expect(c.cmd).toEqual(["sh"]);
  });

  test("the image's own PATH and HOME win; ports are TCP numbers", () => {
    const c = normalizeConfig(
      raw({
        Env: ["PATH=/opt/bin", "HOME=/h", "A=b=c"],
        WorkingDir: "/srv//app/",
        ExposedPorts: { "8080/tcp": {}, "53/udp": {}, "9000": {}, bogus: {} },
      }),
      digest,
      passwd,
      group,
    );
    expect(c.env).toEqual(["PATH=/opt/bin", "HOME=/h", "A=b=c"]);
    expect(c.workingDir).toBe("/srv/app");
    expect(c.exposedPorts).toEqual([8080, 9000]);
  });

  test("a relative WorkingDir is refused, as Docker does", () => {
    expect(() => normalizeConfig(raw({ WorkingDir: "app" }), digest, passwd, group)).toThrow(ImageError);
  });

  test("User forms", () => {
    expect(resolveUser("app", passwd, group)).toMatchObject({
      uid: 1000,
      gid: 1001,
      name: "app",
      home: "/home/app",
    });
    expect(resolveUser("app:staff", passwd, group)).toMatchObject({ uid: 1000, gid: 50 });
    expect(resolveUser("1000", passwd, group)).toMatchObject({ uid: 1000, gid: 1001, name: "app" });
    expect(resolveUser("1000:0", passwd, group)).toMatchObject({ uid: 1000, gid: 0 });
    expect(resolveUser("555", passwd, group)).toMatchObject({ uid: 555, gid: 0, name: "555", home: "/" });
    expect(resolveUser("555:apps", passwd, group)).toMatchObject({ uid: 555, gid: 1001 });
    expect(resolveUser("", "", "")).toMatchObject({ uid: 0, gid: 0, name: "root" });
    for (const bad of ["ghost", "app:ghosts", "ghost:0", "-1", "99999999999"]) {
      try {
        resolveUser(bad, passwd, group);
        throw new Error(`accepted ${bad}`);
      } catch (err) {
        expect((err as ImageError).code).toBe("image_user_unknown");
      }
    }
  });
});

describe("resolveCommand (Docker's rule)", () => {
  test("given CMD replaces Cmd, Entrypoint is prepended", () => {
    expect(resolveCommand({ entrypoint: [], cmd: ["sh"] })).toEqual(["sh"]);
    expect(resolveCommand({ entrypoint: [], cmd: ["sh"] }, ["ls", "-l"])).toEqual(["ls", "-l"]);
    expect(resolveCommand({ entrypoint: ["/init", "--"], cmd: ["serve"] })).toEqual(["/init", "--", "serve"]);
    expect(resolveCommand({ entrypoint: ["/init"], cmd: ["serve"] }, ["x"])).toEqual(["/init", "x"]);
    expect(resolveCommand({ entrypoint: ["/init"], cmd: [] })).toEqual(["/init"]);
    expect(resolveCommand({ entrypoint: [], cmd: ["sh"] }, [])).toEqual(["sh"]);
  });

  test("nothing to run is an error with a stable code", () => {
    try {
      resolveCommand({ entrypoint: [], cmd: [] });
      throw new Error("accepted");
    } catch (err) {
      expect(err).toBeInstanceOf(ImageError);
      expect((err as ImageError).code).toBe("image_no_command");
    }
  });
});

describe("disk sizing", () => {
  test("max(256 MiB, 1.5x + 128 MiB), in whole MiB", () => {
    const MiB = 1024 * 1024;
    expect(diskSizeFor(0)).toBe(256 * MiB);
    expect(diskSizeFor(50 * MiB)).toBe(256 * MiB);
    expect(diskSizeFor(1024 * MiB)).toBe(1536 * MiB + 128 * MiB);
    expect(diskSizeFor(1)).toBe(256 * MiB);
    expect(diskSizeFor(100 * MiB, { ...DEFAULT_DISK_SIZING, minBytes: 0, factor: 2, headroomBytes: 0 })).toBe(
      200 * MiB,
    );
    fc.assert(
      fc.property(fc.nat({ max: 2 ** 40 }), (n) => {
        const s = diskSizeFor(n);
        return s % MiB === 0 && s >= 1.5 * n + 128 * MiB && s >= 256 * MiB;
      }),
    );
  });
});
