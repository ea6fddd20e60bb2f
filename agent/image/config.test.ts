import { describe, expect, test } from "bun:test";
import { DEFAULT_PATH, normalizeConfig, type RawImageConfig, resolveCommand, resolveUser } from "./config.ts";
import { ImageError } from "./errors.ts";

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
