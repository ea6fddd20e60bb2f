/**
 * A hostile tenant fills the disk: the agent's data dir (state and image cache) on a small
 * loop-mounted ext4, with REAL VMs under TCG through SandboxManager + SnapshotDriver. With the
 * disk nearly full, an upload through the agent's HTTP API, a suspend and a template build (what
 * a bake becomes on the agent) are refused with `insufficient_storage` and leave no file behind, while the running
 * sandbox keeps working; once the filler is deleted the same suspend and build succeed.
 *
 * Needs root (loop mounts); skipped otherwise.
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { execFileSync } from "node:child_process";
import { existsSync, readdirSync } from "node:fs";
import { copyFile, mkdir, rm } from "node:fs/promises";
import { join } from "node:path";
import { createAgentApp } from "../../agent/api/app.ts";
import type { SandboxManager } from "../../agent/sandbox/manager.ts";
import { defaultShmRoot } from "../../agent/snapshot/template.ts";
import { freeBytes } from "../../contracts/disk-space.ts";
import { AgentHttpClient } from "../../gateway/agents/client.ts";
import { errorOf } from "../support/agents.ts";
import { canLoopMount, type LoopDisk, mountLoopDisk } from "../support/loop-disk.ts";
import {
  busyboxArchive,
  codeOf,
  managerWithBusybox,
  qemuPidsUnder,
  removeBusyboxArchive,
  shellIn,
} from "../support/real-vm.ts";

const MIB = 1024 * 1024;
/** The small disk: room for a template, a sandbox and one suspended RAM image, no more. */
const DISK_MIB = 512;
const RESERVE = 8 * MIB;
const MEM_MIB = 128;
const VM_TEST_TIMEOUT_MS = 300_000;

const enabled = canLoopMount();
let disk: LoopDisk | undefined;
let mnt: string;
let stateDir: string;
let m: SandboxManager;
let server: ReturnType<typeof Bun.serve> | undefined;
let client: AgentHttpClient;
const CREDS = { id: "disk-agent", key: "test-secret-0123456789abcdef-0123456789" };
const log: string[] = [];

beforeAll(async () => {
  if (!enabled) return;
  disk = await mountLoopDisk("sbx-disk-", DISK_MIB);
  mnt = disk.mnt;
  stateDir = join(mnt, "state");
  await mkdir(stateDir);
  m = await managerWithBusybox({
    stateDir,
    cacheDir: join(mnt, "cache"),
    memMib: MEM_MIB,
    diskReserveBytes: RESERVE,
    log: (l) => log.push(l),
  });
  const app = createAgentApp({
    manager: m,
    credentials: CREDS,
    uploadDir: join(stateDir, "uploads"),
    diskReserveBytes: RESERVE,
  });
  server = Bun.serve({ hostname: "127.0.0.1", port: 0, fetch: app.fetch, idleTimeout: 0 });
  client = new AgentHttpClient({
    baseUrl: `http://127.0.0.1:${server.port}`,
    agentId: CREDS.id,
    key: CREDS.key,
  });
}, VM_TEST_TIMEOUT_MS);

afterAll(async () => {
  if (!enabled) return;
  try {
    if (m) {
      for (const s of m.list()) await m.destroy(s.id, { force: true });
      for (const t of ["bb", "bb2", "up"]) await m.deleteTemplate(t).catch(() => {});
      server?.stop(true);
      expect(await qemuPidsUnder(stateDir)).toEqual([]);
    }
  } finally {
    await disk?.remove();
    await rm(defaultShmRoot(stateDir), { recursive: true, force: true });
    await removeBusyboxArchive();
  }
});

const sh = (id: string, command: string) => shellIn(m, id, command);

const suspendedFiles = () => {
  const dir = join(stateDir, "storage", "suspended");
  return existsSync(dir) ? readdirSync(dir) : [];
};

test.skipIf(!enabled)(
  "a full disk refuses suspends and builds with insufficient_storage; running sandboxes keep working; space back, both succeed",
  async () => {
    const id = (await m.create("bb", { kind: "sandbox" })).vmId;
    expect((await sh(id, "echo hi")).trim()).toBe("hi");

    // The hostile tenant's filler: leaves 6 MiB, less than the reserve alone, so every new
    // write (an upload, a suspend's RAM image, a template) is refused; a running VM still writes.
    const filler = join(mnt, "filler");
    const free = await freeBytes(mnt);
    execFileSync("fallocate", ["-l", String(free - 6 * MIB), filler]);
    const before = await freeBytes(mnt);
    console.log(`DISK_FULL ${JSON.stringify({ disk_mib: DISK_MIB, free_mib: Math.round(before / MIB) })}`);

    expect(await codeOf(m.suspend(id))).toBe("insufficient_storage");
    expect(suspendedFiles()).toEqual([]);
    // The refused suspend left the sandbox as it was: running, answering, writing its disk.
    expect(m.info(id).state).toBe("running");
    expect(
      (await sh(id, "dd if=/dev/urandom of=/f bs=1024 count=1024 2>/dev/null && sync && wc -c < /f")).trim(),
    ).toBe("1048576");

    // An upload through the agent's HTTP API (the gateway's client streams its staged file):
    // refused on its declared length before a byte is written.
    const staged = join((disk as LoopDisk).root, "gateway-upload.tar");
    await copyFile(await busyboxArchive(), staged);
    const refused = await errorOf(
      client.buildTemplate("up", { kind: "upload", path: staged, memMib: MEM_MIB }),
    );
    expect(refused.code).toBe("insufficient_storage");
    const uploads = join(stateDir, "uploads");
    expect(existsSync(uploads) ? readdirSync(uploads) : []).toEqual([]);

    m.buildTemplate("bb2", { kind: "archive", path: await busyboxArchive() }, { memMib: MEM_MIB });
    await m.templates.settled("bb2");
    const failed = m.templates.status("bb2");
    expect(failed.status).toBe("failed");
    expect(failed.error).toStartWith("insufficient_storage: the agent's disk has no room for this build");
    expect(existsSync(join(stateDir, "templates", "bb2", "disk.qcow2"))).toBe(false);
    // Nothing half-written: the free space is what the filler left.
    expect(Math.abs((await freeBytes(mnt)) - before)).toBeLessThan(4 * MIB);

    // Space returns: the same calls succeed.
    await rm(filler);
    const s = await m.suspend(id);
    expect(s.memBytes).toBeGreaterThan(0);
    expect(m.info(id).state).toBe("suspended");
    await m.resume(id);
    expect((await sh(id, "wc -c < /f")).trim()).toBe("1048576");
    await copyFile(await busyboxArchive(), staged);
    await client.buildTemplate("up", { kind: "upload", path: staged, memMib: MEM_MIB });
    await m.templates.settled("up");
    expect(m.templates.status("up")).toMatchObject({ status: "ready" });
    m.buildTemplate("bb2", { kind: "archive", path: await busyboxArchive() }, { memMib: MEM_MIB });
    await m.templates.settled("bb2");
    expect(m.templates.status("bb2")).toMatchObject({ status: "ready" });
  },
  VM_TEST_TIMEOUT_MS,
);
