import { afterAll, describe, expect, test } from "bun:test";
import { spawn } from "node:child_process";
import { existsSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { QmpClient } from "./client.ts";
import { QmpCommandError } from "./errors.ts";

/**
 * The client against a real QEMU: a microvm started paused (-S) needs no kernel, disk or guest,
 * so this checks our framing and event handling against QEMU's own output in ~100 ms.
 */
const dir = mkdtempSync(join(tmpdir(), "qmp-qemu-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

describe("QmpClient against qemu-system-x86_64 -M microvm -S", () => {
  test("query-status, stop/cont events, error class, quit", async () => {
    const sock = join(dir, "qmp.sock");
    const qemu = spawn(
      "qemu-system-x86_64",
      [
        "-M",
        "microvm",
        "-accel",
        "tcg",
        "-S",
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-m",
        "32M",
        "-qmp",
        `unix:${sock},server=on,wait=off`,
      ],
      { stdio: ["ignore", "ignore", "pipe"] },
    );
    const exited = new Promise<number | null>((r) => qemu.on("exit", (code) => r(code)));
    try {
      // QEMU start to greeting is ~30 ms on these hosts; 10 s only guards a wedged CI machine.
      const c = await QmpClient.connect(sock, { timeoutMs: 10_000 });
      expect(await c.execute("query-status")).toMatchObject({ running: false, status: "prelaunch" });

      const resumed = c.waitEvent("RESUME", { timeoutMs: 5000 });
      await c.execute("cont");
      await resumed;
      expect(await c.execute("query-status")).toMatchObject({ running: true, status: "running" });

      const stopped = c.waitEvent("STOP", { timeoutMs: 5000 });
      await c.execute("stop");
      await stopped;
      expect(await c.execute("query-status")).toMatchObject({ running: false, status: "paused" });

      const err = await c.execute("no-such-command").catch((e: unknown) => e);
      expect(err).toBeInstanceOf(QmpCommandError);
      expect((err as QmpCommandError).errorClass).toBe("CommandNotFound");

      const shutdown = c.waitEvent("SHUTDOWN", { timeoutMs: 5000 });
      await c.execute("quit");
      await shutdown;
      expect((await c.closed).code).toBe("qmp_disconnected");
      expect(await exited).toBe(0);
    } finally {
      qemu.kill("SIGKILL");
      await exited;
    }
    expect(existsSync(sock)).toBe(false);
  });
});
