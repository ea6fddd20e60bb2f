/**
 * Tunnels to guest ports through the agent's HTTP API with REAL VMs under TCG (docs/connect.md "Rules of connect URLs"; docs/sandboxes.md "Rules of the sandboxes API"
 * connect-from-outside, no guest network): the agent server of agent/server.ts over a manager on
 * the snapshot driver, the gateway's `AgentHttpClient.openTunnel` (WebSocket). A busybox httpd
 * started by an exec inside the VM is reached with raw HTTP; a refused port and an unknown VM
 * are clean errors before the upgrade; an open tunnel keeps the VM from being idle-paused; a
 * fork child does not carry its parent's tunnel; destroying the VM ends the tunnel; nothing
 * leaks. Figures (open latency, throughput) are printed as one JSON line (AGENT_TUNNEL_FIGURES).
 */
import { afterAll, expect, test } from "bun:test";
import { createHash } from "node:crypto";
import { rm } from "node:fs/promises";
import { join } from "node:path";
import { ensureGuestArtifacts } from "../../agent/guest/artifacts.ts";
import { SnapshotDriver } from "../../agent/sandbox/drivers/snapshot.ts";
import { SandboxManager } from "../../agent/sandbox/manager.ts";
import { startAgentServer } from "../../agent/server.ts";
import { defaultShmRoot } from "../../agent/snapshot/template.ts";
import type { ExecAction, Tunnel } from "../../contracts/agent/api.ts";
import { AgentHttpClient } from "../../gateway/agents/client.ts";
import { errorOf } from "../support/agents.ts";
import {
  busyboxArchive,
  leftovers,
  removeBusyboxArchive,
  TEST_CACHE_DIR,
  tempStateDir,
  waitFor,
} from "../support/real-vm.ts";

/** A template build, one spawn and one fork under TCG on a 2-core host: 240 s with margin. */
const VM_TEST_TIMEOUT_MS = 240_000;
const SECRET = "test-secret-0123456789abcdef-0123456789";
/** The agent's enrolled identity: its id and key. */
const CREDS = { id: "test-agent", key: SECRET };
/** Short idle pause so the test sees it happen (and not happen) within a second or two. */
const IDLE_PAUSE_MS = 400;
/**
 * A bound for what takes well under a second (the idle pause, a tunnel's end): it only catches a
 * hang, on a 2-core TCG host shared with other test files.
 */
const HANG_MS = 30_000;
const BIG_MIB = 8;

afterAll(removeBusyboxArchive);

const shell = (command: string): ExecAction => ({
  files: [],
  run: { kind: "shell", command },
  timeoutMs: 60_000,
});

/** Everything the tunnel delivers until it ends. */
async function readAll(t: Tunnel): Promise<Buffer> {
  const parts: Uint8Array[] = [];
  for await (const c of t.readable) parts.push(c);
  return Buffer.concat(parts);
}

async function httpGet(t: Tunnel, path: string): Promise<Buffer> {
  const w = t.writable.getWriter();
  await w.write(Buffer.from(`GET ${path} HTTP/1.0\r\nHost: sandbox\r\n\r\n`));
  w.releaseLock();
  return readAll(t); // HTTP/1.0: httpd closes the connection after the answer
}

function body(resp: Buffer): Buffer {
  const i = resp.indexOf("\r\n\r\n");
  return i < 0 ? Buffer.alloc(0) : resp.subarray(i + 4);
}

/**
 * Established IPv4 connections inside the VM whose remote end is `port` (state 01 in
 * /proc/net/tcp): the guest agent's tunnel sockets (busybox httpd's own side is IPv6, tcp6).
 */
async function established(c: AgentHttpClient, vmId: string, port: number): Promise<number> {
  const hex = port.toString(16).toUpperCase().padStart(4, "0");
  const r = await c.exec(vmId, shell(`cat /proc/net/tcp | awk '$4 == "01" && $3 ~ /:${hex}$/' | wc -l`));
  return Number(r.stdout.trim());
}

test(
  "raw HTTP through a tunnel; refused port; idle pause held off; fork child without the tunnel; destroy ends it",
  async () => {
    const stateDir = await tempStateDir();
    const shmRoot = defaultShmRoot(stateDir);
    const figures: Record<string, number> = {};
    const artifacts = await ensureGuestArtifacts({ dataDir: TEST_CACHE_DIR });
    const driver = await SnapshotDriver.create({ cacheDir: TEST_CACHE_DIR, stateDir, artifacts });
    const manager = await SandboxManager.open({ driver, stateDir, idlePauseMs: IDLE_PAUSE_MS });
    const server = startAgentServer({
      manager,
      credentials: CREDS,
      uploadDir: join(stateDir, "uploads"),
      hostname: "127.0.0.1",
      port: 0,
      version: "test",
    });
    const c = new AgentHttpClient({ baseUrl: server.url, agentId: CREDS.id, key: SECRET });
    try {
      manager.buildTemplate("busybox", { kind: "archive", path: await busyboxArchive() });
      await manager.templates.settled("busybox");
      expect(manager.templates.status("busybox")).toMatchObject({ status: "ready" });

      const vm = await c.createSandbox("busybox", { kind: "sandbox" });
      const id = vm.vmId;
      const setup = await c.exec(
        id,
        shell(
          `mkdir -p /srv && echo ok > /srv/health && dd if=/dev/urandom of=/srv/big bs=1M count=${BIG_MIB} 2>/dev/null && sha256sum /srv/big | cut -d' ' -f1 && httpd -p 8080 -h /srv`,
        ),
      );
      expect(setup.exitCode).toBe(0);
      const bigSum = setup.stdout.trim();

      // Errors before the upgrade are the agent's JSON errors.
      expect((await errorOf(c.openTunnel(id, 8081, "tcp"))).code).toBe("port_unreachable");
      expect((await errorOf(c.openTunnel("vm-nope", 8080, "tcp"))).code).toBe("not_found");
      expect((await errorOf(c.openTunnel(id, 0, "tcp"))).code).toBe("bad_request");

      // Raw HTTP; open latency over a few tunnels (the VM is woken from its idle pause first).
      expect(await waitFor(() => manager.info(id).state === "paused", HANG_MS)).toBe(true);
      const opens: number[] = [];
      for (let i = 0; i < 5; i++) {
        const t0 = performance.now();
        const t = await c.openTunnel(id, 8080, "tcp");
        opens.push(performance.now() - t0);
        const resp = await httpGet(t, "/health");
        expect(resp.toString()).toStartWith("HTTP/1.1 200 OK");
        expect(body(resp).toString()).toBe("ok\n");
      }
      figures.open_ms_first = opens[0]!;
      figures.open_ms_p50 = [...opens].sort((a, b) => a - b)[2]!;

      // Throughput guest -> client: the 8 MiB file, checksummed.
      let t0 = performance.now();
      const big = body(await httpGet(await c.openTunnel(id, 8080, "tcp"), "/big"));
      figures.download_mb_s = BIG_MIB / ((performance.now() - t0) / 1000);
      expect(big.length).toBe(BIG_MIB << 20);
      expect(createHash("sha256").update(big).digest("hex")).toBe(bigSum);

      // Throughput client -> guest: 8 MiB into nc, checked inside the VM.
      // Once nc listens (port 9000 = 0x2328 in LISTEN, state 0A), or exit 1 after 10 s.
      const listening = await c.exec(
        id,
        shell(
          "(sleep 600 | nc -l -p 9000 > /tmp/up.bin 2>/dev/null &) ; i=0; " +
            "until cat /proc/net/tcp /proc/net/tcp6 2>/dev/null | awk '$4 == \"0A\"' | grep -q ':2328 '; " +
            "do i=$((i+1)); [ $i -gt 200 ] && exit 1; sleep 0.05; done",
        ),
      );
      expect(listening.exitCode).toBe(0);
      const up = Buffer.alloc(BIG_MIB << 20);
      for (let i = 0; i < up.length; i += 4) up.writeUInt32LE((i * 2654435761) >>> 0, i);
      t0 = performance.now();
      const tu = await c.openTunnel(id, 9000, "tcp");
      const wu = tu.writable.getWriter();
      for (let off = 0; off < up.length; off += 1 << 20) await wu.write(up.subarray(off, off + (1 << 20)));
      await wu.close();
      const size = async () =>
        Number((await c.exec(id, shell("stat -c %s /tmp/up.bin 2>/dev/null || echo 0"))).stdout.trim());
      expect(await waitFor(async () => (await size()) === up.length, 30_000)).toBe(true);
      figures.upload_mb_s = BIG_MIB / ((performance.now() - t0) / 1000);
      const upSum = await c.exec(id, shell("sha256sum /tmp/up.bin | cut -d' ' -f1"));
      expect(upSum.stdout.trim()).toBe(createHash("sha256").update(up).digest("hex"));

      // An open tunnel (httpd waiting for its request) keeps the VM from being idle-paused. (That
      // the pause happens without one was seen above.) Nothing to wait on: four idle graces.
      const held = await c.openTunnel(id, 8080, "tcp");
      await Bun.sleep(IDLE_PAUSE_MS * 4);
      expect(manager.info(id).state).toBe("running");
      expect(await established(c, id, 8080)).toBeGreaterThanOrEqual(1);

      // Fork: the child is a copy of the VM with that connection in its kernel, but its guest
      // agent dropped the tunnel when its host said HELLO; the parent's tunnel still works.
      const [child] = await c.fork(id, 1);
      expect(await waitFor(async () => (await established(c, child!.vmId, 8080)) === 0, HANG_MS)).toBe(true);
      const w = held.writable.getWriter();
      await w.write(Buffer.from("GET /health HTTP/1.0\r\n\r\n"));
      w.releaseLock();
      expect(body(await readAll(held)).toString()).toBe("ok\n");

      // Destroying the VM ends an open tunnel promptly, with an error.
      const last = await c.openTunnel(id, 8080, "tcp");
      const ended = readAll(last).then(
        () => "closed",
        (e: Error) => `error: ${e.message}`,
      );
      t0 = performance.now();
      await c.destroy(id, { force: true });
      const outcome = await ended;
      figures.destroy_to_tunnel_end_ms = performance.now() - t0;
      expect(outcome).toStartWith("error:");
      // Only catches a hang (a tunnel left open after its VM went); the time is in the figures.
      expect(figures.destroy_to_tunnel_end_ms).toBeLessThan(HANG_MS);
      await c.destroy(child!.vmId, { force: true });
    } finally {
      for (const s of manager.list()) await manager.destroy(s.id, { force: true });
      await server.stop();
      await manager.deleteTemplate("busybox").catch(() => {});
      const left = await leftovers(stateDir);
      await rm(stateDir, { recursive: true, force: true });
      await rm(shmRoot, { recursive: true, force: true });
      expect(left).toEqual({ qemus: [], vmDirs: [] });
    }
    const round = (x: number) => Math.round(x * 10) / 10;
    console.log(
      `AGENT_TUNNEL_FIGURES ${JSON.stringify(Object.fromEntries(Object.entries(figures).map(([k, v]) => [k, round(v)])))}`,
    );
  },
  VM_TEST_TIMEOUT_MS,
);
