/** The agent's filesystem ops: the `find -printf` records they parse, hostile output included. */
import { describe, expect, test } from "bun:test";
import { parseFindRecords } from "./fs-exec.ts";

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
