/**
 * Stopping the agent stops its catalog build: an aborted debootstrap is killed with everything
 * it started (its downloader here, dpkg in a chroot in a real build) and leaves no scratch
 * directory. The mirror is a loopback server that accepts the request and never answers, so
 * debootstrap is certainly running when the stop comes.
 */
import { afterEach, expect, test } from "bun:test";
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { SandboxdError } from "../../contracts/errors.ts";
import { ensureDebootstrapLayout, PYTHON_IMAGE } from "./python.ts";

const dirs: string[] = [];
afterEach(async () => {
  for (const d of dirs.splice(0)) await rm(d, { recursive: true, force: true });
});

/** Pids whose command line mentions `needle`. */
function pidsMentioning(needle: string): number[] {
  const out: number[] = [];
  for (const name of readdirSync("/proc")) {
    if (!/^\d+$/.test(name) || Number(name) === process.pid) continue;
    try {
      const cmd = readFileSync(`/proc/${name}/cmdline`, "utf8");
      const stat = readFileSync(`/proc/${name}/stat`, "utf8");
      const zombie = stat.slice(stat.lastIndexOf(")") + 2).startsWith("Z");
      if (!zombie && cmd.includes(needle)) out.push(Number(name));
    } catch {
      // gone meanwhile
    }
  }
  return out;
}

test.skipIf(!existsSync("/usr/sbin/debootstrap") || process.getuid?.() !== 0)(
  "an aborted debootstrap is killed with its children and leaves nothing behind",
  async () => {
    const dir = await mkdtemp(join(tmpdir(), "sbx-catalog-"));
    dirs.push(dir);
    let asked!: () => void;
    const reached = new Promise<void>((r) => {
      asked = r;
    });
    const mirror = Bun.serve({
      port: 0,
      hostname: "127.0.0.1",
      fetch: () => {
        asked();
        return new Promise<Response>(() => {}); // never answers
      },
    });
    const url = `http://127.0.0.1:${mirror.port}/debian`;
    try {
      const abort = new AbortController();
      const build = ensureDebootstrapLayout({
        dir,
        name: "python",
        spec: PYTHON_IMAGE,
        signal: abort.signal,
        mirror: url,
      }).catch((e) => e);
      await reached;
      expect(pidsMentioning(`127.0.0.1:${mirror.port}`).length).toBeGreaterThan(0);
      abort.abort();
      const err = await build;
      expect(err).toBeInstanceOf(SandboxdError);
      expect((err as SandboxdError).code).toBe("catalog_build_failed");
      // Bounded at 10 s (the kill is at once; a loaded host is slow to reap).
      for (let i = 0; i < 500 && pidsMentioning(`127.0.0.1:${mirror.port}`).length > 0; i++)
        await Bun.sleep(20);
      expect(pidsMentioning(`127.0.0.1:${mirror.port}`)).toEqual([]);
      expect(readdirSync(dir).filter((n) => n.startsWith(".build-"))).toEqual([]);
    } finally {
      mirror.stop(true);
    }
  },
  30_000,
);
