/**
 * The pure parts of envd's filesystem service: the listing diff watchers report (create, write, chmod, remove).
 */
import { describe, expect, test } from "bun:test";
import type { FsEntry } from "../../../contracts/agent/fs-ops.ts";
import { EventType } from "../../../contracts/e2b/envd/filesystem_pb.ts";
import { diffSnapshots } from "./filesystem.ts";

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
