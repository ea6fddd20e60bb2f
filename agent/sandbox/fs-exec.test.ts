/**
 * The agent's filesystem ops: the `find -printf` records they parse, hostile output included; the
 * metadata program and its bounds.
 */
import { describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import {
  MAX_METADATA_KEY_BYTES,
  MAX_METADATA_KEYS,
  MAX_METADATA_TOTAL_BYTES,
  Metadata,
  metadataProblem,
} from "../../contracts/agent/fs-ops.ts";
import { METADATA_PROGRAM, parseFindRecords, parseMetadataLine } from "./fs-exec.ts";

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

/**
 * The metadata program itself, run by this host's python3 (`bin/sandboxd test` installs it) on
 * files in a temporary directory; the guest runs the same text. Set replaces `user.e2b.*` and
 * leaves other xattrs, get lists by index.
 */
describe("metadata program", () => {
  const run = (args: string[], stdin: string | Buffer) =>
    Bun.spawnSync(["python3", "-c", METADATA_PROGRAM, ...args], { stdin: Buffer.from(stdin) });
  test("set replaces, get reports by index, a missing path is a one-line refusal", () => {
    const dir = mkdtempSync(join(tmpdir(), "fsmeta-"));
    try {
      const a = join(dir, "a");
      const b = join(dir, "b\nc");
      writeFileSync(a, "");
      writeFileSync(b, "");
      expect(run(["set", a], JSON.stringify({ x: "1", y: "2" })).exitCode).toBe(0);
      expect(run(["set", a], JSON.stringify({ y: "3" })).exitCode).toBe(0);
      const got = run(["get"], Buffer.from(`${b}\0${a}\0`));
      expect(got.exitCode).toBe(0);
      const lines = got.stdout.toString().split("\n").map(parseMetadataLine).filter(Boolean);
      expect(lines).toEqual([[1, { y: "3" }]]);
      const missing = run(["set", join(dir, "none")], "{}");
      expect(missing.exitCode).toBe(1);
      expect(missing.stderr.toString().trim().split("\n")).toHaveLength(1);
      expect(missing.stderr.toString()).toContain("No such file");
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
  test("lines that are not records are ignored", () => {
    expect(parseMetadataLine("")).toBeUndefined();
    expect(parseMetadataLine("[1,")).toBeUndefined();
    expect(parseMetadataLine('["1", {}]')).toBeUndefined();
    expect(parseMetadataLine('[2, {"k": "v", "n": 3}]')).toEqual([2, { k: "v" }]);
  });
});

describe("metadata bounds", () => {
  test("keys, values, count and total size", () => {
    expect(Metadata.safeParse({ author: "mish" }).success).toBe(true);
    expect(Metadata.safeParse({ "bad key": "v" }).success).toBe(false);
    expect(Metadata.safeParse({ "": "v" }).success).toBe(false);
    expect(Metadata.safeParse({ Upper: "v" }).success).toBe(false);
    expect(Metadata.safeParse({ k: "bad\nvalue" }).success).toBe(false);
    expect(Metadata.safeParse({ k: "caf\u00e9" }).success).toBe(false);
    const many = Object.fromEntries(Array.from({ length: MAX_METADATA_KEYS + 1 }, (_, i) => [`k${i}`, ""]));
    expect(metadataProblem(many)).toContain("keys");
    expect(metadataProblem({ ["k".repeat(MAX_METADATA_KEY_BYTES + 1)]: "" })).toContain("key");
    expect(metadataProblem({ ["k".repeat(MAX_METADATA_KEY_BYTES)]: "" })).toBeUndefined();
    // The prefix counts: 9 + 1 + 4086 is exactly the budget, one more byte is past it.
    expect(metadataProblem({ k: "v".repeat(MAX_METADATA_TOTAL_BYTES - 10) })).toBeUndefined();
    expect(metadataProblem({ k: "v".repeat(MAX_METADATA_TOTAL_BYTES - 9) })).toContain("bytes");
  });
});
