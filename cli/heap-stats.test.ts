import { describe, expect, test } from "bun:test";
import { spawn } from "node:child_process";
import { resolve } from "node:path";
import { growingTypes } from "../bench/soak.ts";
import { HEAP_STATS_ENV, installHeapStatsSignal, parseHeapStatsLine } from "./heap-stats.ts";

const BUN = process.execPath;
const MODULE = resolve(import.meta.dir, "heap-stats.ts");
/** A child Bun starts and collects its heap in well under a second; 20 s means it hangs. */
const CHILD_TIMEOUT_MS = 20_000;

describe("heap stats on SIGUSR2", () => {
  test("off by default: no handler is installed", () => {
    const before = process.listenerCount("SIGUSR2");
    const remove = installHeapStatsSignal(false);
    expect(process.listenerCount("SIGUSR2")).toBe(before);
    remove();
  });

  test(
    "with the env set, SIGUSR2 prints the heap after a full GC on stderr",
    async () => {
      // A child process: the handler runs a full GC and prints, as `up` does when the soak asks.
      const script = `import { installHeapStatsSignal } from ${JSON.stringify(MODULE)};
        installHeapStatsSignal(process.env.${HEAP_STATS_ENV} === "1"); process.stdout.write("ready\\n"); setInterval(() => {}, 1000);`;
      const child = spawn(BUN, ["-e", script], {
        env: { ...process.env, [HEAP_STATS_ENV]: "1" },
        stdio: ["ignore", "pipe", "pipe"],
      });
      try {
        const line = await new Promise<string>((ok, fail) => {
          const timer = setTimeout(() => fail(new Error("no heap stats")), CHILD_TIMEOUT_MS);
          child.stdout.once("data", () => child.kill("SIGUSR2"));
          let err = "";
          child.stderr.on("data", (b: Buffer) => {
            err += b.toString();
            const l = err.split("\n").find((x) => parseHeapStatsLine(x));
            if (l) {
              clearTimeout(timer);
              ok(l);
            }
          });
        });
        const h = parseHeapStatsLine(line)!;
        expect(h.heap_bytes).toBeGreaterThan(0);
        expect(h.object_count).toBeGreaterThan(0);
        expect(h.rss_kib).toBeGreaterThan(0);
        expect(h.types.Function).toBeGreaterThan(0);
        // Still running: the signal's default action (exit) was replaced.
        expect(child.exitCode).toBeNull();
      } finally {
        child.kill("SIGKILL");
      }
    },
    CHILD_TIMEOUT_MS + 5_000,
  );

  test("other lines are not heap stats", () => {
    expect(parseHeapStatsLine("sandboxd: listening")).toBeUndefined();
    expect(parseHeapStatsLine("heap-stats {not json")).toBeUndefined();
  });

  test("growing types: the largest growth first, shrinking and new-but-zero types left out", () => {
    expect(growingTypes({ A: 10, B: 5, C: 7 }, { A: 12, B: 4, C: 17, D: 3 })).toEqual({ C: 10, D: 3, A: 2 });
  });
});
