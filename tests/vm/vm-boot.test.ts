import { afterAll, describe, expect, test } from "bun:test";
import { spawnSync } from "node:child_process";
import { randomUUID } from "node:crypto";
import {
  copyFileSync,
  mkdirSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  rmSync,
  symlinkSync,
} from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { ensureGuestArtifacts } from "../../agent/guest/artifacts.ts";
import type { GuestClient } from "../../agent/guest/client.ts";
import { launchVm, type VmProcess } from "../../agent/qemu/launch.ts";
import { createOverlayOn } from "../../agent/storage/qcow2.ts";
import { connectGuest } from "../../agent/vm/boot.ts";
import { qemuPidsNaming } from "../../agent/vm/process.ts";

/**
 * Boots a real guest under TCG end to end: artifacts (kernel + initramfs with the real guest
 * agent as /init), a scratch ext4 root disk behind a qcow2 overlay, QEMU microvm, the agent
 * socket, one exec; then kills the VM and checks that nothing is left behind.
 */

const REPO = resolve(import.meta.dir, "../..");
const DATA_DIR = process.env.SANDBOXD_TEST_DATA ?? join(REPO, ".data", "test");
/**
 * A first run downloads and unpacks the kernel (~3 s), builds the agent and boots under TCG
 * (~2-3 s); 180 s leaves room for a slow, shared CI machine.
 */
const BOOT_TEST_TIMEOUT_MS = 180_000;
/**
 * connectGuest retries HELLO until the guest agent opens the port and answers, after
 * the kernel boot (~2 s under TCG here). 60 s instead of the client's 10 s default: a cold boot
 * on a loaded CI machine under TCG, not a restore.
 */
const COLD_BOOT_HELLO_TIMEOUT_MS = 60_000;

const scratch = mkdtempSync(join(tmpdir(), "vm-boot-"));
let vm: VmProcess | undefined;

afterAll(async () => {
  await vm?.kill();
  rmSync(scratch, { recursive: true, force: true });
});

function sh(cmd: string, args: string[]): void {
  const r = spawnSync(cmd, args, { encoding: "utf8" });
  if (r.status !== 0) throw new Error(`${cmd} ${args.join(" ")} failed: ${r.stderr}${r.error ?? ""}`);
}

describe("VM boot under TCG", () => {
  test(
    "boots, runs sh -c 'echo hi' through the guest agent, and leaves nothing behind",
    async () => {
      const log = (m: string) => console.log(`[vm-boot] ${m}`);
      const artifacts = await ensureGuestArtifacts({ dataDir: DATA_DIR, log });

      // Scratch root disk: static busybox as /bin/sh, ext4 made without mounting (mkfs -d).
      const rootDir = join(scratch, "rootfs");
      mkdirSync(join(rootDir, "bin"), { recursive: true });
      copyFileSync("/bin/busybox", join(rootDir, "bin", "busybox"));
      symlinkSync("busybox", join(rootDir, "bin", "sh"));
      const raw = join(scratch, "root.ext4");
      sh("mkfs.ext4", ["-q", "-F", "-d", rootDir, raw, "16M"]);
      const base = join(scratch, "root.qcow2");
      sh("qemu-img", ["convert", "-O", "qcow2", raw, base]);
      const vmDir = join(scratch, "vm");
      mkdirSync(vmDir);
      const overlay = join(vmDir, "disk.qcow2");
      await createOverlayOn(base, overlay);

      const t0 = performance.now();
      vm = await launchVm({
        dir: vmDir,
        artifacts,
        disk: overlay,
        memMib: 256,
        vcpus: 1,
        accel: "tcg",
        hostname: "boot-test",
        log,
      });
      const tQmp = performance.now();
      expect(await vm.qmp.execute("query-status")).toMatchObject({ running: true });

      let client: GuestClient | undefined;
      try {
        client = await connectGuest(vm, COLD_BOOT_HELLO_TIMEOUT_MS, {
          onLog: (line) => log(`guest: ${line}`),
        });
        const tHello = performance.now();
        const res = await client.exec({ argv: ["sh", "-c", "echo hi"], env: ["PATH=/bin"], cwd: "/" });
        const tExec = performance.now();
        expect(res.stdout.toString()).toBe("hi\n");
        expect(res.exitCode).toBe(0);
        const res2 = await client.exec({ argv: ["sh", "-c", "hostname"], env: ["PATH=/bin"], cwd: "/" });
        const tExec2 = performance.now();
        expect(res2.stdout.toString()).toBe("boot-test\n");
        // A restored VM gets its own boot id (bind-mounted over procfs); twice, as a fork of a fork.
        for (const bootId of [randomUUID(), randomUUID()]) {
          await client.setHostname("boot-test-2", { bootId });
          const id = await client.exec({
            argv: ["sh", "-c", "cat /proc/sys/kernel/random/boot_id; hostname; grep -c boot_id /proc/mounts"],
            env: ["PATH=/bin"],
          });
          expect(id.stdout.toString()).toBe(`${bootId}\nboot-test-2\n1\n`);
        }
        await expect(client.setHostname("x", { bootId: "../../etc/passwd" })).rejects.toThrow("boot id");
        console.log(
          `[vm-boot] spawn->QMP ${(tQmp - t0).toFixed(0)} ms, spawn->HELLO ${(tHello - t0).toFixed(0)} ms, ` +
            `boot-to-first-exec ${(tExec - t0).toFixed(0)} ms, second exec ${(tExec2 - tExec).toFixed(0)} ms`,
        );
      } catch (err) {
        console.log(`[vm-boot] console.log:\n${readFileSync(vm.consoleLog, "utf8").slice(-4000)}`);
        throw err;
      } finally {
        client?.close();
      }

      const pid = vm.pid;
      await vm.kill();
      expect(vm.isAlive()).toBe(false);
      expect(() => process.kill(pid, 0)).toThrow();
      expect(await qemuPidsNaming([vmDir])).toEqual([]);
      expect(readdirSync(vmDir).filter((f) => f.endsWith(".sock") || f.endsWith(".pid"))).toEqual([]);
    },
    BOOT_TEST_TIMEOUT_MS,
  );
});
