/**
 * The catalog's python image: built by debootstrap from the host's Debian mirror (once; cached in
 * the test data dir), imported through the checked import path, and run in a real VM the way an
 * exec's `code` runs: on python3's standard input.
 */
import { expect, test } from "bun:test";
import { spawnSync } from "node:child_process";
import { join, resolve } from "node:path";
import { ensurePythonImage, pythonLayoutDir } from "../../agent/catalog/python.ts";

const REPO = resolve(import.meta.dir, "../..");
const DATA_DIR = process.env.SANDBOXD_TEST_DATA ?? join(REPO, ".data", "test");

/** debootstrap takes ~35 s and the import ~10 s on these machines; 300 s for a slow mirror. */
const BUILD_TIMEOUT_MS = 300_000;

test(
  "python image: code on stdin runs under python3 in its WorkingDir",
  async () => {
    const image = await ensurePythonImage({
      dataDir: DATA_DIR,
      ...(process.env.SANDBOXD_DEBIAN_MIRROR ? { mirror: process.env.SANDBOXD_DEBIAN_MIRROR } : {}),
    });
    expect(image.config.cmd).toEqual(["python3"]);
    const layout = pythonLayoutDir(DATA_DIR);
    const code =
      "import os, sys\nprint(6 * 7)\nprint(os.getcwd())\nprint(sys.version_info[0])\nsys.exit(4)\n";
    const r = spawnSync(join(REPO, "bin/sandboxd"), ["run", "-i", "--image", layout], {
      input: code,
      encoding: "utf8",
      env: { ...process.env, SANDBOXD_DATA_DIR: DATA_DIR },
    });
    expect(r.stdout).toBe("42\n/root\n3\n");
    expect(r.status).toBe(4);
  },
  BUILD_TIMEOUT_MS,
);
