/**
 * Background processes end to end over real HTTP (`bin/sandboxd up`, real VMs under TCG, a
 * busybox image uploaded as a sessions API template that exposes port 8080): a `busybox httpd` started
 * by `POST .../processes` answers through a connect URL (after the VM was idle-paused with it)
 * while a foreground exec still runs beside it; `DELETE` kills its process group (the guest has no
 * httpd left and the port refuses); logs as JSON and followed as Server-Sent Events show a
 * process's output in order; stdin (JSON and raw) reaches `cat`; the list shows exit codes;
 * another tenant's id is 404, an unknown pid 404, a missing cwd or unknown user 400 (nothing
 * started); the 32-process cap holds (409), a suspend
 * ends the processes (they are listed as ended after the resume), and an idle sandbox is paused
 * with its process unless the process asked for `keep_awake`.
 */

import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdtemp, readFile, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { MAX_EXEC_STDIN_BYTES } from "../../contracts/api/limits.ts";
import * as P from "../../contracts/api/processes.ts";
import * as B from "../../contracts/api/sandboxes-api.ts";
import * as A from "../../contracts/api/sessions-api.ts";
import { busyboxImageSpec, makeDockerArchive } from "../fixtures/images.ts";
import { expectError, expectOk, uploadTemplate, waitFor } from "../support/e2e-service.ts";
import { pausedSeconds, waitForIdlePause } from "../support/idle-pause.ts";
import { assertResponse } from "../support/openapi-check.ts";
import { useService } from "../support/service.ts";
import { wsExchange } from "../support/ws-exchange.ts";

/** A test boots a VM or two (~0.2-1 s each under TCG) and runs a few dozen guest commands. */
const TEST_TIMEOUT_MS = 240_000;
/** One template build (import, boot, snapshot: ~10-60 s under TCG) once `up` runs. */
const SETUP_TIMEOUT_MS = 240_000;
/** A template build: the image import, one boot and the snapshot; generous for a loaded host. */
const BUILD_TIMEOUT_MS = 180_000;
const TEMPLATE = "procs";
const PORT = 8080;
/** The cap of background processes per sandbox (agent/sandbox/processes.ts MAX_PROCESSES). */
const MAX_PROCESSES = 32;

/** The keys' tenant: the idle pause is read from its usage (tests/support/idle-pause.ts). */
const TENANT = "acme";

let imgDir = "";
const liveSandboxes = new Set<string>();
const liveSessions = new Set<string>();

/** Deletes what the tests left through the API; then the template. */
async function deleteLeftovers(): Promise<void> {
  for (const id of liveSessions)
    await fx.api.delete(`/v1/sessions/${id}`, { key: keys.live, query: { force: "true" } }).catch(() => {});
  liveSessions.clear();
  for (const id of liveSandboxes)
    await fx.api.delete(`/v1/sandboxes/${id}`, { key: keys.pro }).catch(() => {});
  liveSandboxes.clear();
  await fx.api.delete(`/v1/templates/${TEMPLATE}`, { key: keys.scale }).catch(() => {});
}

afterAll(async () => {
  if (imgDir) await rm(imgDir, { recursive: true, force: true });
});

const fx = useService({
  prefix: "sbx-e2e-procs-",
  python: false,
  keys: {
    live: [TENANT, "live"],
    scale: [TENANT, "scale"],
    pro: [TENANT, "pro"],
    other: ["evil", "pro"],
  },
});

// Before the fixture stops `up`: what a failed test left goes while `up` still runs.
fx.beforeStop(async () => {
  if (keys && fx.running) await deleteLeftovers();
});

let keys: Record<"live" | "scale" | "pro" | "other", string>;
const service = () => fx.svc;

const api = () => service().api;

beforeAll(async () => {
  keys = fx.keys;
  imgDir = await mkdtemp(join(tmpdir(), "sbx-procs-img-"));
  const spec = await busyboxImageSpec(imgDir, { config: { ExposedPorts: { [`${PORT}/tcp`]: {} } } });
  const archive = await makeDockerArchive(join(imgDir, "busybox.tar"), spec);
  const image = new Uint8Array(await readFile(archive.path));
  await uploadTemplate(service(), keys.scale, TEMPLATE, image, BUILD_TIMEOUT_MS);
}, SETUP_TIMEOUT_MS);

async function createSandbox(): Promise<string> {
  const sb = expectOk(
    await api().post("/v1/sandboxes", { key: keys.pro, json: { template: TEMPLATE } }),
    201,
    B.CreateSandboxResponse,
  );
  liveSandboxes.add(sb.id);
  return sb.id;
}

async function exec(id: string, command: string): Promise<{ stdout: string; exit_code: number }> {
  return expectOk(
    await api().post(`/v1/sandboxes/${id}/exec`, { key: keys.pro, json: { command } }),
    200,
    B.ExecResponseB,
  );
}

interface Ev {
  event: string;
  data: Record<string, unknown>;
}

/**
 * Reads Server-Sent Events until the stream ends: a process's followed logs (GET), or a streamed
 * exec (with `json`, POSTed).
 */
async function follow(
  path: string,
  key: string,
  opened: () => void,
  json?: unknown,
): Promise<{ status: number; events: Ev[]; error?: unknown }> {
  const url = new URL(path, service().url);
  const method = json === undefined ? "GET" : "POST";
  const res = await fetch(url, {
    method,
    headers: {
      authorization: `Bearer ${key}`,
      accept: "text/event-stream",
      ...(json === undefined ? {} : { "content-type": "application/json" }),
    },
    body: json === undefined ? undefined : JSON.stringify(json),
    signal: AbortSignal.timeout(120_000),
  });
  const contentType = res.headers.get("content-type");
  if (!contentType?.startsWith("text/event-stream")) {
    const text = await res.text();
    assertResponse({ method, path: url.pathname, status: res.status, contentType, text });
    return { status: res.status, events: [], error: JSON.parse(text) };
  }
  opened();
  const events: Ev[] = [];
  const reader = res.body!.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let cut = buf.indexOf("\n\n");
    while (cut >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      cut = buf.indexOf("\n\n");
      if (block.startsWith(":")) continue; // a comment (`: open`)
      const name = /^event: (.*)$/m.exec(block)?.[1] ?? "message";
      events.push({ event: name, data: JSON.parse(/^data: (.*)$/m.exec(block)?.[1] ?? "null") });
    }
  }
  expect(buf).toBe("");
  return { status: res.status, events };
}

const stdoutOf = (events: Ev[]) =>
  events
    .filter((e) => e.event === "stdout")
    .map(
      (e) =>
        (e.data.data as string | undefined) ?? Buffer.from(e.data.data_b64 as string, "base64").toString(),
    )
    .join("");

describe("the sandboxes API", () => {
  let id = "";

  test(
    "a background server answers through a connect URL, beside a foreground exec; DELETE kills its group",
    async () => {
      id = await createSandbox();
      const started = expectOk(
        await api().post(`/v1/sandboxes/${id}/processes`, {
          key: keys.pro,
          json: {
            command: `mkdir -p /srv && echo served > /srv/index.html && exec httpd -f -p 127.0.0.1:${PORT} -h /srv`,
          },
        }),
        201,
        P.ProcessInfo,
      );
      expect(started).toMatchObject({ pid: 1, running: true, exit_code: null, keep_awake: false });
      // The process call returned at once; a foreground exec runs beside it (not busy), plain
      // and streamed.
      expect((await exec(id, "echo beside")).stdout).toBe("beside\n");
      const streamed = await follow(`/v1/sandboxes/${id}/exec`, keys.pro, () => {}, {
        command: "echo streamed",
      });
      expect(stdoutOf(streamed.events)).toBe("streamed\n");
      expect(streamed.events.at(-1)).toMatchObject({ event: "exit", data: { exit_code: 0 } });
      const url = expectOk(
        await api().post(`/v1/sandboxes/${id}/connect-url`, {
          key: keys.pro,
          json: { port: PORT, ttl_seconds: 300 },
        }),
        200,
        B.ConnectUrlResponse,
      ).url;
      // Past the agent's 2 s idle pause (seen in the sandbox's metering: the API shows a paused
      // VM as running): the VM is paused with its server, and the connection wakes it.
      const mark = await pausedSeconds(fx.dataDir, TENANT, id);
      expect(await waitForIdlePause(fx.dataDir, TENANT, id, mark, 30_000)).toBe(true);
      let got = { status: 0, text: "" };
      const served = await waitFor(async () => {
        got = await wsExchange(url, "GET /index.html HTTP/1.0\r\n\r\n");
        return got.status === 101 && /^HTTP\/1\.[01] 200 OK/.test(got.text);
      }, 30_000);
      expect({ served, got }).toMatchObject({ served: true, got: { status: 101 } });
      expect(got.text).toEndWith("served\n");

      const list = expectOk(
        await api().get(`/v1/sandboxes/${id}/processes`, { key: keys.pro }),
        200,
        P.ProcessList,
      );
      expect(list.processes).toEqual([
        expect.objectContaining({
          pid: 1,
          running: true,
          exit_code: null,
          command: expect.stringContaining("httpd"),
        }),
      ]);

      expect((await exec(id, "pidof httpd >/dev/null && echo alive")).stdout).toBe("alive\n");
      const killed = expectOk(
        await api().delete(`/v1/sandboxes/${id}/processes/1`, { key: keys.pro }),
        200,
        P.ProcessInfo,
      );
      expect(killed).toMatchObject({ pid: 1, running: false, exit_code: 137 });
      // The guest has no httpd left, and the port refuses.
      expect((await exec(id, "pidof httpd || echo gone")).stdout).toBe("gone\n");
      const refused = await wsExchange(url, "");
      expect(refused.status).toBe(502);
      // A second DELETE of the ended process answers its info again.
      expect(
        expectOk(
          await api().delete(`/v1/sandboxes/${id}/processes/1`, { key: keys.pro }),
          200,
          P.ProcessInfo,
        ),
      ).toMatchObject({ running: false, exit_code: 137 });
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "another tenant's sandbox is 404 on every process route; an unknown pid is 404; a bad body 400",
    async () => {
      const base = `/v1/sandboxes/${id}/processes`;
      expectError(await api().get(base, { key: keys.other }), 404, "not_found");
      expectError(await api().post(base, { key: keys.other, json: { command: "true" } }), 404, "not_found");
      expectError(await api().get(`${base}/1/logs`, { key: keys.other }), 404, "not_found");
      expectError(
        await api().post(`${base}/1/stdin`, { key: keys.other, json: { data: "x" } }),
        404,
        "not_found",
      );
      expectError(await api().delete(`${base}/1`, { key: keys.other }), 404, "not_found");
      expectError(await api().get(`${base}/99/logs`, { key: keys.pro }), 404, "not_found");
      expectError(await api().delete(`${base}/99`, { key: keys.pro }), 404, "not_found");
      expectError(
        await api().post(base, { key: keys.pro, json: { command: "true", argv: ["true"] } }),
        400,
        "bad_request",
      );
    },
    TEST_TIMEOUT_MS,
  );

  test(
    `at most ${MAX_PROCESSES} run at once (409); a suspend ends them, listed as ended after the resume`,
    async () => {
      const base = `/v1/sandboxes/${id}/processes`;
      const pids: number[] = [];
      for (let i = 0; i < MAX_PROCESSES; i++) {
        const p = expectOk(
          await api().post(base, { key: keys.pro, json: { argv: ["sleep", "600"] } }),
          201,
          P.ProcessInfo,
        );
        pids.push(p.pid);
      }
      expectError(
        await api().post(base, { key: keys.pro, json: { argv: ["sleep", "600"] } }),
        409,
        "conflict",
      );
      // The ended httpd was forgotten to make room (the oldest ended goes first).
      const list = expectOk(await api().get(base, { key: keys.pro }), 200, P.ProcessList).processes;
      expect(list.length).toBe(MAX_PROCESSES);
      expect(list.every((p) => p.running)).toBe(true);
      // A start answers once the command is sent; the guest spawns it a moment later.
      let inGuest = "";
      const spawned = await waitFor(async () => {
        inGuest = (await exec(id, "pidof sleep | wc -w")).stdout.trim();
        return inGuest === String(MAX_PROCESSES);
      }, 30_000);
      expect({ spawned, inGuest }).toEqual({ spawned: true, inGuest: String(MAX_PROCESSES) });

      expectOk(await api().post(`/v1/sandboxes/${id}/suspend`, { key: keys.pro }), 200, B.StateResponse);
      expectOk(await api().post(`/v1/sandboxes/${id}/resume`, { key: keys.pro }), 200, B.StateResponse);
      const after = expectOk(await api().get(base, { key: keys.pro }), 200, P.ProcessList).processes;
      expect(after.map((p) => p.pid)).toEqual(pids);
      expect(after.every((p) => !p.running && p.exit_code === 137)).toBe(true);
      expect((await exec(id, "pidof sleep || echo none")).stdout).toBe("none\n");
    },
    TEST_TIMEOUT_MS,
  );
  test(
    "without keep_awake an idle sandbox is paused with its process; with keep_awake it runs on",
    async () => {
      const base = `/v1/sandboxes/${id}/processes`;
      const ticker = "while true; do echo tick; sleep 0.2; done";
      const lines = async (pid: number) =>
        expectOk(
          await api().get(`${base}/${pid}/logs`, { key: keys.pro }),
          200,
          P.ProcessLogsResponse,
        ).stdout.split("\n").length;
      // Logs and lists are answered by the agent from memory: reading them does not wake the VM.
      const idle = expectOk(
        await api().post(base, { key: keys.pro, json: { command: ticker } }),
        201,
        P.ProcessInfo,
      );
      // The agent's 2 s idle pause, seen in the sandbox's metering.
      let mark = await pausedSeconds(fx.dataDir, TENANT, id);
      expect(await waitForIdlePause(fx.dataDir, TENANT, id, mark, 30_000)).toBe(true);
      const a = await lines(idle.pid);
      // Two seconds paused (a span to see nothing happen in, not an ordering).
      await Bun.sleep(2_000);
      const b = await lines(idle.pid);
      expect(a).toBeGreaterThan(1); // it ran before the pause
      expect(b).toBe(a); // and not while paused
      expectOk(await api().delete(`${base}/${idle.pid}`, { key: keys.pro }), 200, P.ProcessInfo);

      const awake = expectOk(
        await api().post(base, { key: keys.pro, json: { command: ticker, keep_awake: true } }),
        201,
        P.ProcessInfo,
      );
      expect(awake.keep_awake).toBe(true);
      // Twice the idle pause and more (a span to see nothing happen in: no pause to wait for).
      mark = await pausedSeconds(fx.dataDir, TENANT, id);
      await Bun.sleep(4_000);
      const c = await lines(awake.pid);
      await Bun.sleep(2_000);
      expect(await lines(awake.pid)).toBeGreaterThan(c);
      // Never paused meanwhile: its metering shows no paused second more.
      expect(await pausedSeconds(fx.dataDir, TENANT, id)).toBeLessThanOrEqual(mark);
      expectOk(await api().delete(`${base}/${awake.pid}`, { key: keys.pro }), 200, P.ProcessInfo);
    },
    TEST_TIMEOUT_MS,
  );
});

describe("the sessions API session", () => {
  test(
    "stdin reaches cat (JSON, then raw with eof); logs as JSON and followed as events; exit codes listed",
    async () => {
      const s = expectOk(
        await api().post("/v1/sessions", { key: keys.live, json: { template_id: TEMPLATE } }),
        201,
        A.CreateSessionResponse,
      );
      liveSessions.add(s.session_id);
      const base = `/v1/sessions/${s.session_id}/processes`;
      const cat = expectOk(
        await api().post(base, { key: keys.live, json: { argv: ["cat"] } }),
        201,
        P.ProcessInfo,
      );
      expect(
        expectOk(
          await api().post(`${base}/${cat.pid}/stdin`, { key: keys.live, json: { data: "hello\n" } }),
          200,
          P.ProcessStdinResponse,
        ),
      ).toEqual({ pid: cat.pid, bytes: 6 });
      // Stdin over its bound in a JSON body is 413, as the raw form's is, not 409 `busy`: refused
      // before the call reaches the sandbox.
      const big = Buffer.alloc(MAX_EXEC_STDIN_BYTES + 1, 0x61).toString("base64");
      for (const json of [{ data_b64: big }, { data: "a".repeat(MAX_EXEC_STDIN_BYTES + 1) }]) {
        expectError(
          await api().post(`${base}/${cat.pid}/stdin`, { key: keys.live, json }),
          413,
          "payload_too_large",
        );
      }
      let logs: P.ProcessLogsResponse | undefined;
      const echoed = await waitFor(async () => {
        logs = expectOk(
          await api().get(`${base}/${cat.pid}/logs`, { key: keys.live }),
          200,
          P.ProcessLogsResponse,
        );
        return logs.stdout === "hello\n";
      }, 30_000);
      expect({ echoed, logs }).toMatchObject({
        echoed: true,
        logs: { truncated: false, process: { running: true } },
      });

      // Follow: the kept output first, then what the raw stdin adds, then `exit` once cat ends.
      let opened!: () => void;
      const open = new Promise<void>((r) => {
        opened = r;
      });
      const followed = follow(`${base}/${cat.pid}/logs`, keys.live, opened);
      await open;
      const raw = await api().post(`${base}/${cat.pid}/stdin`, {
        key: keys.live,
        raw: "world\n",
        query: { eof: "true" },
        headers: { "content-type": "application/octet-stream" },
      });
      expect(expectOk(raw, 200, P.ProcessStdinResponse).bytes).toBe(6);
      const f = await followed;
      expect(f.status).toBe(200);
      expect(stdoutOf(f.events)).toBe("hello\nworld\n");
      const last = f.events.at(-1);
      expect(last?.event).toBe("exit");
      expect(last?.data).toMatchObject({ pid: cat.pid, running: false, exit_code: 0 });
      // Its stdin is closed now: more is 409.
      expectError(
        await api().post(`${base}/${cat.pid}/stdin`, { key: keys.live, json: { data: "late" } }),
        409,
        "conflict",
      );

      const sh = expectOk(
        await api().post(base, {
          key: keys.live,
          json: {
            command: 'echo "out $GREETING"; echo err >&2; exit 3',
            env: { GREETING: "hi" },
            cwd: "/tmp",
          },
        }),
        201,
        P.ProcessInfo,
      );
      const ended = await waitFor(async () => {
        const l = expectOk(await api().get(base, { key: keys.live }), 200, P.ProcessList).processes;
        return l.find((p) => p.pid === sh.pid)?.running === false;
      }, 30_000);
      expect(ended).toBe(true);
      const shLogs = expectOk(
        await api().get(`${base}/${sh.pid}/logs`, { key: keys.live }),
        200,
        P.ProcessLogsResponse,
      );
      expect(shLogs).toMatchObject({ stdout: "out hi\n", stderr: "err\n", process: { exit_code: 3 } });
      // A missing cwd or an unknown user is 400 as for exec, before any answer says it started;
      // nothing is listed for it.
      for (const [json, what] of [
        [{ command: "touch /tmp/nope", cwd: "/no/such/dir" }, "/no/such/dir"],
        [{ command: "touch /tmp/nope", user: "nosuchuser" }, "nosuchuser"],
      ] as const) {
        const bad = await api().post(base, { key: keys.live, json });
        expectError(bad, 400, "bad_request");
        expect((bad.body as { message: string }).message).toContain(what);
      }
      const list = expectOk(await api().get(base, { key: keys.live }), 200, P.ProcessList).processes;
      expect(list.map((p) => [p.pid, p.running, p.exit_code])).toEqual([
        [cat.pid, false, 0],
        [sh.pid, false, 3],
      ]);
      // A followed process that has ended: its kept output, then `exit` at once.
      const again = await follow(`${base}/${sh.pid}/logs`, keys.live, () => {});
      expect(again.events.map((e) => e.event)).toEqual(["stdout", "stderr", "exit"]);
      // A sandboxes API key is refused on a session's routes, as on its exec.
      expectError(await api().get(base, { key: keys.pro }), 403, "forbidden");
    },
    TEST_TIMEOUT_MS,
  );
});

test(
  "teardown: after deleting through the API and SIGTERM, no QEMU process is left for the data dir",
  async () => {
    await deleteLeftovers();
    const { qemus } = await fx.stop();
    expect(qemus).toEqual([]);
  },
  TEST_TIMEOUT_MS,
);
