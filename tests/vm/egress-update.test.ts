/**
 * `PUT /v1/sandboxes/{id}/egress` (docs/egress.md "Changing a sandbox's egress") through a real
 * gateway (PGlite) and a real agent HTTP server enrolled at it, over a REAL busybox VM under TCG
 * (SnapshotDriver, so suspend and resume are real too). From inside the guest: an allowed host
 * answers; after a PUT that drops it a NEW connection is refused and an OPEN one (a CONNECT tunnel
 * held by nc) is closed, seen from both ends; after a PUT that adds it back it answers again. The
 * API's rules: another tenant's id and an unknown one are 404, a malformed or oversized list is
 * 400 with nothing changed, the agent's record on disk (what its restart reads back) holds the new
 * list, a fork inherits it, and a suspended sandbox takes a list without being resumed and
 * resumes under it. A server on host loopback 127.0.0.5 stands in for the allowed host (the
 * operator's range opens that one address); names resolve through a stub fence.
 */
import { afterAll, afterEach, expect, test } from "bun:test";
import { copyFile, readFile, rm } from "node:fs/promises";
import { createServer, type Server, type Socket } from "node:net";
import { join } from "node:path";
import { eq } from "drizzle-orm";
import { EgressFence } from "../../agent/egress/fence.ts";
import { ensureGuestArtifacts } from "../../agent/guest/artifacts.ts";
import { SnapshotDriver } from "../../agent/sandbox/drivers/snapshot.ts";
import { SandboxManager } from "../../agent/sandbox/manager.ts";
import { EGRESS_PORT } from "../../contracts/guest-protocol.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { createKey } from "../../gateway/auth/keys.ts";
import { upsertPublicTemplate } from "../../gateway/core/templates.ts";
import type { RunningGateway } from "../../gateway/server.ts";
import { startEnrolledAgent, startRoutingGateway } from "../support/agents.ts";
import {
  busyboxArchive,
  leftovers,
  removeBusyboxArchive,
  TEST_CACHE_DIR,
  tempStateDir,
  waitFor,
} from "../support/real-vm.ts";

const SECRET = "egress-update-agent-secret-0123456789abcdef";
/** A template build, a spawn, a fork, a suspend and a resume under TCG on a loaded 2-core host. */
const VM_TEST_TIMEOUT_MS = 240_000;
/**
 * A bound on what the guest or the agent does in well under a second (nc seeing its tunnel
 * close, a process's output reaching its logs): it only catches a hang on a loaded TCG host.
 */
const HANG_MS = 30_000;

const cleanups: Array<() => Promise<void>> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});
afterAll(removeBusyboxArchive);

type Body = Record<string, unknown>;

async function call(gw: RunningGateway, key: string, method: string, path: string, json?: unknown) {
  const res = await fetch(`${gw.url}${path}`, {
    method,
    headers: {
      authorization: `Bearer ${key}`,
      ...(json !== undefined ? { "content-type": "application/json" } : {}),
    },
    ...(json !== undefined ? { body: JSON.stringify(json) } : {}),
  });
  const text = await res.text();
  return { status: res.status, body: (text ? JSON.parse(text) : {}) as Body };
}

test(
  "PUT .../egress: new connections follow it at once, an open one it refuses is closed, the record keeps it; 404 foreign, 400 malformed; forks inherit; a suspended sandbox resumes under it",
  async () => {
    // The allowed stand-in: one server answering HTTP, one holding a tunnel open.
    const web = await new Promise<Server>((r) => {
      const s = createServer((sock) =>
        sock.once("data", () =>
          sock.end("HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"),
        ),
      );
      s.listen(0, "127.0.0.5", () => r(s));
    });
    const held: Socket[] = [];
    let heldClosed = 0;
    const holder = await new Promise<Server>((r) => {
      const s = createServer((sock) => {
        held.push(sock);
        sock.on("error", () => {});
        sock.on("close", () => heldClosed++);
        sock.write("HELD\n");
      });
      s.listen(0, "127.0.0.5", () => r(s));
    });
    const portOf = (s: Server) => (s.address() as { port: number }).port;
    cleanups.push(async () => {
      for (const s of held) s.destroy();
      web.close();
      holder.close();
    });

    const gw = await startRoutingGateway({
      agentSecret: SECRET,
      staleAfterMs: 1_500,
      onCleanup: (c) => cleanups.push(c),
    });
    const { key, other } = await gw.withDb(async (db) => {
      await upsertPublicTemplate(
        { db, clock: Date.now },
        { id: "busybox", name: "busybox", description: "test", status: "ready" },
      );
      return {
        key: (await createKey(db, gw.config.keyPepper, { tenant: "egress-a", tier: "pro" })).key,
        other: (await createKey(db, gw.config.keyPepper, { tenant: "egress-b", tier: "pro" })).key,
      };
    });

    const stateDir = await tempStateDir();
    const artifacts = await ensureGuestArtifacts({ dataDir: TEST_CACHE_DIR });
    const driver = await SnapshotDriver.create({ cacheDir: TEST_CACHE_DIR, stateDir, artifacts });
    const logs: string[] = [];
    const fence = new EgressFence({
      allowInternal: ["127.0.0.5/32"],
      resolve: async (name) => {
        throw new Error(`${name}: no such name`);
      },
    });
    const manager = await SandboxManager.open({ driver, stateDir, fence, log: (m) => logs.push(m) });
    const { server, hb } = await startEnrolledAgent({
      gw,
      agentSecret: SECRET,
      manager,
      stateDir,
      id: "egress-agent",
      region: "eu",
      intervalMs: 200,
    });
    cleanups.push(async () => {
      hb.stop();
      await server.stop();
      for (const s of manager.list()) await manager.destroy(s.id, { force: true });
      await manager.detach();
      const left = await leftovers(stateDir);
      await rm(stateDir, { recursive: true, force: true });
      expect(left).toEqual({ qemus: [], vmDirs: [] });
    });
    const tar = join(stateDir, "busybox.tar");
    await copyFile(await busyboxArchive(), tar);
    manager.buildTemplate("busybox", { kind: "archive", path: tar }, { vcpus: 1, memMib: 256 });
    await manager.templates.settled("busybox");
    await hb.first;

    const created = await call(gw, key, "POST", "/v1/sandboxes", {
      template: "busybox",
      egress: { allow: ["127.0.0.5"] },
    });
    expect(created.status).toBe(201);
    const id = created.body.id as string;
    const vmId = (await gw.withDb((db) => db.select().from(sandboxes).where(eq(sandboxes.id, id))))[0]!.vmId!;
    const sh = async (command: string) => {
      const r = await call(gw, key, "POST", `/v1/sandboxes/${id}/exec`, { command, timeout_seconds: 30 });
      expect(r.status).toBe(200);
      return String(r.body.stdout).trim();
    };
    const fetchWeb = () => sh(`wget -q -O - http://127.0.0.5:${portOf(web)}/; echo " rc=$?"`);
    const put = (allow: unknown, k = key, sid = id) =>
      call(gw, k, "PUT", `/v1/sandboxes/${sid}/egress`, allow === undefined ? {} : { allow });
    const recordAllow = async () =>
      (JSON.parse(await readFile(join(stateDir, "records", "sandboxes", `${vmId}.json`), "utf8")) as Body)
        .egressAllow;

    expect(await fetchWeb()).toBe("ok rc=0");

    // An open connection: nc holds a CONNECT tunnel through the guest's proxy to the holder.
    const started = await call(gw, key, "POST", `/v1/sandboxes/${id}/processes`, {
      command: `{ printf 'CONNECT 127.0.0.5:${portOf(holder)} HTTP/1.1\\r\\n\\r\\n'; sleep 600; } | { nc 127.0.0.1 ${EGRESS_PORT}; echo nc-ended; }`,
      keep_awake: true,
    });
    expect(started.status).toBe(201);
    const pid = started.body.pid as number;
    const logsOf = async () =>
      String((await call(gw, key, "GET", `/v1/sandboxes/${id}/processes/${pid}/logs`)).body.stdout ?? "");
    expect(await waitFor(async () => (await logsOf()).includes("HELD"), HANG_MS)).toBe(true);
    expect(await logsOf()).toContain("200 Connection established");
    expect(heldClosed).toBe(0);

    // The API's rules first: nothing below changes the list.
    expect((await put(["example.com"], other)).status).toBe(404);
    expect((await put(["example.com"], key, "sbx_doesnotexist0000")).status).toBe(404);
    for (const bad of [
      ["http://x.com/"],
      ["a..b"],
      Array.from({ length: 257 }, (_, i) => `h${i}.com`),
      "x",
      undefined,
    ]) {
      const r = await put(bad);
      expect(r.status).toBe(400);
      expect(r.body.code).toBe("bad_request");
      expect(typeof r.body.message).toBe("string");
    }
    expect(await recordAllow()).toEqual(["127.0.0.5"]);
    expect(heldClosed).toBe(0);

    // Drop the allowed host: the open tunnel is closed (both ends see it), a new connection refused.
    const dropped = await put(["other.example"]);
    expect(dropped).toEqual({ status: 200, body: { id, egress: { allow: ["other.example"] } } });
    expect(await waitFor(() => heldClosed === 1, HANG_MS)).toBe(true);
    expect(await waitFor(async () => (await logsOf()).includes("nc-ended"), HANG_MS)).toBe(true);
    expect(
      logs.some((l) => l.includes(`egress closed: sandbox ${vmId} -> 127.0.0.5:${portOf(holder)}`)),
    ).toBe(true);
    expect(await fetchWeb()).toContain("rc=1");
    expect(manager.info(vmId).egressRefused.at(-1)?.host).toBe("127.0.0.5");
    // The record an agent restart reads back (agent/sandbox/records.ts) holds the new list.
    expect(await recordAllow()).toEqual(["other.example"]);

    // A fork made now inherits the list in force.
    const fork = await call(gw, key, "POST", `/v1/sandboxes/${id}/fork`, { count: 1 });
    expect(fork.status).toBe(200);
    const childId = (fork.body.children as Body[])[0]!.id as string;
    const childVm = (
      await gw.withDb((db) => db.select().from(sandboxes).where(eq(sandboxes.id, childId)))
    )[0]!.vmId!;
    expect(manager.info(childVm).egressAllow).toEqual(["other.example"]);
    expect((await call(gw, key, "DELETE", `/v1/sandboxes/${childId}`)).status).toBe(200);

    // Add it back: a new connection works again.
    expect((await put(["127.0.0.5"])).body).toEqual({ id, egress: { allow: ["127.0.0.5"] } });
    expect(await fetchWeb()).toBe("ok rc=0");

    // Suspended: the PUT does not resume it, and the resume runs under the new list.
    expect((await call(gw, key, "POST", `/v1/sandboxes/${id}/suspend`)).status).toBe(200);
    expect((await put([])).status).toBe(200);
    expect((await call(gw, key, "GET", `/v1/sandboxes/${id}`)).body.state).toBe("suspended");
    expect(manager.info(vmId).state).toBe("suspended");
    expect((await call(gw, key, "POST", `/v1/sandboxes/${id}/resume`)).status).toBe(200);
    expect(await fetchWeb()).toContain("rc=1");

    expect((await call(gw, key, "DELETE", `/v1/sandboxes/${id}`)).status).toBe(200);
    // Deleted: 404, as every sandbox route.
    expect((await put(["127.0.0.5"])).status).toBe(404);
  },
  VM_TEST_TIMEOUT_MS,
);
