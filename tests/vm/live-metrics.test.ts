/**
 * Live metrics (docs/metrics.md, agent/sandbox/live-metrics.ts) of a REAL VM under TCG, read
 * through the agent's HTTP route by the gateway's client: a guest program that writes 64 MiB into
 * the guest's tmpfs (guest memory, touched), writes a 32 MiB file to its disk and burns CPU makes
 * the host-side figures rise against an idle sample taken before: CPU %, memory used (the QEMU's
 * private memory) and disk used (the overlay's allocated blocks). Then a suspended sandbox keeps
 * its last samples, and its resumed QEMU starts its CPU rate over. Ends with the leak check.
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { rm } from "node:fs/promises";
import { join } from "node:path";
import { createAgentApp } from "../../agent/api/app.ts";
import type { SandboxManager } from "../../agent/sandbox/manager.ts";
import { defaultShmRoot } from "../../agent/snapshot/template.ts";
import type { VmMetrics } from "../../contracts/agent/api.ts";
import { AgentHttpClient } from "../../gateway/agents/client.ts";
import {
  leftovers,
  managerWithBusybox,
  removeBusyboxArchive,
  TEST_CACHE_DIR,
  tempStateDir,
  waitFor,
} from "../support/real-vm.ts";

/** A template build and a few execs under TCG on a 2-core host shared with other test files. */
const VM_TEST_TIMEOUT_MS = 240_000;
/** The guest's busy exec (writes, sync, 6 s of CPU): generous for a loaded TCG host. */
const BUSY_EXEC_TIMEOUT_MS = 120_000;
/** The idle pause comes 2 s after the create; a loaded host may take longer to carry it out. */
const IDLE_PAUSE_WAIT_MS = 30_000;
/** Between the test's own sweeps: long enough that a rate spans 100 clock ticks. */
const SWEEP_GAP_MS = 1_000;
const MIB = 1024 * 1024;
const SECRET = "test-secret-0123456789abcdef-0123456789";
const CREDS = { id: "test-agent", key: SECRET };

let stateDir: string;
let m: SandboxManager;
let server: ReturnType<typeof Bun.serve>;
let client: AgentHttpClient;

beforeAll(async () => {
  stateDir = await tempStateDir();
  m = await managerWithBusybox({ stateDir, cacheDir: TEST_CACHE_DIR, memMib: 256 });
  const app = createAgentApp({ manager: m, credentials: CREDS, uploadDir: join(stateDir, "uploads") });
  server = Bun.serve({ hostname: "127.0.0.1", port: 0, fetch: app.fetch, idleTimeout: 0 });
  client = new AgentHttpClient({
    baseUrl: `http://127.0.0.1:${server.port}`,
    agentId: CREDS.id,
    key: SECRET,
  });
}, VM_TEST_TIMEOUT_MS);

afterAll(async () => {
  try {
    if (m) {
      for (const s of m.list()) await m.destroy(s.id, { force: true });
      server?.stop(true);
      await m.detach();
      expect(await leftovers(stateDir)).toEqual({ qemus: [], vmDirs: [] });
    }
  } finally {
    await rm(stateDir, { recursive: true, force: true });
    await rm(defaultShmRoot(stateDir), { recursive: true, force: true });
    await removeBusyboxArchive();
  }
});

const last = (x: VmMetrics) => x.samples.at(-1);

test(
  "a guest that burns CPU, fills memory and writes a file shows CPU, memory and disk up against idle",
  async () => {
    const { vmId } = await m.create("bb", { kind: "sandbox" });
    // Idle: once the idle pause has stopped its vCPUs (2 s after the create), two sweeps a second
    // apart (the timer's own sweeps may fall between; any order is fine).
    expect(await waitFor(() => m.info(vmId).state === "paused", IDLE_PAUSE_WAIT_MS)).toBe(true);
    await m.liveMetrics.sweep();
    await Bun.sleep(SWEEP_GAP_MS);
    await m.liveMetrics.sweep();
    const idle = await client.metrics(vmId);
    expect(idle.state).toBe("paused");
    expect(idle.vcpus).toBe(1);
    expect(idle.memLimitBytes).toBe(256 * MIB);
    expect(idle.intervalMs).toBe(2000);
    const idleSample = last(idle);
    expect(idleSample).toBeDefined();
    if (!idleSample) return;
    expect(idleSample.cpuPercent).not.toBeNull();

    const busy = m.exec(vmId, {
      files: [],
      run: {
        kind: "shell",
        command:
          "dd if=/dev/zero of=/dev/shm/m bs=1M count=64 2>/dev/null && " +
          "dd if=/dev/urandom of=/metrics-file bs=1M count=32 2>/dev/null && sync && " +
          "end=$(($(date +%s)+6)); while [ $(date +%s) -lt $end ]; do :; done; echo done",
      },
      timeoutMs: BUSY_EXEC_TIMEOUT_MS,
    });
    let running = true;
    void busy.finally(() => {
      running = false;
    });
    const cpuWhileBusy: number[] = [];
    while (running) {
      await Bun.sleep(SWEEP_GAP_MS);
      await m.liveMetrics.sweep();
      const s = last(await client.metrics(vmId));
      if (s?.cpuPercent != null) cpuWhileBusy.push(s.cpuPercent);
    }
    const r = await busy;
    expect(r.exitCode).toBe(0);
    expect(r.stdout.trim()).toBe("done");
    await m.liveMetrics.sweep();
    const after = await client.metrics(vmId);
    const now = last(after);
    expect(now).toBeDefined();
    if (!now) return;
    console.log(
      `idle: cpu ${idleSample.cpuPercent}%, mem used ${(idleSample.memUsedBytes / MIB).toFixed(1)} MiB, ` +
        `resident ${(idleSample.memResidentBytes / MIB).toFixed(1)} MiB, disk ${(idleSample.diskBytes / MIB).toFixed(1)} MiB; ` +
        `busy: cpu max ${Math.max(...cpuWhileBusy)}% over ${cpuWhileBusy.length} samples; ` +
        `after: mem used ${(now.memUsedBytes / MIB).toFixed(1)} MiB, disk ${(now.diskBytes / MIB).toFixed(1)} MiB; ` +
        `sweep of ${m.liveMetrics.lastSweep.vms} VM: ${m.liveMetrics.lastSweep.ms.toFixed(3)} ms`,
    );
    // CPU: the busy guest ran its vCPU flat out (up to a whole host core, less on a host other
    // tests load); the paused idle guest's QEMU uses next to none.
    expect(Math.max(...cpuWhileBusy)).toBeGreaterThan((idleSample.cpuPercent ?? 0) + 10);
    // Memory: 64 MiB written into guest tmpfs are 64 MiB of guest pages the QEMU now holds privately.
    expect(now.memUsedBytes - idleSample.memUsedBytes).toBeGreaterThan(48 * MIB);
    // Disk: 32 MiB of random data synced to the guest's disk are allocated in the overlay.
    expect(now.diskBytes - idleSample.diskBytes).toBeGreaterThan(24 * MIB);
    // Samples are oldest first, at most the ring's 60.
    const at = after.samples.map((s) => s.atMs);
    expect(at).toEqual([...at].sort((a, b) => a - b));
    expect(after.samples.length).toBeLessThanOrEqual(60);

    // Suspended: no QEMU, the samples stay as they were.
    await m.suspend(vmId);
    await m.liveMetrics.sweep();
    const suspended = await client.metrics(vmId);
    expect(suspended.state).toBe("suspended");
    expect(suspended.samples.length).toBeGreaterThan(0);
    await m.liveMetrics.sweep();
    expect((await client.metrics(vmId)).samples).toEqual(suspended.samples);
    const lastBefore = last(suspended)?.atMs ?? 0;

    // Resumed: a new QEMU; its first sample has no rate yet.
    await m.resume(vmId);
    await m.liveMetrics.sweep();
    const first = (await client.metrics(vmId)).samples.find((s) => s.atMs > lastBefore);
    expect(first).toBeDefined();
    expect(first?.cpuPercent).toBeNull();

    // An unknown VM is the agent's not_found.
    await expect(client.metrics("vm-doesnotexist")).rejects.toMatchObject({ code: "not_found" });
    await m.destroy(vmId, { force: true });
  },
  VM_TEST_TIMEOUT_MS,
);
