/**
 * End to end over real HTTP, sessions API (docs/sessions.md "Rules of the sessions API") plus what both APIs share: the real service
 * (`bin/sandboxd up` as a subprocess, its own data dir, keys made in-process through its operator socket) and
 * real VMs under TCG. Health, authentication, metrics, one-shot and batch exec, sessions (exec
 * forms, persistence rules, fork, delete), uploaded templates (register, 409 while building,
 * failed builds, delete), the per-key rate limit, and client-side latencies (printed as JSON).
 *
 * Tests in this file run in order and share one service; each deletes what it created, and the
 * last one stops the service and checks that no QEMU process is left for its data dir.
 */

import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { HealthResponse } from "../../contracts/api/health.ts";
import * as A from "../../contracts/api/sessions-api.ts";
import { busyboxImageSpec, makeDockerArchive } from "../fixtures/images.ts";
import { expectError, expectOk, latencySummary, pidsMentioning, qemusUnder } from "../support/e2e-service.ts";
import { useService } from "../support/service.ts";
import { streamedExec as startStreamedExec } from "../support/streamed-exec.ts";

/** Every test boots a handful of VMs at most (~0.1-1 s each under TCG); generous for a slow CI host. */
const TEST_TIMEOUT_MS = 180_000;
const PYTHON = "python";
const UUID_RE = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/;

let imgDir = "";
/** Sessions still alive (id -> key), deleted after each test even when it failed midway. */
const liveSessions = new Map<string, string>();
/** Uploaded templates still registered (id -> scale key). */
const liveTemplates = new Map<string, string>();

const fx = useService({
  keys: {
    live: ["acme", "live"],
    scale: ["acme", "scale"],
    other: ["globex", "live"],
    burst: ["acme", "live"],
  },
});

// Before the fixture stops `up`: what a failed test left goes while `up` still runs.
fx.beforeStop(async () => {
  if (!fx.running) return;
  for (const [id, key] of liveTemplates) {
    await fx.api.delete(`/v1/templates/${id}`, { key }).catch(() => undefined);
    liveTemplates.delete(id);
  }
});

let keys: Record<"live" | "scale" | "other" | "burst", string>;
beforeAll(() => {
  keys = fx.keys;
});
const service = () => fx.svc;

const api = () => service().api;

afterAll(async () => {
  if (imgDir) await rm(imgDir, { recursive: true, force: true });
});

/** A failed test must not leak its sessions into the next one's leak check: deleted after the test unless it did. */
function track(id: string, key: string): void {
  liveSessions.set(id, key);
  fx.cleanup(async () => {
    if (liveSessions.delete(id)) await fx.api.delete(`/v1/sessions/${id}`, { key, query: { force: "true" } });
  });
}

/** A streamed session exec of `commands` (tests/support/streamed-exec.ts). */
function streamedSessionExec(id: string, commands: string[][], key = keys.live) {
  return startStreamedExec(service().url, `/v1/sessions/${id}/exec`, key, { commands });
}

async function createSession(key = keys.live, templateId = PYTHON) {
  const res = await api().post("/v1/sessions", { key, json: { template_id: templateId } });
  const body = expectOk(res, 201, A.CreateSessionResponse);
  track(body.session_id, key);
  return { ...body, ms: res.ms };
}

async function deleteSession(id: string, key = keys.live, force = false) {
  const res = await api().delete(`/v1/sessions/${id}`, { key, query: force ? { force: "true" } : {} });
  expect(res.status).toBe(204);
  expect(res.text).toBe("");
  liveSessions.delete(id);
  return res;
}

async function sessionExec(id: string, body: Record<string, unknown>, key = keys.live) {
  const res = await api().post(`/v1/sessions/${id}/exec`, { key, json: body });
  const r = expectOk(res, 200, A.ExecResultA);
  expect(r.id).toBe(id);
  expect(r.fork_time_ms).toBe(0); // docs/sessions.md#rules-of-the-sessions-api: no per-call spawn in a session
  return r;
}

const sh = (script: string) => ["sh", "-c", script];

describe("health, authentication, metrics", () => {
  test("GET /v1/health needs no key and carries both forms in one object", async () => {
    const res = await api().get("/v1/health");
    const h = expectOk(res, 200, HealthResponse);
    expect(h.status).toBe("ok");
    expect(typeof h.version).toBe("string"); // sandboxes API form
    expect(h.version.length).toBeGreaterThan(0);
    expect(h.templates[PYTHON]).toEqual({ ready: true }); // sessions API form
  });

  test("401 unauthorized without a key or with a bad one", async () => {
    const live = keys.live;
    const bad = [
      undefined,
      "nonsense",
      `${live.slice(0, -1)}${live.endsWith("A") ? "B" : "A"}`, // right shape, wrong secret
      live.replace(/^svc_live_/, "svc_scale_"), // tier segment changed: the hash binds it
      "svc_live_aaaaaaaaaaaa_bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", // unknown key id
    ];
    const calls: Array<[string, string, unknown]> = [
      ["POST", "/v1/exec", { code: "print(1)", template_id: PYTHON }],
      ["POST", "/v1/exec/batch", { executions: [{ code: "print(1)", template_id: PYTHON }] }],
      ["POST", "/v1/sessions", { template_id: PYTHON }],
      ["GET", "/v1/sessions", undefined],
      ["GET", "/v1/templates", undefined],
      ["GET", "/v1/metrics", undefined],
      ["GET", "/v1/sandboxes", undefined],
    ];
    for (const key of bad) {
      for (const [method, path, json] of calls) {
        const res = await api().request(method, path, key === undefined ? { json } : { key, json });
        expectError(res, 401, "unauthorized");
      }
    }
    expect(await qemusUnder(fx.dataDir)).toEqual([]); // nothing was spawned for a refused call
  });

  test("GET /v1/metrics: Prometheus text with a key", async () => {
    const res = await api().get("/v1/metrics", { key: keys.live });
    expect(res.status).toBe(200);
    expect(res.headers.get("content-type") ?? "").toStartWith("text/plain");
    const lines = res.text.split("\n").filter((l) => l.length > 0);
    expect(lines.some((l) => l.startsWith("# TYPE "))).toBe(true);
    for (const l of lines) {
      if (l.startsWith("#")) expect(l).toMatch(/^# (HELP|TYPE) [a-zA-Z_:][a-zA-Z0-9_:]* .+$/);
      else expect(l).toMatch(/^[a-zA-Z_:][a-zA-Z0-9_:]*(\{[^}]*\})? -?[0-9][0-9.e+-]*$/);
    }
  });
});

describe("Sessions API: one-shot and batch exec", () => {
  test(
    "POST /v1/exec runs python code: stdout, stderr, exit code, timings; nothing is left behind",
    async () => {
      const before = await qemusUnder(fx.dataDir);
      expect(before).toEqual([]); // no session exists yet in this file
      const code = [
        "import os, sys",
        "print(6 * 7)",
        "print(os.getcwd())",
        "print('oops', file=sys.stderr)",
        "sys.exit(3)",
      ].join("\n");
      const res = await api().post("/v1/exec", { key: keys.live, json: { code, template_id: PYTHON } });
      const r = expectOk(res, 200, A.ExecResultA);
      expect(r.id).toMatch(UUID_RE);
      expect(r.stdout).toBe("42\n/root\n");
      expect(r.stderr).toBe("oops\n");
      expect(r.exit_code).toBe(3);
      expect(r.fork_time_ms).toBeGreaterThan(0);
      expect(r.exec_time_ms).toBeGreaterThan(0);
      expect(r.total_time_ms).toBeGreaterThanOrEqual(r.exec_time_ms);
      // a one-shot VM is not a session, and no VM or QEMU stays for it
      const list = expectOk(await api().get("/v1/sessions", { key: keys.live }), 200, A.SessionList);
      expect(list.sessions).toEqual([]);
      await fx.expectNoVms();
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "timeout_seconds kills `while True: pass` and the call returns promptly",
    async () => {
      const t0 = performance.now();
      const res = await api().post("/v1/exec", {
        key: keys.live,
        json: {
          code: "print('spin', flush=True)\nwhile True: pass\n",
          template_id: PYTHON,
          timeout_seconds: 2,
        },
      });
      const wall = performance.now() - t0;
      const r = expectOk(res, 200, A.ExecResultA);
      expect(r.exit_code).not.toBe(0);
      expect(r.stdout).toBe("spin\n"); // output before the kill is kept
      expect(r.exec_time_ms).toBeGreaterThanOrEqual(1900);
      expect(wall).toBeLessThan(12_000);
      await fx.expectNoVms();
      // bounds: 1..600 s (docs/limits.md); outside is 400, not a clamp
      for (const t of [0, 601, 1.5]) {
        const bad = await api().post("/v1/exec", {
          key: keys.live,
          json: { code: "print(1)", template_id: PYTHON, timeout_seconds: t },
        });
        expectError(bad, 400, "bad_request");
      }
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "POST /v1/exec: 400 without code or template_id, 404 for an unknown template",
    async () => {
      expectError(await api().post("/v1/exec", { key: keys.live, json: { code: "print(1)" } }), 400);
      expectError(await api().post("/v1/exec", { key: keys.live, json: { template_id: PYTHON } }), 400);
      expectError(await api().post("/v1/exec", { key: keys.live, raw: "{not json" }), 400);
      const res = await api().post("/v1/exec", {
        key: keys.live,
        json: { code: "print(1)", template_id: "no-such-template" },
      });
      expectError(res, 404, "not_found");
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "POST /v1/exec/batch: results in request order, each execution in its own VM",
    async () => {
      const n = 4;
      // Each item leaves a marker, waits so the items overlap, then lists the markers: a shared
      // VM (or filesystem) would show the others'. Item 2 also exits non-zero.
      const item = (i: number) =>
        [
          "import os, socket, time",
          "os.makedirs('/tmp/batch', exist_ok=True)",
          `open('/tmp/batch/${i}', 'w').write('x')`,
          "time.sleep(0.5)",
          `print(${i}, ','.join(sorted(os.listdir('/tmp/batch'))), socket.gethostname(), os.urandom(8).hex())`,
          i === 2 ? "raise SystemExit(5)" : "",
        ].join("\n");
      const res = await api().post("/v1/exec/batch", {
        key: keys.live,
        json: { executions: Array.from({ length: n }, (_, i) => ({ code: item(i), template_id: PYTHON })) },
      });
      const { results } = expectOk(res, 200, A.BatchExecResponse);
      expect(results).toHaveLength(n);
      const hostnames = new Set<string>();
      const randoms = new Set<string>();
      const ids = new Set<string>();
      results.forEach((item, i) => {
        if ("error" in item) throw new Error(`batch item ${i} failed: ${JSON.stringify(item)}`);
        const r = item;
        const [idx, markers, hostname, random] = r.stdout.trim().split(" ");
        expect({ idx, markers }).toEqual({ idx: String(i), markers: String(i) });
        expect(r.exit_code).toBe(i === 2 ? 5 : 0);
        expect(r.fork_time_ms).toBeGreaterThan(0);
        expect(random).toMatch(/^[0-9a-f]{16}$/);
        hostnames.add(hostname!);
        randoms.add(random!);
        ids.add(r.id);
      });
      // one VM each: its own hostname, and its own entropy although all restore one snapshot
      expect({ ids: ids.size, hostnames: hostnames.size, randoms: randoms.size }).toEqual({
        ids: n,
        hostnames: n,
        randoms: n,
      });
      await fx.expectNoVms();
      // more than the batch cap (64, docs/limits.md) is 400 before any VM starts
      const tooMany = Array.from({ length: 65 }, () => ({ code: "print(1)", template_id: PYTHON }));
      expectError(await api().post("/v1/exec/batch", { key: keys.live, json: { executions: tooMany } }), 400);
      expectError(await api().post("/v1/exec/batch", { key: keys.live, json: { executions: [] } }), 400);
    },
    TEST_TIMEOUT_MS,
  );
});

describe("Sessions API: sessions", () => {
  test(
    "create 201; exec with files + commands, code; shell state does not persist, files and processes do",
    async () => {
      expectError(await api().post("/v1/sessions", { key: keys.live, json: {} }), 400);
      const s = await createSession();
      expect(s.session_id).toMatch(/^sess_/);
      expect(s.template_id).toBe(PYTHON);
      expect(s.fork_time_ms).toBeGreaterThan(0);
      expect(s.create_time_ms).toBeGreaterThanOrEqual(s.fork_time_ms);
      const id = s.session_id;
      let execs = 0;

      // files are written before the commands; the response reflects the last command only
      let r = await sessionExec(id, {
        files: [{ path: "/root/in.txt", content: "alpha\n" }],
        commands: [["cat", "/root/in.txt"], sh("echo last; echo warn >&2; exit 4")],
      });
      execs++;
      expect({ stdout: r.stdout, stderr: r.stderr, exit_code: r.exit_code }).toEqual({
        stdout: "last\n",
        stderr: "warn\n",
        exit_code: 4,
      });
      expect(r.exec_time_ms).toBeGreaterThan(0);

      // state from previous steps is visible to each step
      r = await sessionExec(id, { commands: [sh("echo one > /root/step"), ["cat", "/root/step"]] });
      execs++;
      expect(r.stdout).toBe("one\n");

      // each command starts fresh from the working directory: no `cd` or `export` carries over...
      r = await sessionExec(id, { commands: [sh("cd /tmp && export X=1 && pwd")] });
      execs++;
      expect(r.stdout).toBe("/tmp\n");
      r = await sessionExec(id, { commands: [sh('pwd; echo "X=$X"')] });
      execs++;
      expect(r.stdout).toBe("/root\nX=\n");
      r = await sessionExec(id, { commands: [sh("cd /tmp"), ["pwd"]] });
      execs++;
      expect(r.stdout).toBe("/root\n");

      // ...but files do, across execs and into `code` (python on stdin)
      r = await sessionExec(id, {
        code: "print(open('/root/in.txt').read().strip(), open('/root/step').read().strip())",
      });
      execs++;
      expect(r.stdout).toBe("alpha one\n");
      // files alone overwrite
      r = await sessionExec(id, { files: [{ path: "/root/in.txt", content: "beta" }] });
      execs++;
      expect(r.exit_code).toBe(0);
      r = await sessionExec(id, { commands: [["cat", "/root/in.txt"]] });
      execs++;
      expect(r.stdout).toBe("beta");

      // a background process outlives its exec and keeps running in the session's VM
      r = await sessionExec(id, {
        commands: [
          sh(
            "nohup sh -c 'while :; do echo t >> /root/ticks; sleep 0.1; done' >/dev/null 2>&1 & echo started",
          ),
        ],
      });
      execs++;
      expect(r.stdout).toBe("started\n");
      r = await sessionExec(id, {
        commands: [sh("sleep 0.5; a=$(wc -l < /root/ticks); sleep 1; b=$(wc -l < /root/ticks); echo $a $b")],
      });
      execs++;
      expect(r.stdout).toMatch(/^\d+ \d+\n$/);
      const [a, b] = r.stdout.trim().split(" ").map(Number) as [number, number];
      expect(a).toBeGreaterThan(0);
      expect(b).toBeGreaterThan(a);

      // a session exec past its timeout_seconds is killed promptly; the session stays usable
      const t0 = performance.now();
      r = await sessionExec(id, { commands: [["sleep", "30"]], timeout_seconds: 1 });
      execs++;
      expect(r.exit_code).not.toBe(0);
      expect(performance.now() - t0).toBeLessThan(10_000);
      r = await sessionExec(id, { commands: [["cat", "/root/in.txt"]] });
      execs++;
      expect(r.stdout).toBe("beta");

      // code and commands together: ambiguous, 400 (docs/api.md "How the gateway serves it"); nothing at all: 400
      expectError(
        await api().post(`/v1/sessions/${id}/exec`, {
          key: keys.live,
          json: { code: "1", commands: [["true"]] },
        }),
        400,
      );
      expectError(await api().post(`/v1/sessions/${id}/exec`, { key: keys.live, json: {} }), 400);

      // status and list
      const st = expectOk(await api().get(`/v1/sessions/${id}`, { key: keys.live }), 200, A.SessionStatus);
      expect(st.session_id).toBe(id);
      expect(st.template_id).toBe(PYTHON);
      expect(st.exec_count).toBe(execs);
      expect(st.age_secs).toBeGreaterThan(0);
      expect(st.idle_secs).toBeGreaterThanOrEqual(0);
      expect(st.idle_secs).toBeLessThanOrEqual(st.age_secs);
      const list = expectOk(await api().get("/v1/sessions", { key: keys.live }), 200, A.SessionList);
      const entry = list.sessions.find((e) => e.session_id === id);
      expect(entry?.exec_count).toBe(execs);
      expect(entry?.idle_secs).toBeGreaterThanOrEqual(0);

      // another tenant sees nothing of it
      expectError(await api().get(`/v1/sessions/${id}`, { key: keys.other }), 404);
      expectError(
        await api().post(`/v1/sessions/${id}/exec`, { key: keys.other, json: { code: "print(1)" } }),
        404,
      );
      expectError(await api().post(`/v1/sessions/${id}/fork`, { key: keys.other }), 404);
      expectError(await api().delete(`/v1/sessions/${id}`, { key: keys.other }), 404);
      const otherList = expectOk(await api().get("/v1/sessions", { key: keys.other }), 200, A.SessionList);
      expect(otherList.sessions.map((e) => e.session_id)).not.toContain(id);

      await deleteSession(id);
      await fx.expectNoVms();
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "fork 201: the child has the parent's files, then diverges; delete 204, later calls 404/410",
    async () => {
      const parent = (await createSession()).session_id;
      await sessionExec(parent, { files: [{ path: "/root/p.txt", content: "from-parent" }] });
      const res = await api().post(`/v1/sessions/${parent}/fork`, { key: keys.live });
      const f = expectOk(res, 201, A.ForkSessionResponse);
      track(f.session_id, keys.live);
      const child = f.session_id;
      expect(child).toMatch(/^sess_/);
      expect(child).not.toBe(parent);
      expect(f.fork_time_ms).toBeGreaterThan(0);

      let r = await sessionExec(child, { commands: [["cat", "/root/p.txt"]] });
      expect(r.stdout).toBe("from-parent");
      r = await sessionExec(child, {
        files: [{ path: "/root/c.txt", content: "child" }],
        commands: [sh("echo changed > /root/p.txt")],
      });
      // copy-on-write: the parent sees neither the child's new file nor its edit
      r = await sessionExec(parent, { commands: [sh("cat /root/p.txt; test -e /root/c.txt; echo $?")] });
      expect(r.stdout).toBe("from-parent1\n");
      const st = expectOk(await api().get(`/v1/sessions/${child}`, { key: keys.live }), 200, A.SessionStatus);
      expect(st.template_id).toBe(PYTHON);

      await deleteSession(child);
      const gone = [
        await api().get(`/v1/sessions/${child}`, { key: keys.live }),
        await api().post(`/v1/sessions/${child}/exec`, { key: keys.live, json: { code: "print(1)" } }),
        await api().post(`/v1/sessions/${child}/fork`, { key: keys.live }),
        await api().delete(`/v1/sessions/${child}`, { key: keys.live }),
      ];
      for (const g of gone) {
        expect([404, 410]).toContain(g.status);
        expectError(g, g.status);
      }
      const list = expectOk(await api().get("/v1/sessions", { key: keys.live }), 200, A.SessionList);
      expect(list.sessions.map((e) => e.session_id)).toEqual([parent]);
      // the parent is unaffected by the child's deletion
      r = await sessionExec(parent, { code: "print('still here')" });
      expect(r.stdout).toBe("still here\n");
      await deleteSession(parent);
      await fx.expectNoVms();
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "DELETE lets an in-flight exec finish by default; ?force=true aborts it at once",
    async () => {
      // default: the exec in flight completes, then the session goes. Each exec streams, so that
      // the delete goes once it printed `started` (it runs then).
      const s1 = (await createSession()).session_id;
      const running = streamedSessionExec(s1, [sh("echo started; sleep 2; echo finished")]);
      await Promise.race([running.started, running.done]);
      await deleteSession(s1);
      const finished = await running.done;
      expect(finished.status).toBe(200);
      expect(finished.stdout).toBe("started\nfinished\n");
      expect(finished.last?.event).toBe("exit");
      expect(finished.last?.data.exit_code).toBe(0);
      expect([404, 410]).toContain((await api().get(`/v1/sessions/${s1}`, { key: keys.live })).status);

      const id = (await createSession()).session_id;
      const inflight = streamedSessionExec(id, [sh("echo started; sleep 60")]);
      await Promise.race([inflight.started, inflight.done]);
      const t0 = performance.now();
      await deleteSession(id, keys.live, true);
      expect(performance.now() - t0).toBeLessThan(15_000);
      const settled = await Promise.race([
        inflight.done.then((r) => r.stdout),
        Bun.sleep(20_000).then(() => "still running"),
      ]);
      // Aborted in its sleep: the stream ended long before the command's 60 s, after its first line.
      expect(settled).toBe("started\n");
      await fx.expectNoVms();
    },
    TEST_TIMEOUT_MS,
  );
});

describe("Sessions API: uploaded templates", () => {
  test(
    "register (scale key) 202 building, 409 while building and on a duplicate id, ready, list, spawn, delete 204",
    async () => {
      imgDir = await mkdtemp(join(tmpdir(), "sbx-e2e-img-"));
      const archive = await makeDockerArchive(join(imgDir, "busybox.tar"), await busyboxImageSpec(imgDir));
      await rm(join(imgDir, "busybox-rootfs"), { recursive: true, force: true });
      const bytes = new Uint8Array(await Bun.file(archive.path).arrayBuffer());
      const id = "e2e-busybox";
      const upload = (key: string, tid: string, raw: Uint8Array | string = bytes) =>
        api().post("/v1/templates", {
          key,
          query: { id: tid },
          raw,
          headers: { "content-type": "application/octet-stream" },
        });

      expectError(await upload(keys.live, id), 403, "forbidden"); // template admin needs scale
      expectError(await upload(keys.scale, "bad id!"), 400);
      expectError(await upload(keys.scale, "x".repeat(65)), 400);

      const reg = await upload(keys.scale, id);
      expect(expectOk(reg, 202, A.RegisterTemplateResponse)).toEqual({ id, status: "building" });
      liveTemplates.set(id, keys.scale);
      // spawning from a template that is still building: 409
      const early = await api().post("/v1/sessions", { key: keys.live, json: { template_id: id } });
      const earlyExec = await api().post("/v1/exec", {
        key: keys.live,
        json: { code: "echo hi", template_id: id },
      });
      const status0 = expectOk(await api().get(`/v1/templates/${id}`, { key: keys.live }), 200, A.TemplateA);
      if (status0.status === "building") {
        expectError(early, 409);
        expectError(earlyExec, 409);
      } else {
        // the build beat us to it (fast host): the spawns were legitimately accepted
        if (early.status === 201) track((early.body as { session_id: string }).session_id, keys.live);
        console.warn(`template ${id} was ${status0.status} before the 409 check could run`);
      }
      expectError(await upload(keys.scale, id), 409); // the registry never overwrites an id

      let t = status0;
      const deadline = performance.now() + 120_000;
      while (t.status === "building" && performance.now() < deadline) {
        await Bun.sleep(250);
        t = expectOk(await api().get(`/v1/templates/${id}`, { key: keys.scale }), 200, A.TemplateA);
      }
      expect(t.status).toBe("ready");
      expect(t.error).toBeUndefined();
      expect(Number.isInteger(t.created_at_secs)).toBe(true);
      expect(Math.abs(t.created_at_secs! - Date.now() / 1000)).toBeLessThan(600);

      // list: map form, the tenant's template next to the public one
      const list = expectOk(await api().get("/v1/templates", { key: keys.live }), 200, A.TemplateListA);
      expect(list.templates[id]).toEqual({ ready: true });
      expect(list.templates[PYTHON]).toEqual({ ready: true });
      // another tenant: not visible
      const otherList = expectOk(await api().get("/v1/templates", { key: keys.other }), 200, A.TemplateListA);
      expect(otherList.templates[id]).toBeUndefined();
      expectError(await api().get(`/v1/templates/${id}`, { key: keys.other }), 404);

      // the image runs unmodified: its Env and WorkingDir
      const s = (await createSession(keys.live, id)).session_id;
      const r = await sessionExec(s, { commands: [sh('echo "$FIXTURE_GREETING"; pwd')] });
      expect(r.stdout).toBe("hello-from-image\n/app\n");
      await deleteSession(s);
      for (const sid of [...liveSessions.keys()]) await deleteSession(sid, liveSessions.get(sid)); // early spawns

      expectError(await api().delete(`/v1/templates/${id}`, { key: keys.live }), 403);
      const del = await api().delete(`/v1/templates/${id}`, { key: keys.scale });
      expect(del.status).toBe(204);
      expect(del.text).toBe("");
      liveTemplates.delete(id);
      expectError(await api().get(`/v1/templates/${id}`, { key: keys.scale }), 404);
      const after = expectOk(await api().get("/v1/templates", { key: keys.live }), 200, A.TemplateListA);
      expect(after.templates[id]).toBeUndefined();
      await fx.expectNoVms();
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "a build that fails ends `failed` with an error string, not an HTTP error",
    async () => {
      const id = "e2e-broken";
      const reg = await api().post("/v1/templates", {
        key: keys.scale,
        query: { id },
        raw: "this is not a tar archive\n".repeat(100),
        headers: { "content-type": "application/octet-stream" },
      });
      expect(expectOk(reg, 202, A.RegisterTemplateResponse)).toEqual({ id, status: "building" });
      liveTemplates.set(id, keys.scale);
      let t: A.TemplateA = { id, status: "building" };
      const deadline = performance.now() + 120_000;
      while (t.status === "building" && performance.now() < deadline) {
        await Bun.sleep(250);
        t = expectOk(await api().get(`/v1/templates/${id}`, { key: keys.scale }), 200, A.TemplateA);
      }
      expect(t.status).toBe("failed");
      expect(typeof t.error).toBe("string");
      expect(t.error!.length).toBeGreaterThan(0);
      expect(t.created_at_secs).toBeUndefined();
      const list = expectOk(await api().get("/v1/templates", { key: keys.live }), 200, A.TemplateListA);
      expect(list.templates[id]).toEqual({ ready: false });
      const del = await api().delete(`/v1/templates/${id}`, { key: keys.scale });
      expect(del.status).toBe(204);
      liveTemplates.delete(id);
      // the health check still answers `ok`: a failed build is not a crash
      expect(expectOk(await api().get("/v1/health"), 200, HealthResponse).status).toBe("ok");
    },
    TEST_TIMEOUT_MS,
  );
});

describe("limits and latency", () => {
  test(
    "a burst of more than 100 requests inside a second gets 429 rate_limited with Retry-After",
    async () => {
      const n = 250;
      const t0 = performance.now();
      const results = await Promise.all(
        Array.from({ length: n }, () => api().get("/v1/sessions", { key: keys.burst })),
      );
      const elapsedS = (performance.now() - t0) / 1000;
      const ok = results.filter((r) => r.status === 200).length;
      const limited = results.filter((r) => r.status === 429);
      expect(ok + limited.length).toBe(n);
      expect(limited.length).toBeGreaterThan(0);
      // A sliding one-second window: no second holds more than 100 allowed requests, so a burst
      // shorter than a second gets at most 100 through (100 per started second if it ran longer).
      expect(ok).toBeLessThanOrEqual(100 * Math.max(1, Math.ceil(elapsedS)));
      for (const r of limited) {
        expectError(r, 429, "rate_limited");
        const retry = r.headers.get("retry-after");
        expect(retry).toMatch(/^\d+$/);
        expect(Number(retry)).toBeGreaterThanOrEqual(1);
      }
      // per key: another key of the same tenant is not limited
      expect((await api().get("/v1/sessions", { key: keys.live })).status).toBe(200);
      // after Retry-After the key works again, and the metric counted the refusals
      await Bun.sleep(Number(limited[0]!.headers.get("retry-after")) * 1000);
      const metrics = await api().get("/v1/metrics", { key: keys.burst });
      expect(metrics.status).toBe(200);
      const m = /^sandboxd_rate_limited_total (\d+)$/m.exec(metrics.text);
      expect(Number(m?.[1])).toBe(limited.length);
      console.log(
        JSON.stringify({ e2e_rate_limit: { sent: n, ok, limited: limited.length, elapsed_s: elapsedS } }),
      );
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "client-side latency of one-shot exec, session create and session fork (10 samples each)",
    async () => {
      const n = 10;
      const exec: number[] = [];
      const execFork: number[] = [];
      for (let i = 0; i < n; i++) {
        const res = await api().post("/v1/exec", {
          key: keys.live,
          json: { code: "print(1)", template_id: PYTHON },
        });
        expect(expectOk(res, 200, A.ExecResultA).stdout).toBe("1\n");
        exec.push(res.ms);
        execFork.push((res.body as A.ExecResultA).fork_time_ms);
      }
      const create: number[] = [];
      for (let i = 0; i < n; i++) {
        const s = await createSession();
        create.push(s.ms);
        // Each sample a session that runs commands.
        expect((await sessionExec(s.session_id, { code: "print(6*7)" })).stdout).toBe("42\n");
        await deleteSession(s.session_id);
      }
      const parent = (await createSession()).session_id;
      await sessionExec(parent, { files: [{ path: "/root/x", content: "x" }] });
      const fork: number[] = [];
      const forkServer: number[] = [];
      for (let i = 0; i < n; i++) {
        const res = await api().post(`/v1/sessions/${parent}/fork`, { key: keys.live });
        const f = expectOk(res, 201, A.ForkSessionResponse);
        track(f.session_id, keys.live);
        fork.push(res.ms);
        forkServer.push(f.fork_time_ms);
        // Each sample a real fork: the child has the parent's file.
        expect((await sessionExec(f.session_id, { commands: [["cat", "/root/x"]] })).stdout).toBe("x");
        await deleteSession(f.session_id);
      }
      await deleteSession(parent);
      for (const samples of [exec, execFork, create, fork, forkServer]) expect(samples).toHaveLength(n);
      console.log(
        JSON.stringify({
          e2e_latency_ms: {
            exec_oneshot: latencySummary(exec),
            exec_oneshot_server_fork_time: latencySummary(execFork),
            session_create: latencySummary(create),
            session_fork: latencySummary(fork),
            session_fork_server_fork_time: latencySummary(forkServer),
          },
        }),
      );
      await fx.expectNoVms();
    },
    TEST_TIMEOUT_MS,
  );
});

test(
  "teardown: after deleting through the API and SIGTERM, no QEMU process references the data dir",
  async () => {
    const s = service();
    const list = expectOk(await s.api.get("/v1/sessions", { key: keys.live }), 200, A.SessionList);
    expect(list.sessions).toEqual([]);
    for (const [id, key] of liveTemplates) {
      await s.api.delete(`/v1/templates/${id}`, { key }).catch(() => undefined);
      liveTemplates.delete(id);
    }
    const { exit, qemus } = await fx.stop();
    expect(exit).toBe(0);
    expect(qemus).toEqual([]);
    expect(await pidsMentioning(fx.dataDir)).toEqual([]);
  },
  TEST_TIMEOUT_MS,
);
