/**
 * The README's examples run as written. Every ```sh block in README.md carries a marker comment
 * just above it: `<!-- readme-test: skip (why) -->` for the few that cannot run here (the service
 * in the foreground, several hosts), or `<!-- readme-test: {"expect": [...]} -->`: the block runs
 * in bash from the repository root with `set -eo pipefail` (a failing step fails the block, as a
 * user would see it fail), exits 0, and its output contains each expected string.
 *
 * What differs from a user's machine, and only that: the paths and the port a block names are
 * swapped for this test's own (`/var/lib/sandboxd` -> a fresh data dir seeded with the guest
 * artifacts and the python image, `/tmp/img.tar` -> a file in it, port 8080 -> a free one), the
 * default data dir is that dir (`SANDBOXD_DATA_DIR`), and what a block leaves running (`up` in
 * the background and its VMs) is stopped by its process group afterwards. The free port is probed
 * and then bound by the block's `up`, a race with the rest of the host: a block whose `up` finds
 * its port taken meanwhile is stopped at once and run again on a fresh port (3 tries at most).
 */
import { afterAll, describe, expect, test } from "bun:test";
import { spawn } from "node:child_process";
import { readFileSync } from "node:fs";
import { createServer } from "node:net";
import { join } from "node:path";
import { prepareDataDir, qemusUnder, REPO, removeDataDir, waitFor } from "../support/e2e-service.ts";
import { type Block, readmeBlocks } from "../support/readme-blocks.ts";

const blocks = readmeBlocks(readFileSync(join(REPO, "README.md"), "utf8"));
const runnable = blocks.filter((b): b is Block & { marker: { expect: string[] } } => "expect" in b.marker);

/** A block: import, one boot; or `up` with the python catalog build (~1-3 min under TCG). */
const BLOCK_TIMEOUT_MS = 480_000;

const dirs: string[] = [];
afterAll(async () => {
  for (const d of dirs) await removeDataDir(d);
});

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.once("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const port = (s.address() as { port: number }).port;
      s.close(() => resolve(port));
    });
  });
}

/** What `up` (Bun.serve) says when its port is taken. */
const PORT_TAKEN = /EADDRINUSE|address already in use|Is port \d+ in use/i;
/** Tries of a block whose port was taken between the probe and its `up`'s bind. */
const PORT_TRIES = 3;

/**
 * Runs `script` in bash (`set -eo pipefail`) from the repository root in its own process group;
 * kills what it leaves. A port taken under its `up` stops the block at once (`portTaken`).
 */
async function runBlock(script: string, env: NodeJS.ProcessEnv, dataDir: string) {
  const child = spawn("bash", ["-eo", "pipefail", "-c", script], {
    cwd: REPO,
    env,
    detached: true,
    stdio: ["ignore", "pipe", "pipe"],
  });
  let output = "";
  child.stdout.on("data", (b: Buffer) => {
    output += b.toString();
  });
  let stderr = "";
  let portTaken = false;
  child.stderr.on("data", (b: Buffer) => {
    stderr = (stderr + b.toString()).slice(-20_000);
    if (!portTaken && PORT_TAKEN.test(stderr)) {
      portTaken = true;
      try {
        process.kill(-child.pid!, "SIGKILL");
      } catch {
        // the group is gone already
      }
    }
  });
  // A block that hangs (a service that never gets ready) is stopped before the test's own
  // timeout, so that its group is still killed below.
  const timer = setTimeout(() => process.kill(-child.pid!, "SIGKILL"), BLOCK_TIMEOUT_MS - 60_000);
  const code = await new Promise<number | null>((done) => child.once("exit", done));
  clearTimeout(timer);
  // `up` left in the background by the block: the group's SIGTERM stops it like Ctrl-C would.
  try {
    process.kill(-child.pid!, "SIGTERM");
  } catch {
    // nothing left in the group
  }
  const groupGone = await waitFor(async () => {
    try {
      process.kill(-child.pid!, 0);
      return false;
    } catch {
      return true;
    }
  }, 60_000);
  if (!groupGone) process.kill(-child.pid!, "SIGKILL"); // past the grace: as `up`'s own stop does
  // `up` leaves running sandboxes running for the next start to adopt: this one has none.
  for (const p of await qemusUnder(dataDir)) process.kill(p.pid, "SIGKILL");
  return { code, output, stderr, portTaken };
}

describe("README.md examples", () => {
  test("every sh block is marked: run here, or skipped with a reason", () => {
    expect(blocks.length).toBeGreaterThan(0);
    expect(runnable.length).toBeGreaterThanOrEqual(2);
    for (const b of blocks) if ("skip" in b.marker) expect(b.marker.skip).toMatch(/^skip \(.+\)$/);
  });

  for (const b of runnable) {
    test(
      `README.md:${b.line} runs as written`,
      async () => {
        let r: Awaited<ReturnType<typeof runBlock>> | undefined;
        for (let attempt = 1; attempt <= PORT_TRIES; attempt++) {
          const dataDir = await prepareDataDir("sbx-e2e-readme-");
          dirs.push(dataDir);
          const port = String(await freePort());
          const script = b.script
            .replaceAll("/var/lib/sandboxd", dataDir)
            .replaceAll("/tmp/img.tar", join(dataDir, "img.tar"))
            .replaceAll("--port 8080", `--port ${port}`)
            .replaceAll("localhost:8080", `localhost:${port}`);
          const env: NodeJS.ProcessEnv = { ...process.env, SANDBOXD_DATA_DIR: dataDir };
          delete env.DATABASE_URL; // PGlite in the data dir, never a developer's database
          env.SANDBOXD_PRELAUNCH = "0"; // no QEMUs beyond the block's own
          r = await runBlock(script, env, dataDir);
          if (!r.portTaken) break;
          console.warn(
            `README.md:${b.line}: port ${port} was taken before its up bound it; again on another`,
          );
        }
        if (!r || r.portTaken) throw new Error(`README.md:${b.line}: its port was taken ${PORT_TRIES} times`);
        const why = `README.md:${b.line} exited ${r.code}\n--- output\n${r.output}\n--- stderr\n${r.stderr}`;
        if (r.code !== 0) throw new Error(why);
        for (const want of b.marker.expect)
          if (!r.output.includes(want)) throw new Error(`missing ${JSON.stringify(want)}: ${why}`);
      },
      BLOCK_TIMEOUT_MS,
    );
  }
});
