/**
 * The pure parts of envd's filesystem service: the agent's `find -printf` records, the Basic
 * user header, and the listing diff watchers report (create, write, chmod, remove).
 */
import { describe, expect, test } from "bun:test";
import { parseFindRecords } from "../../../agent/sandbox/fs-exec.ts";
import type { FsEntry } from "../../../contracts/agent/fs-ops.ts";
import { EventType } from "../../../contracts/e2b/envd/filesystem_pb.ts";
import { diffSnapshots, envdUserOf } from "./filesystem.ts";

const rec = (f: string[]) => f.map((x) => `${x}\0`).join("");

describe("find records", () => {
  test("fields, a symlink's target made absolute, a name with a newline", () => {
    const out = Buffer.from(
      rec(["0", "d", "4096", "755", "drwxr-xr-x", "root", "root", "1700000000.5", "", "/root/d"]) +
        rec(["1", "l", "5", "777", "lrwxrwxrwx", "user", "user", "1700000001.0", "../t", "/root/d/a\nb"]),
    );
    const r = parseFindRecords(out);
    expect(r.complete).toBe(true);
    expect(r.entries[0]).toMatchObject({
      name: "d",
      type: "dir",
      size: 4096,
      mode: 0o755,
      mtimeMs: 1700000000500,
    });
    expect(r.entries[1]).toMatchObject({
      name: "a\nb",
      type: "symlink",
      symlinkTarget: "/root/t",
      owner: "user",
      depth: 1,
    });
  });
  test("a record cut short is dropped and says so", () => {
    const out = Buffer.from(`${rec(["0", "f", "1", "644", "-rw-r--r--", "u", "g", "1", "", "/x"])}0\0f\0`);
    const r = parseFindRecords(out);
    expect(r.entries.length).toBe(1);
    expect(r.complete).toBe(false);
  });
});

describe("the user header", () => {
  test("Basic base64(user:), none, and a malformed one", () => {
    expect(envdUserOf(new Headers({ authorization: `Basic ${btoa("alice:")}` }))).toBe("alice");
    expect(envdUserOf(new Headers())).toBeUndefined();
    expect(() => envdUserOf(new Headers({ authorization: "Bearer x" }))).toThrow();
  });
});

describe("watch diff", () => {
  const e = (
    name: string,
    size: number,
    mtimeMs: number,
    mode = 0o644,
  ): [string, { type: FsEntry["type"]; size: number; mtimeMs: number; mode: number; e: FsEntry }] => [
    name,
    {
      type: "file",
      size,
      mtimeMs,
      mode,
      e: {
        name,
        path: `/w/${name}`,
        type: "file",
        size,
        mode,
        permissions: "",
        owner: "",
        group: "",
        mtimeMs,
        depth: 1,
      },
    },
  ];
  test("create (with write), write, chmod, remove", () => {
    const before = new Map([e("kept", 1, 1), e("gone", 1, 1), e("mod", 1, 1)]);
    const after = new Map([e("kept", 2, 2), e("new", 3, 3), e("mod", 1, 1, 0o600)]);
    const ev = diffSnapshots(before, after, true).map((x) => [x.name, x.type]);
    expect(ev).toEqual([
      ["kept", EventType.WRITE],
      ["new", EventType.CREATE],
      ["new", EventType.WRITE],
      ["mod", EventType.CHMOD],
      ["gone", EventType.REMOVE],
    ]);
  });
});
