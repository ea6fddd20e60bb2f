/**
 * Snapshots and rollback in place, black-box, in a running service (`bin/sandboxd up`, real VMs
 * of the python template, the real HTTP API, docs/snapshots.md):
 *
 * - a sandbox with a file, a background process counting in memory and an open terminal
 *   WebSocket is snapshotted; then everything changes (the file, a new file, the process killed);
 *   `POST .../restore` rolls it back in place (timed, printed as JSON): the same id, the file as it
 *   was, the new file gone, the process alive again counting on from the snapshot's value, and the
 *   terminal closed with a reason naming the snapshot;
 * - three sandboxes created from the snapshot each have the file and the counting process, and
 *   each diverges from the others afterwards;
 * - the restore's refusals through the API: another tenant's snapshot (404), a bad body (400).
 *
 * Tests run in order and share one service; the last stops it and checks no QEMU is left.
 */
import { beforeAll, expect, test } from "bun:test";
import WebSocket from "ws";
import * as B from "../../contracts/api/sandboxes-api.ts";
import {
  expectError,
  expectOk,
  GUEST_COUNTER,
  START_GUEST_COUNTER,
  waitFor,
} from "../support/e2e-service.ts";
import { useService } from "../support/service.ts";

const PYTHON = "python";
/** A create, a snapshot, a restore and three creates from it: seconds each on a loaded TCG host. */
const TEST_TIMEOUT_MS = 300_000;
/** A terminal's first output (the shell's prompt) or its close: a loaded, emulated guest. */
const TERMINAL_WAIT_MS = 20_000;

const fx = useService({ keys: { key: ["acme", "pro"], other: ["evil", "pro"] } });
let key = "";
let other = "";
beforeAll(() => {
  ({ key, other } = fx.keys);
});
const api = () => fx.api;
const live = new Set<string>();

async function create(body: Record<string, unknown>): Promise<string> {
  const res = await api().post("/v1/sandboxes", { key, json: body });
  const id = expectOk(res, 201, B.CreateSandboxResponse).id;
  live.add(id);
  fx.cleanup(async () => {
    if (live.delete(id)) await fx.api.delete(`/v1/sandboxes/${id}`, { key });
  });
  return id;
}

async function exec(id: string, command: string): Promise<string> {
  const res = await api().post(`/v1/sandboxes/${id}/exec`, { key, json: { command, timeout_seconds: 60 } });
  const r = expectOk(res, 200, B.ExecResponseB);
  expect({ command, exit: r.exit_code, stderr: r.stderr }).toMatchObject({ exit: 0 });
  return r.stdout;
}

const counter = async (id: string) => Number((await exec(id, `cat ${GUEST_COUNTER}`)).trim());
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** A terminal WebSocket to the sandbox, open, its shell's first output read; and its close. */
async function openTerminal(
  id: string,
): Promise<{ ws: WebSocket; closed: Promise<{ code: number; reason: string }> }> {
  const url = `${fx.svc.url.replace(/^http/, "ws")}/v1/sandboxes/${id}/pty?cols=80&rows=24`;
  const ws = new WebSocket(url, { headers: { authorization: `Bearer ${key}` }, perMessageDeflate: false });
  let out = "";
  ws.on("message", (d: Buffer) => {
    out += d.toString("utf8");
  });
  const closed = new Promise<{ code: number; reason: string }>((resolve) =>
    ws.once("close", (code, reason) => resolve({ code, reason: reason.toString() })),
  );
  await new Promise<void>((resolve, reject) => {
    ws.once("open", () => resolve());
    ws.once("error", reject);
  });
  expect(await waitFor(async () => out.length > 0, TERMINAL_WAIT_MS)).toBe(true);
  return { ws, closed };
}

let snapshot = "";
let pid = 0;
let atSnapshot = 0;

test(
  "rollback in place: the file, the counting process and its value come back; the open terminal is told",
  async () => {
    const id = await create({ template: PYTHON });
    await exec(id, "echo before > /root/f");
    pid = Number((await exec(id, START_GUEST_COUNTER)).trim());
    expect(pid).toBeGreaterThan(1);
    const term = await openTerminal(id);

    const taken = expectOk(
      await api().post(`/v1/sandboxes/${id}/snapshots`, { key, json: { name: "before" } }),
      201,
      B.SnapshotInfo,
    );
    expect(taken).toMatchObject({ state: "ready", source_sandbox: id });
    snapshot = taken.id;
    // Read right after the snapshot answered: the value at the snapshot is at most this.
    atSnapshot = await counter(id);

    // Change everything.
    await exec(id, `echo after > /root/f && touch /root/new && kill ${pid}`);
    await sleep(1000);
    expect((await exec(id, `kill -0 ${pid} 2>/dev/null || echo dead`)).trim()).toBe("dead");

    const t0 = performance.now();
    const restored = expectOk(
      await api().post(`/v1/sandboxes/${id}/restore`, { key, json: { snapshot } }),
      200,
      B.RestoreResponse,
    );
    const wallMs = performance.now() - t0;
    console.log(
      JSON.stringify({
        restore: { wall_ms: wallMs, restore_ms: restored.restore_ms, down_ms: restored.down_ms },
      }),
    );
    expect(restored).toMatchObject({ id, state: "running", snapshot });

    // The open terminal was told what happened, in its close reason.
    const closed = await Promise.race([term.closed, sleep(TERMINAL_WAIT_MS).then(() => undefined)]);
    expect(closed?.reason ?? "").toContain(`restored to snapshot ${snapshot}`);

    // The same sandbox, as it was.
    const info = expectOk(await api().get(`/v1/sandboxes/${id}`, { key }), 200, B.SandboxInfo);
    expect(info).toMatchObject({ id, state: "running" });
    expect((await exec(id, "cat /root/f")).trim()).toBe("before");
    expect((await exec(id, "ls /root/new 2>/dev/null || echo absent")).trim()).toBe("absent");
    expect((await exec(id, `kill -0 ${pid} && echo alive`)).trim()).toBe("alive");
    const first = await counter(id);
    expect(first).toBeLessThanOrEqual(atSnapshot);
    await sleep(600);
    expect(await counter(id)).toBeGreaterThan(first);
    // And a terminal opens again on the restored VM.
    const again = await openTerminal(id);
    again.ws.close(1000);
  },
  TEST_TIMEOUT_MS,
);

test(
  "three sandboxes from the snapshot each have the file and the counting process, then diverge",
  async () => {
    const kids: string[] = [];
    for (let i = 0; i < 3; i++) kids.push(await create({ snapshot }));
    for (const kid of kids) {
      expect((await exec(kid, "cat /root/f")).trim()).toBe("before");
      expect((await exec(kid, `kill -0 ${pid} && echo alive`)).trim()).toBe("alive");
      const first = await counter(kid);
      await sleep(600);
      expect(await counter(kid)).toBeGreaterThan(first);
    }
    for (const [i, kid] of kids.entries()) await exec(kid, `echo kid${i} > /root/f`);
    for (const [i, kid] of kids.entries()) expect((await exec(kid, "cat /root/f")).trim()).toBe(`kid${i}`);
  },
  TEST_TIMEOUT_MS,
);

test(
  "refusals: another tenant's snapshot is 404, a bad body 400, a deleted snapshot 404; the sandbox runs on",
  async () => {
    const id = await create({ template: PYTHON });
    await exec(id, "echo mine > /root/f");
    // Another tenant names this tenant's snapshot for its own sandbox: 404, as a missing one.
    const res = await api().post("/v1/sandboxes", { key: other, json: { template: PYTHON } });
    const theirs = expectOk(res, 201, B.CreateSandboxResponse).id;
    const foreign = await api().post(`/v1/sandboxes/${theirs}/restore`, { key: other, json: { snapshot } });
    expectError(foreign, 404, "not_found");
    expectOk(await api().delete(`/v1/sandboxes/${theirs}`, { key: other }), 200, B.DeleteSandboxResponse);
    // And this tenant's sandbox named with the other's key: 404.
    expectError(
      await api().post(`/v1/sandboxes/${id}/restore`, { key: other, json: { snapshot } }),
      404,
      "not_found",
    );
    for (const json of [{}, { snapshot: 7 }, { snapshot: "nope" }])
      expectError(await api().post(`/v1/sandboxes/${id}/restore`, { key, json }), 400, "bad_request");
    expectOk(await api().delete(`/v1/snapshots/${snapshot}`, { key }), 200, B.DeleteSnapshotResponse);
    expectError(
      await api().post(`/v1/sandboxes/${id}/restore`, { key, json: { snapshot } }),
      404,
      "not_found",
    );
    expect((await exec(id, "cat /root/f")).trim()).toBe("mine");
    for (const s of [...live]) {
      live.delete(s);
      expectOk(await api().delete(`/v1/sandboxes/${s}`, { key }), 200, B.DeleteSandboxResponse);
    }
    await fx.expectNoVms();
  },
  TEST_TIMEOUT_MS,
);
