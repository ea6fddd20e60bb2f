import { afterAll, afterEach, describe, expect, test } from "bun:test";
import { copyFile, rm } from "node:fs/promises";
import { createServer, type Socket } from "node:net";
import { join } from "node:path";
import { SignJWT } from "jose";
import { createAgentApp } from "../../agent/api/app.ts";
import { vmMemoryBytes } from "../../agent/qemu/cgroup.ts";
import { SandboxManager } from "../../agent/sandbox/manager.ts";
import type { ExecAction } from "../../contracts/agent/api.ts";
import { AgentHttpClient } from "../../gateway/agents/client.ts";
import { errorOf } from "../support/agents.ts";
import { BootDriver } from "../support/boot-driver.ts";
import {
  busyboxArchive,
  leftovers,
  removeBusyboxArchive,
  TEST_CACHE_DIR,
  tempStateDir,
  waitFor,
} from "../support/real-vm.ts";

/**
 * The agent's HTTP API with REAL VMs under TCG, served by Bun.serve on 127.0.0.1:0 and driven by
 * the gateway's client (`AgentHttpClient implements AgentApi`): template upload and build,
 * create -> exec -> busy -> destroy, JWT checks, kill -9 of QEMU mid-exec, restart re-adoption,
 * and a silent agent. Each test ends with the leak check on its own state dir.
 */

/** Each cold boot is ~2-3 s under TCG, plus the image import on a cold cache (~5 s). */
const VM_TEST_TIMEOUT_MS = 180_000;
/**
 * A bound for what takes a second or less (a state change, an error after a kill): it only
 * catches a hang, on a 2-core TCG host shared with other test files.
 */
const HANG_MS = 30_000;
const SECRET = "test-secret-0123456789abcdef-0123456789";
/** The agent's enrolled identity: its id and key. */
const CREDS = { id: "test-agent", key: SECRET };

const cleanups: Array<() => Promise<void>> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});
afterAll(removeBusyboxArchive);

interface Agent {
  manager: SandboxManager;
  server: ReturnType<typeof Bun.serve>;
  client: AgentHttpClient;
  url: string;
}

async function startAgent(stateDir: string): Promise<Agent> {
  const driver = await BootDriver.create({ cacheDir: TEST_CACHE_DIR, stateDir });
  const manager = await SandboxManager.open({ driver, stateDir });
  const app = createAgentApp({ manager, credentials: CREDS, uploadDir: join(stateDir, "uploads") });
  // idleTimeout 0: an exec may hold a request open far longer than Bun's 10 s default.
  const server = Bun.serve({ hostname: "127.0.0.1", port: 0, fetch: app.fetch, idleTimeout: 0 });
  const url = `http://127.0.0.1:${server.port}`;
  return {
    manager,
    server,
    url,
    client: new AgentHttpClient({ baseUrl: url, agentId: CREDS.id, key: SECRET }),
  };
}

/** An agent with the busybox template uploaded and built through the API. */
async function setup(): Promise<{ agent: Agent; stateDir: string; agents: Agent[] }> {
  const stateDir = await tempStateDir();
  const agent = await startAgent(stateDir);
  const agents = [agent];
  cleanups.push(async () => {
    for (const a of agents) {
      for (const s of a.manager.list()) await a.manager.destroy(s.id, { force: true });
      a.server.stop(true);
    }
    const left = await leftovers(stateDir);
    await rm(stateDir, { recursive: true, force: true });
    expect(left).toEqual({ qemus: [], vmDirs: [] });
  });
  // The gateway streamed the upload to a file it hands over; the client deletes it after.
  const upload = join(stateDir, "gateway-upload.tar");
  await copyFile(await busyboxArchive(), upload);
  await agent.client.buildTemplate("busybox", { kind: "upload", path: upload, memMib: 256, vcpuCount: 1 });
  expect(await Bun.file(upload).exists()).toBe(false);
  const built = await waitFor(
    async () => (await agent.client.templateStatus("busybox")).status !== "building",
    VM_TEST_TIMEOUT_MS / 2,
  );
  expect(built).toBe(true);
  expect(await agent.client.templateStatus("busybox")).toMatchObject({ status: "ready", phase: "Live" });
  return { agent, stateDir, agents };
}

const shell = (command: string, timeoutMs = 30_000): ExecAction => ({
  files: [],
  run: { kind: "shell", command },
  timeoutMs,
});

describe("agent HTTP API with real VMs", () => {
  test(
    "create -> exec -> busy on a concurrent exec -> destroy, health with capacity",
    async () => {
      const { agent } = await setup();
      const c = agent.client;
      const h0 = await c.health();
      expect(h0.ok).toBe(true);
      expect(h0.capacity.slotsTotal).toBeGreaterThan(0);

      const vm = await c.createSandbox("busybox", { kind: "sandbox" });
      expect(vm).toMatchObject({ resources: { vcpus: 1, memMib: 256 }, endpoints: {} });
      const h1 = await c.health();
      // A VM holds its guest RAM and, beside it, QEMU's overhead and (TCG) translation cache.
      expect(h1.capacity.memMibFree).toBe(
        h0.capacity.memMibFree - vmMemoryBytes(256, agent.manager.accel === "tcg") / 2 ** 20,
      );

      const r = await c.exec(vm.vmId, {
        files: [{ path: "/tmp/in.txt", content: "payload" }],
        run: { kind: "shell", command: "cat /tmp/in.txt; echo; echo err >&2" },
        timeoutMs: 30_000,
        seed: "deadbeef",
      });
      expect(r).toMatchObject({ stdout: "payload\n", stderr: "err\n", exitCode: 0, seedAck: "verified" });

      // Round trip of a trivial exec through HTTP + JWT + guest, warm VM (median of 5).
      const times: number[] = [];
      for (let i = 0; i < 5; i++) {
        const t0 = performance.now();
        const rt = await c.exec(vm.vmId, {
          files: [],
          run: { kind: "argv", commands: [["true"]] },
          timeoutMs: 30_000,
        });
        times.push(performance.now() - t0);
        expect(rt).toMatchObject({ stdout: "", stderr: "", exitCode: 0 });
      }
      times.sort((a, b) => a - b);
      console.log(
        `[agent-api] create ${vm.createTimeMs.toFixed(0)} ms; exec round trip median ${times[2]!.toFixed(1)} ms`,
      );

      const slow = c.exec(vm.vmId, shell("sleep 3; echo slow-done"));
      expect(await waitFor(() => agent.manager.info(vm.vmId).state === "busy", HANG_MS)).toBe(true);
      const busy = await errorOf(c.exec(vm.vmId, shell("true")));
      expect(busy.code).toBe("busy");
      expect((await errorOf(c.fork(vm.vmId, 1))).code).toBe("busy");
      expect((await slow).stdout).toBe("slow-done\n");

      // fork/suspend need the snapshot driver: typed, not a 500
      expect((await errorOf(c.suspend(vm.vmId))).code).toBe("unsupported");
      expect((await errorOf(c.createSandbox("no-such-template", { kind: "sandbox" }))).code).toBe(
        "not_found",
      );

      await c.destroy(vm.vmId, { force: false });
      await c.destroy(vm.vmId, { force: false }); // idempotent
      expect((await errorOf(c.exec(vm.vmId, shell("true")))).code).toBe("not_found");

      const once = await c.execOnce("busybox", {
        files: [],
        run: { kind: "code", code: "echo once" },
        timeoutMs: 30_000,
      });
      expect(once).toMatchObject({ stdout: "once\n", exitCode: 0 });
      expect(once.forkTimeMs).toBeGreaterThan(0);

      // docs/templates.md "Rules of templates": a delete while a VM runs on the template lets it finish; nothing new spawns,
      // the ref cannot be built again, and the template goes with its last VM.
      const last = await c.createSandbox("busybox", { kind: "sandbox" });
      await c.deleteTemplate("busybox");
      expect((await errorOf(c.templateStatus("busybox"))).code).toBe("not_found");
      expect((await errorOf(c.createSandbox("busybox", { kind: "sandbox" }))).code).toBe("not_found");
      expect((await errorOf(c.buildTemplate("busybox", { kind: "oci", image: "r.example/x:1" }))).code).toBe(
        "conflict",
      );
      expect((await c.exec(last.vmId, shell("echo still"))).stdout).toBe("still\n");
      expect(agent.manager.templates.deletingIds()).toEqual(["busybox"]);
      await c.destroy(last.vmId, { force: false });
      expect(await waitFor(() => agent.manager.templates.deletingIds().length === 0, HANG_MS)).toBe(true);
      expect((await errorOf(c.templateStatus("busybox"))).code).toBe("not_found");
    },
    VM_TEST_TIMEOUT_MS,
  );

  test("requests without a valid short-lived gateway token get 401", async () => {
    const stateDir = await tempStateDir();
    cleanups.push(() => rm(stateDir, { recursive: true, force: true }));
    // No VM is needed: the manager is never reached.
    const driver = await BootDriver.create({ cacheDir: TEST_CACHE_DIR, stateDir });
    const manager = await SandboxManager.open({ driver, stateDir });
    const app = createAgentApp({ manager, credentials: CREDS, uploadDir: join(stateDir, "uploads") });
    const key = new TextEncoder().encode(SECRET);
    const sign = (o: {
      aud?: string;
      iss?: string;
      life?: string | number;
      key?: Uint8Array;
      iat?: number;
    }) => {
      const j = new SignJWT({}).setProtectedHeader({ alg: "HS256" }).setIssuer(o.iss ?? "sandboxd-gateway");
      j.setAudience(o.aud ?? "sandboxd-agent:test-agent").setIssuedAt(o.iat ?? Math.floor(Date.now() / 1000));
      return j.setExpirationTime(o.life ?? "30s").sign(o.key ?? key);
    };
    const status = async (auth: string | undefined) => {
      const res = await app.request("/v1/health", auth ? { headers: { authorization: auth } } : {});
      const body = (await res.json()) as { code: string };
      return `${res.status} ${res.status === 200 ? "" : body.code}`.trim();
    };
    expect(await status(`Bearer ${await sign({})}`)).toBe("200");
    expect(await status(undefined)).toBe("401 unauthorized");
    expect(await status("Basic abc")).toBe("401 unauthorized");
    expect(await status("Bearer not.a.jwt")).toBe("401 unauthorized");
    expect(await status(`Bearer ${await sign({ key: new TextEncoder().encode("x".repeat(40)) })}`)).toBe(
      "401 unauthorized",
    );
    expect(await status(`Bearer ${await sign({ aud: "someone-else" })}`)).toBe("401 unauthorized");
    // Signed with this agent's key but made out to another agent (and the old shared audience).
    expect(await status(`Bearer ${await sign({ aud: "sandboxd-agent:other-agent" })}`)).toBe(
      "401 unauthorized",
    );
    expect(await status(`Bearer ${await sign({ aud: "sandboxd-agent" })}`)).toBe("401 unauthorized");
    expect(await status(`Bearer ${await sign({ iss: "someone-else" })}`)).toBe("401 unauthorized");
    expect(await status(`Bearer ${await sign({ life: "120s" })}`)).toBe("401 unauthorized"); // > 60 s
    const old = Math.floor(Date.now() / 1000) - 100;
    expect(await status(`Bearer ${await sign({ iat: old, life: old + 30 })}`)).toBe("401 unauthorized"); // expired
    const noneAlg = `${Buffer.from('{"alg":"none"}').toString("base64url")}.${Buffer.from(
      JSON.stringify({ aud: "sandboxd-agent:test-agent", iss: "sandboxd-gateway", exp: old + 1000 }),
    ).toString("base64url")}.`;
    expect(await status(`Bearer ${noneAlg}`)).toBe("401 unauthorized");
    // A wrong secret in the client is the same 401, surfaced as a typed error.
    const server = Bun.serve({ hostname: "127.0.0.1", port: 0, fetch: app.fetch });
    try {
      const bad = new AgentHttpClient({
        baseUrl: `http://127.0.0.1:${server.port}`,
        agentId: CREDS.id,
        key: "y".repeat(40),
      });
      expect((await errorOf(bad.health())).code).toBe("unauthorized");
    } finally {
      server.stop(true);
    }
  });

  test(
    "kill -9 of the QEMU mid-exec: the HTTP caller gets a clear `gone` error promptly",
    async () => {
      const { agent } = await setup();
      const c = agent.client;
      const vm = await c.createSandbox("busybox", { kind: "sandbox" });
      const pid = agent.manager.info(vm.vmId).qemuPid!;
      const pending = errorOf(c.exec(vm.vmId, shell("sleep 60")));
      expect(await waitFor(() => agent.manager.info(vm.vmId).state === "busy", HANG_MS)).toBe(true);
      const t0 = performance.now();
      process.kill(pid, "SIGKILL");
      const err = await pending;
      // Only catches a hang: without the QEMU's death noticed, the exec would run its 60 s.
      expect(performance.now() - t0).toBeLessThan(HANG_MS);
      expect(err.code).toBe("gone");
      expect(err.message).toContain("QEMU exited (signal SIGKILL)");
      expect((await errorOf(c.exec(vm.vmId, shell("true")))).code).toBe("gone");
      await c.destroy(vm.vmId, { force: false });
    },
    VM_TEST_TIMEOUT_MS,
  );

  test(
    "agent restart: a new agent over the same data dir re-adopts the VM; the file is still there",
    async () => {
      const { agent, stateDir, agents } = await setup();
      const vm = await agent.client.createSandbox("busybox", { kind: "sandbox" });
      await agent.client.exec(vm.vmId, {
        files: [{ path: "/root/kept.txt", content: "still here" }],
        run: { kind: "none" },
        timeoutMs: 30_000,
      });
      // The "crash": drop the old agent without destroying anything.
      await agent.manager.detach();
      agent.server.stop(true);
      agents.length = 0;

      const again = await startAgent(stateDir);
      agents.push(again);
      expect((await again.client.templateStatus("busybox")).status).toBe("ready");
      const r = await again.client.exec(vm.vmId, shell("cat /root/kept.txt"));
      expect(r.stdout).toBe("still here");
      await again.client.destroy(vm.vmId, { force: true });
    },
    VM_TEST_TIMEOUT_MS,
  );

  test("an agent that stops answering is `agent_unavailable` within the deadline, not a hang", async () => {
    // Accepts connections and never answers: a wedged agent process.
    const sockets: Socket[] = [];
    const silent = createServer((s) => sockets.push(s));
    await new Promise<void>((r) => silent.listen(0, "127.0.0.1", () => r()));
    const port = (silent.address() as { port: number }).port;
    try {
      const c = new AgentHttpClient({
        baseUrl: `http://127.0.0.1:${port}`,
        agentId: CREDS.id,
        key: SECRET,
        timeouts: { quick: 300 },
      });
      const t0 = performance.now();
      const err = await errorOf(c.health());
      expect(err.code).toBe("agent_unavailable");
      expect(err.message).toContain("did not answer");
      // Only catches a hang: the silent server never answers; the 300 ms deadline ends the call.
      expect(performance.now() - t0).toBeLessThan(HANG_MS);
    } finally {
      for (const s of sockets) s.destroy();
      silent.close();
    }
    // Nobody listening at all: refused at once. Port 1 (tcpmux), not the closed port above: that
    // one another test file's server may take meanwhile; nothing here serves on port 1.
    const dead = new AgentHttpClient({ baseUrl: "http://127.0.0.1:1", agentId: CREDS.id, key: SECRET });
    const err = await errorOf(dead.health());
    expect(err.code).toBe("agent_unavailable");
    expect(err.message).toContain("unreachable");
  });
});
