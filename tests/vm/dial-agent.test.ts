/**
 * A BYOC agent that dials out (docs/regions.md "BYOC agents: who dials whom"): a real routing
 * gateway (PGlite) and a real agent HTTP server over REAL busybox VMs under TCG (BootDriver),
 * enrolled with a dial-out token: its row's URL is `dial://<id>`, an address no gateway can
 * connect to, and every call reaches it through the link its dialer opened to the gateway. Shown
 * through the public API: a create, an exec, a 4 MiB file up and back (streamed both ways, past
 * one stream's window), and a sandbox's terminal (a WebSocket carried over the link). With the
 * link down (the dialer stopped, the agent still serving and heartbeating) the agent leaves
 * placement and its sandbox's calls fail `agent_unavailable` at once; the dialer back, they work.
 */
import { afterAll, afterEach, expect, test } from "bun:test";
import { randomBytes } from "node:crypto";
import { copyFile, rm } from "node:fs/promises";
import { join } from "node:path";
import { eq } from "drizzle-orm";
import WebSocket from "ws";
import { type Dialer, startDialer } from "../../agent/api/dial.ts";
import { SandboxManager } from "../../agent/sandbox/manager.ts";
import { agents } from "../../db/schema/agents.ts";
import { createKey } from "../../gateway/auth/keys.ts";
import { upsertPublicTemplate } from "../../gateway/core/templates.ts";
import { callGateway, startEnrolledAgent, startRoutingGateway } from "../support/agents.ts";
import { BootDriver } from "../support/boot-driver.ts";
import {
  busyboxArchive,
  leftovers,
  removeBusyboxArchive,
  TEST_CACHE_DIR,
  tempStateDir,
} from "../support/real-vm.ts";

const SECRET = "dial-test-agent-secret-0123456789abcdef-xyz";
const HB_MS = 200;
const STALE_MS = 1_500;
const VM_TEST_TIMEOUT_MS = 300_000;
/** A link (re)opens within a redial (1 s) and a handshake; generous for a loaded 2-core host. */
const LINK_MS = 20_000;

const cleanups: Array<() => Promise<void>> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});
afterAll(removeBusyboxArchive);

const api = callGateway;

/** Sends `input` to the sandbox's terminal and reads until `want` shows (or the bound). */
function terminal(url: string, key: string, id: string, input: string, want: string): Promise<string> {
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(`${url.replace(/^http/, "ws")}/v1/sandboxes/${id}/pty`, {
      headers: { authorization: `Bearer ${key}` },
      perMessageDeflate: false,
    });
    let seen = "";
    const timer = setTimeout(() => {
      ws.terminate();
      reject(new Error(`the terminal never showed ${want}: ${JSON.stringify(seen)}`));
    }, LINK_MS);
    ws.on("open", () => ws.send(Buffer.from(input)));
    ws.on("message", (d: Buffer) => {
      seen += d.toString();
      if (seen.includes(want)) {
        clearTimeout(timer);
        ws.close();
        resolve(seen);
      }
    });
    ws.on("unexpected-response", (_q, res) => reject(new Error(`terminal refused: ${res.statusCode}`)));
    ws.on("error", reject);
  });
}

test(
  "a dial-out agent serves creates, execs, streamed files and a terminal through its link alone",
  async () => {
    const gw = await startRoutingGateway({
      agentSecret: SECRET,
      staleAfterMs: STALE_MS,
      agentWaitMs: LINK_MS,
      onCleanup: (c) => cleanups.push(c),
    });
    const key = await gw.withDb(async (db) => {
      await upsertPublicTemplate(
        { db, clock: Date.now },
        { id: "busybox", name: "busybox", description: "test", status: "ready" },
      );
      return (await createKey(db, gw.config.keyPepper, { tenant: "byoc", tier: "pro" })).key;
    });
    const stateDir = await tempStateDir();
    const driver = await BootDriver.create({ cacheDir: TEST_CACHE_DIR, stateDir });
    const manager = await SandboxManager.open({ driver, stateDir, capacity: { slots: 4 } });
    const archive = join(stateDir, "busybox.tar");
    await copyFile(await busyboxArchive(), archive);
    manager.buildTemplate("busybox", { kind: "archive", path: archive }, { vcpus: 1, memMib: 256 });
    const { server, hb, credentials, dialer } = await startEnrolledAgent({
      gw,
      agentSecret: SECRET,
      manager,
      stateDir,
      id: "byoc-1",
      region: "eu",
      intervalMs: HB_MS,
      dial: true,
    });
    let link: Dialer | undefined = dialer;
    cleanups.push(async () => {
      link?.stop();
      hb.stop();
      await server.stop();
      for (const s of manager.list()) await manager.destroy(s.id, { force: true });
      await manager.detach();
      const left = await leftovers(stateDir);
      await rm(stateDir, { recursive: true, force: true });
      expect(left).toEqual({ qemus: [], vmDirs: [] });
    });
    for (let i = 0; manager.templates.status("busybox").status !== "ready"; i++) {
      if (manager.templates.status("busybox").status === "failed" || i > 1800) throw new Error("no template");
      await Bun.sleep(100);
    }
    await hb.first;
    // The gateway holds no address for it: only its link reaches it.
    const [row] = await gw.withDb((db) => db.select().from(agents).where(eq(agents.id, "byoc-1")));
    expect(row?.url).toBe("dial://byoc-1");
    expect(row?.urlPinned).toBe(true);

    const created = await api(gw.url, key, "POST", "/v1/sandboxes", { template: "busybox" });
    expect(created.status).toBe(201);
    const id = ((await created.json()) as { id: string }).id;
    const ran = await api(gw.url, key, "POST", `/v1/sandboxes/${id}/exec`, { command: "echo over-the-link" });
    expect(((await ran.json()) as { stdout: string }).stdout.trim()).toBe("over-the-link");

    // 4 MiB up and back: sixteen windows of one stream each way.
    const blob = randomBytes(4 << 20);
    const put = await api(gw.url, key, "PUT", `/v1/sandboxes/${id}/files?path=/tmp/blob`, blob);
    expect(put.status).toBe(200);
    const got = await api(gw.url, key, "GET", `/v1/sandboxes/${id}/files?path=/tmp/blob`);
    expect(got.status).toBe(200);
    expect(Buffer.from(await got.arrayBuffer()).equals(blob)).toBe(true);

    // A terminal: a WebSocket from the client, relayed by the gateway over the link.
    expect(await terminal(gw.url, key, id, "echo term-$((6*7))\n", "term-42")).toContain("term-42");

    // The link down, the agent still serving and heartbeating: its sandbox's calls fail at once
    // and it takes no create (no other agent: at_capacity after the wait, here cut short).
    link?.stop();
    link = undefined;
    const t0 = performance.now();
    let down = await api(gw.url, key, "POST", `/v1/sandboxes/${id}/exec`, { command: "true" });
    for (let i = 0; down.status === 200 && i < 100; i++) {
      await Bun.sleep(50);
      down = await api(gw.url, key, "POST", `/v1/sandboxes/${id}/exec`, { command: "true" });
    }
    expect(down.status).toBe(503);
    expect(((await down.json()) as { code: string }).code).toBe("agent_unavailable");
    const downMs = performance.now() - t0;

    // Dialled again: the same sandbox answers.
    link = startDialer({
      gatewayUrls: [gw.url],
      credentials,
      target: { host: "127.0.0.1", port: Number(new URL(server.url).port) },
      log: () => {},
    });
    const t1 = performance.now();
    let back = await api(gw.url, key, "POST", `/v1/sandboxes/${id}/exec`, { command: "echo back" });
    while (back.status !== 200 && performance.now() - t1 < LINK_MS) {
      await Bun.sleep(100);
      back = await api(gw.url, key, "POST", `/v1/sandboxes/${id}/exec`, { command: "echo back" });
    }
    expect(((await back.json()) as { stdout: string }).stdout.trim()).toBe("back");
    console.log(
      `DIAL_AGENT ${JSON.stringify({ link_down_to_unavailable_ms: Math.round(downMs), redial_to_answer_ms: Math.round(performance.now() - t1) })}`,
    );
    expect((await api(gw.url, key, "DELETE", `/v1/sandboxes/${id}`)).status).toBe(200);
  },
  VM_TEST_TIMEOUT_MS,
);
