/**
 * The serving process outlives its faults: with the handlers of faults.ts installed, an unhandled
 * rejection and an uncaught exception are logged with the sandbox ids they name and the HTTP
 * server keeps answering (a real child process, since the handlers are process-wide); and the
 * path that used to crash the agent (a VM whose QEMU died, freed by a destroy nobody awaits,
 * failing on a full disk) is logged, not left to reject.
 */
import { afterEach, describe, expect, test } from "bun:test";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { VmExit, VmProcess } from "../agent/qemu/launch.ts";
import { SandboxVm, type VmShape } from "../agent/snapshot/vm.ts";
import { SandboxdError } from "../contracts/errors.ts";
import { describeFault, idsNamedBy } from "./faults.ts";

const dirs: string[] = [];
afterEach(async () => {
  for (const d of dirs.splice(0)) await rm(d, { recursive: true, force: true });
});

describe("fault handlers", () => {
  test("an error's sandbox and VM ids are found in its message, details and causes", () => {
    const err = new SandboxdError("internal", "exec on vm-0123456789abcdef failed", {
      details: { sandbox: "sbx_abc123" },
      cause: new Error("for sess_zz9"),
    });
    expect(idsNamedBy(err).sort()).toEqual(["sbx_abc123", "sess_zz9", "vm-0123456789abcdef"]);
    expect(describeFault("unhandled rejection", err)).toContain(
      "unhandled rejection (vm-0123456789abcdef, sbx_abc123, sess_zz9)",
    );
    expect(idsNamedBy("plain text")).toEqual([]);
  });

  test("a process with the handlers keeps serving after an unhandled rejection and an uncaught exception", async () => {
    const script = `
      import { installFaultHandlers } from ${JSON.stringify(join(import.meta.dir, "faults.ts"))};
      installFaultHandlers((line) => process.stderr.write("LOG " + line.split("\\n")[0] + "\\n"));
      const server = Bun.serve({
        port: 0,
        hostname: "127.0.0.1",
        fetch(req) {
          const path = new URL(req.url).pathname;
          if (path === "/reject") Promise.reject(new Error("ENOSPC freeing vm-00000000000000aa"));
          if (path === "/throw") setTimeout(() => { throw new Error("boom in sbx_q1"); }, 0);
          return new Response("ok " + path);
        },
      });
      process.stdout.write("listening " + server.port + "\\n");
    `;
    const child = Bun.spawn([process.execPath, "-e", script], { stdout: "pipe", stderr: "pipe" });
    try {
      const reader = child.stdout.getReader();
      let text = "";
      while (!/listening \d+\n/.test(text)) {
        const { value, done } = await reader.read();
        if (done) throw new Error(`child ended early: ${await new Response(child.stderr).text()}`);
        text += new TextDecoder().decode(value);
      }
      const port = Number(/listening (\d+)/.exec(text)![1]);
      const get = (p: string) => fetch(`http://127.0.0.1:${port}${p}`).then((r) => r.text());
      expect(await get("/reject")).toBe("ok /reject");
      expect(await get("/throw")).toBe("ok /throw");
      await Bun.sleep(100);
      // Still serving after both faults.
      expect(await get("/after")).toBe("ok /after");
      expect(child.exitCode).toBeNull();
      child.kill();
      await child.exited;
      const log = await new Response(child.stderr).text();
      expect(log).toContain(
        "LOG unhandled rejection (vm-00000000000000aa): ENOSPC freeing vm-00000000000000aa",
      );
      expect(log).toContain("LOG uncaught exception (sbx_q1): boom in sbx_q1; still serving");
    } finally {
      child.kill();
    }
  });
});

describe("a VM whose QEMU died and whose cleanup fails", () => {
  test("the failed destroy is logged with the VM id, rejects nothing unhandled, and a later destroy retries", async () => {
    const dir = await mkdtemp(join(tmpdir(), "sbx-faults-"));
    dirs.push(dir);
    let exit!: (e: VmExit) => void;
    let kills = 0;
    const proc = {
      pid: 1,
      exited: new Promise<VmExit>((r) => {
        exit = r;
      }),
      kill: async () => {
        kills++;
        if (kills === 1)
          throw Object.assign(new Error("ENOSPC: no space left on device"), { code: "ENOSPC" });
      },
    } as unknown as VmProcess;
    const guest = { onIncomingTunnel: () => {}, close: () => {} } as never;
    const logs: string[] = [];
    const shape = { dataDir: dir } as VmShape;
    const vm = new SandboxVm(
      "vm-00000000000000bb",
      join(dir, "vms", "vm-00000000000000bb"),
      shape,
      "",
      "",
      (m) => logs.push(m),
    );
    vm.state = "running";
    const unhandled: unknown[] = [];
    const onUnhandled = (r: unknown) => unhandled.push(r);
    process.on("unhandledRejection", onUnhandled);
    try {
      vm.attach(proc, guest);
      exit({ code: null, signal: "SIGKILL" } as VmExit);
      // Bounded at 10 s, asserted below.
      for (let i = 0; i < 2000 && !logs.some((l) => l.includes("failed")); i++) await Bun.sleep(5);
      await Bun.sleep(20);
      expect(unhandled).toEqual([]);
      expect(logs.find((l) => l.includes("failed"))).toContain(
        "vm vm-00000000000000bb: freeing it after its QEMU exited failed: ENOSPC",
      );
      // The disk has room again: the next destroy does the work instead of replaying the failure.
      await vm.destroy();
      expect(kills).toBe(2);
      expect(vm.state as string).toBe("dead");
    } finally {
      process.off("unhandledRejection", onUnhandled);
    }
  });
});
