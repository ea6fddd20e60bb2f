/**
 * The file API end to end over real HTTP with real VMs (`bin/sandboxd up --no-catalog`, a busybox
 * image uploaded as a template, keys made in-process through its operator socket):
 *
 * - A 100 MB random binary file PUT into a sandboxes API sandbox and GET back is byte-exact (sha256 on
 *   the client both ways and in the guest with `sha256sum`), while the service's peak RSS (gateway
 *   and agent are one process under `up`) grows by less than RSS_GROWTH_BOUND. The upload body
 *   stalls halfway until the guest holds most of what was sent (streamed end to end), and a GET of
 *   /dev/zero streams 400 MB under the same bound. Prints upload and download throughput.
 * - list, delete (file, empty directory; a non-empty one is 409), a missing file 404, a directory
 *   GET 400, a relative path 400, `..` resolved by the guest, a foreign tenant's id 404, `user`
 *   (a file the user may not write is 400, one written as the user is the user's); an upload
 *   declaring more than MAX_FILE_TRANSFER_BYTES is 413 with no body byte sent.
 * - sessions API sessions serve the same routes, beside a running exec (not `busy`), and after the
 *   VM's idle pause (woken); a sandbox the service suspended for idleness is resumed by a file call.
 *
 * Tests run in order and share one service; the last one stops it and checks no QEMU is left.
 */

import { afterAll, beforeAll, expect, test } from "bun:test";
import { createHash, randomBytes } from "node:crypto";
import { readFileSync } from "node:fs";
import { mkdtemp, rm } from "node:fs/promises";
import { connect } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { FileDeleted, FileList, FileWritten } from "../../contracts/api/files.ts";
import { MAX_FILE_TRANSFER_BYTES } from "../../contracts/api/limits.ts";
import * as B from "../../contracts/api/sandboxes-api.ts";
import * as A from "../../contracts/api/sessions-api.ts";
import { busyboxImageSpec, makeDockerArchive } from "../fixtures/images.ts";
import { expectError, expectOk, waitFor } from "../support/e2e-service.ts";
import { pausedSeconds, waitForIdlePause } from "../support/idle-pause.ts";
import { assertResponse } from "../support/openapi-check.ts";
import { useService } from "../support/service.ts";
import { streamedExec as startStreamedExec } from "../support/streamed-exec.ts";

/** 100 MB each way through the guest channel on a loaded (possibly TCG) host, plus sha256sum. */
const BIG_TIMEOUT_MS = 600_000;
const TEST_TIMEOUT_MS = 240_000;
/** The template upload and build once `up` runs. */
const SETUP_TIMEOUT_MS = 240_000;
/** A template build (import + boot + freeze) on a loaded host. */
const BUILD_WAIT_MS = 180_000;
const TEMPLATE = "e2e-files-api";
const BIG_BYTES = 100 * 1000 * 1000;
/**
 * How much the service's peak RSS (VmHWM; gateway and agent are one process under `up`) may grow
 * during one test's transfers. It is not a copy of the file: the pieces in flight are a guest
 * frame (1 MiB) at the agent plus socket and fetch buffers, and what grows beyond them is the
 * copies of passed-on pieces the GC has not returned yet. Measured on a loaded 2-core host:
 * 101-106 MiB for the 100 MB round trip (134-215 MiB before the guest frames stopped being
 * copied twice, docs/files.md "The file API: choices"), 123-330 MiB for 400 MB of /dev/zero and 339 MiB for
 * 1.5 GB of it (it levels off instead of following the volume; it varies with when the GC runs).
 * That the file itself is never held whole is shown apart from
 * this bound: the upload is seen in the guest while its body is stalled halfway, and a download of
 * /dev/zero (a file without end) streams.
 */
const RSS_GROWTH_BOUND = 512 * 1024 * 1024;
/** How much of /dev/zero the endless download reads before it cancels: more than the RSS bound. */
const ZERO_BYTES = 400 * 1000 * 1000;
/** The reaper's interval for the idle-suspend case (SANDBOXD_REAPER_INTERVAL). */
const REAPER_INTERVAL_S = 1;

/** The keys' tenant: the idle pause is read from its usage (tests/support/idle-pause.ts). */
const TENANT = "acme";

let imgDir = "";
let sandboxId = "";
let sessionId = "";

afterAll(async () => {
  if (imgDir) await rm(imgDir, { recursive: true, force: true });
});

const fx = useService({
  prefix: "sbx-e2e-filesapi-",
  python: false,
  keys: {
    live: [TENANT, "live"],
    scale: [TENANT, "scale"],
    pro: [TENANT, "pro"],
    other: ["evil", "pro"],
  },
  env: { SANDBOXD_REAPER_INTERVAL: String(REAPER_INTERVAL_S) },
});

// Before the fixture stops `up`: what the tests made goes while `up` still runs.
fx.beforeStop(async () => {
  if (!keys || !fx.running) return; // the last test deleted everything and stopped `up`
  if (sandboxId) await fx.api.delete(`/v1/sandboxes/${sandboxId}`, { key: keys.pro }).catch(() => {});
  if (sessionId)
    await fx.api
      .delete(`/v1/sessions/${sessionId}`, { key: keys.live, query: { force: "true" } })
      .catch(() => {});
  await fx.api.delete(`/v1/templates/${TEMPLATE}`, { key: keys.scale });
});

let keys: Record<"live" | "scale" | "pro" | "other", string>;
const service = () => fx.svc;

const api = () => service().api;
const sha256 = (b: Uint8Array | string) => createHash("sha256").update(b).digest("hex");
const filesOf = (id: string) => `/v1/sandboxes/${id}/files`;

beforeAll(async () => {
  keys = fx.keys;
  const svc = fx.svc;
  imgDir = await mkdtemp(join(tmpdir(), "sbx-e2e-filesapi-img-"));
  const archive = await makeDockerArchive(join(imgDir, "busybox.tar"), await busyboxImageSpec(imgDir));
  const image = new Uint8Array(await Bun.file(archive.path).arrayBuffer());
  const up = await svc.api.post("/v1/templates", {
    key: keys.scale,
    query: { id: TEMPLATE },
    raw: image,
    headers: { "content-type": "application/octet-stream" },
  });
  expect(up.status).toBeLessThan(300);
  const ready = await waitFor(async () => {
    const t = await svc.api.get<A.TemplateA>(`/v1/templates/${TEMPLATE}`, { key: keys.scale });
    return t.body?.status === "ready";
  }, BUILD_WAIT_MS);
  if (!ready) throw new Error(`template not ready\n${svc.logTail()}`);
  sandboxId = expectOk(
    await svc.api.post("/v1/sandboxes", { key: keys.pro, json: { template: TEMPLATE } }),
    201,
    B.CreateSandboxResponse,
  ).id;
}, SETUP_TIMEOUT_MS);

function rssBytes(pid: number): { rss: number; hwm: number } {
  const text = readFileSync(`/proc/${pid}/status`, "utf8");
  const kib = (name: string) =>
    Number(new RegExp(`^${name}:\\s+(\\d+) kB`, "m").exec(text)?.[1] ?? Number.NaN) * 1024;
  return { rss: kib("VmRSS"), hwm: kib("VmHWM") };
}

/**
 * A body handing out `data` in 1 MiB pieces as the client sends them; before the piece at
 * `holdAt` it waits for `hold` to resolve (the test looks into the guest meanwhile).
 */
function bodyOf(data: Uint8Array, holdAt: number, hold: () => Promise<void>): ReadableStream<Uint8Array> {
  let off = 0;
  let held = false;
  return new ReadableStream<Uint8Array>({
    async pull(ctl) {
      if (off >= data.length) {
        ctl.close();
        return;
      }
      if (!held && off >= holdAt) {
        held = true;
        await hold();
      }
      const end = Math.min(data.length, off + 1024 * 1024);
      ctl.enqueue(data.subarray(off, end));
      off = end;
    },
  });
}

test(
  "sandboxes API: 100 MB of random bytes round-trip byte-exact through PUT and GET with bounded RSS",
  async () => {
    const data = new Uint8Array(randomBytes(BIG_BYTES));
    const want = sha256(data);
    const pid = service().pid;
    const path = "/root/upload/nested/big.bin"; // parents do not exist yet
    const url = new URL(filesOf(sandboxId), service().url);
    url.searchParams.set("path", path);
    await Bun.write(`/proc/${pid}/clear_refs`, "5"); // VmHWM back to the current RSS
    const before = rssBytes(pid);

    let guestHeldMidway = 0;
    /**
     * Upload throughput is taken over the second half, from the end of the stall to the answer:
     * the first half overlaps the stall (its bytes still flow while the test polls the guest).
     */
    let stallEnd = 0;
    const put = await fetch(url, {
      method: "PUT",
      headers: { authorization: `Bearer ${keys.pro}`, "content-type": "application/octet-stream" },
      // Halfway the body stops until the guest holds most of what was sent: the upload reaches
      // the guest as it arrives, nothing waits for the whole body.
      body: bodyOf(data, BIG_BYTES / 2, async () => {
        const seen = await waitFor(async () => {
          const r = await api().post(`/v1/sandboxes/${sandboxId}/exec`, {
            key: keys.pro,
            json: { command: "cat /root/upload/nested/.big.bin.sbx-tmp-* | wc -c" },
          });
          guestHeldMidway = Number((r.body as { stdout?: string }).stdout ?? 0);
          return guestHeldMidway >= BIG_BYTES / 4;
        }, 120_000);
        stallEnd = performance.now();
        expect(seen).toBe(true);
      }),
      signal: AbortSignal.timeout(BIG_TIMEOUT_MS),
    });
    const putText = await put.text();
    const upSecs = (performance.now() - stallEnd) / 1000;
    assertResponse({
      method: "PUT",
      path: url.pathname,
      status: put.status,
      contentType: put.headers.get("content-type"),
      text: putText,
    });
    expect(put.status).toBe(200);
    expect(FileWritten.parse(JSON.parse(putText))).toEqual({ path, size: BIG_BYTES });
    const afterUp = rssBytes(pid);

    const t1 = performance.now();
    const get = await fetch(url, {
      headers: { authorization: `Bearer ${keys.pro}` },
      signal: AbortSignal.timeout(BIG_TIMEOUT_MS),
    });
    expect(get.status).toBe(200);
    expect(get.headers.get("content-type")).toBe("application/octet-stream");
    const h = createHash("sha256");
    let got = 0;
    for await (const chunk of get.body!) {
      h.update(chunk);
      got += chunk.length;
    }
    const downSecs = (performance.now() - t1) / 1000;
    const after = rssBytes(pid);
    expect(got).toBe(BIG_BYTES);
    expect(h.digest("hex")).toBe(want);

    const inGuest = expectOk(
      await api().post(`/v1/sandboxes/${sandboxId}/exec`, {
        key: keys.pro,
        json: { command: `sha256sum ${path}; stat -c %s ${path}` },
        timeoutMs: 180_000,
      }),
      200,
      B.ExecResponseB,
    );
    expect(inGuest.stdout).toBe(`${want}  ${path}\n${BIG_BYTES}\n`);

    const grew = after.hwm - before.rss;
    const mb = BIG_BYTES / 1e6;
    console.log(
      JSON.stringify({
        file_mb: mb,
        upload_mb_s: Math.round((mb / 2 / upSecs) * 10) / 10,
        download_mb_s: Math.round((mb / downSecs) * 10) / 10,
        guest_held_at_the_midway_stall_mb: Math.round(guestHeldMidway / 1e5) / 10,
        rss_before_mib: Math.round(before.rss / 1048576),
        rss_peak_after_upload_mib: Math.round(afterUp.hwm / 1048576),
        rss_peak_mib: Math.round(after.hwm / 1048576),
        rss_peak_growth_mib: Math.round(grew / 1048576),
        bound_mib: RSS_GROWTH_BOUND / 1048576,
      }),
    );
    expect(grew).toBeLessThan(RSS_GROWTH_BOUND);
  },
  BIG_TIMEOUT_MS,
);

test(
  "sandboxes API: a file without end streams: GET of /dev/zero read to 400 MB and cancelled, RSS bounded",
  async () => {
    const pid = service().pid;
    await Bun.write(`/proc/${pid}/clear_refs`, "5");
    const before = rssBytes(pid);
    const url = new URL(filesOf(sandboxId), service().url);
    url.searchParams.set("path", "/dev/zero");
    const res = await fetch(url, { headers: { authorization: `Bearer ${keys.pro}` } });
    expect(res.status).toBe(200);
    const reader = res.body!.getReader();
    let got = 0;
    let nonZero = 0;
    const t0 = performance.now();
    while (got < ZERO_BYTES) {
      const { done, value } = await reader.read();
      if (done) break;
      got += value.length;
      if (value.some((b: number) => b !== 0)) nonZero++;
    }
    const secs = (performance.now() - t0) / 1000;
    await reader.cancel();
    const grew = rssBytes(pid).hwm - before.rss;
    console.log(
      JSON.stringify({
        dev_zero_mb: Math.round(got / 1e6),
        download_mb_s: Math.round((got / 1e6 / secs) * 10) / 10,
        rss_peak_growth_mib: Math.round(grew / 1048576),
        bound_mib: RSS_GROWTH_BOUND / 1048576,
      }),
    );
    expect(got).toBeGreaterThanOrEqual(ZERO_BYTES);
    expect(nonZero).toBe(0);
    expect(grew).toBeLessThan(RSS_GROWTH_BOUND);
  },
  BIG_TIMEOUT_MS,
);

test(
  "sandboxes API: list, delete, missing 404, directory 400, relative path 400, `..` in the guest, foreign 404, user",
  async () => {
    const key = keys.pro;
    const f = filesOf(sandboxId);
    const put = (path: string, raw: string, query: Record<string, string> = {}) =>
      api().put(f, {
        key,
        query: { path, ...query },
        raw,
        headers: { "content-type": "application/octet-stream" },
      });

    expectOk(await put("/tmp/d/a.txt", "alpha"), 200, FileWritten);
    expectOk(await put("/tmp/d/sub/b.txt", "bravo!"), 200, FileWritten);
    // `..` is the guest's to resolve: /tmp/d/sub/../c.txt is /tmp/d/c.txt.
    expect(expectOk(await put("/tmp/d/sub/../c.txt", "charlie"), 200, FileWritten).size).toBe(7);
    const c = await api().get(f, { key, query: { path: "/tmp/d/c.txt" } });
    expect(c.status).toBe(200);
    expect(c.text).toBe("charlie");

    const list = expectOk(
      await api().get(f, { key, query: { path: "/tmp/d", list: "true" } }),
      200,
      FileList,
    );
    const byName = Object.fromEntries(list.entries.map((e) => [e.name, e]));
    expect(Object.keys(byName).sort()).toEqual(["a.txt", "c.txt", "sub"]);
    expect(byName["a.txt"]).toMatchObject({ type: "file", size: 5, mode: 0o644 });
    expect(byName.sub?.type).toBe("dir");
    expect(Math.abs(byName["a.txt"]!.mtime - Date.now() / 1000)).toBeLessThan(600);
    expect(list.truncated).toBeUndefined();

    expectError(await api().get(f, { key, query: { path: "/tmp/d/nope" } }), 404, "not_found");
    expectError(await api().get(f, { key, query: { path: "/tmp/d" } }), 400, "invalid_file");
    expectError(await api().get(f, { key, query: { path: "tmp/d/a.txt" } }), 400, "bad_request");
    expectError(await put("relative.txt", "x"), 400, "bad_request");
    expectError(await api().get(f, { key, query: { path: "/tmp/d/nope", list: "true" } }), 404, "not_found");

    // Another tenant's key sees no such sandbox, whatever the route.
    const other = keys.other;
    expectError(await api().get(f, { key: other, query: { path: "/tmp/d/a.txt" } }), 404, "not_found");
    expectError(await api().put(f, { key: other, query: { path: "/tmp/x" }, raw: "x" }), 404, "not_found");
    expectError(await api().delete(f, { key: other, query: { path: "/tmp/d/a.txt" } }), 404, "not_found");

    // Deletes: a non-empty directory is refused, a file goes, then the emptied directory.
    expectError(await api().delete(f, { key, query: { path: "/tmp/d/sub" } }), 409, "conflict");
    expect(
      expectOk(await api().delete(f, { key, query: { path: "/tmp/d/sub/b.txt" } }), 200, FileDeleted),
    ).toEqual({ deleted: true, path: "/tmp/d/sub/b.txt" });
    expectOk(await api().delete(f, { key, query: { path: "/tmp/d/sub" } }), 200, FileDeleted);
    expectError(await api().delete(f, { key, query: { path: "/tmp/d/sub" } }), 404, "not_found");

    // `user`: the file ops run as that user in the guest. A root-only directory refuses it; a
    // file it writes is its own.
    expectOk(
      await api().post(`/v1/sandboxes/${sandboxId}/exec`, {
        key,
        json: {
          command: "mkdir -p /tmp/rootonly && chmod 700 /tmp/rootonly && echo secret > /tmp/rootonly/s",
        },
      }),
      200,
      B.ExecResponseB,
    );
    const refused = await put("/tmp/rootonly/x", "x", { user: "nobody" });
    expectError(refused, 400, "invalid_file");
    expect((refused.body as { message: string }).message).toContain("Permission denied");
    expectError(
      await api().get(f, { key, query: { path: "/tmp/rootonly/s", user: "nobody" } }),
      400,
      "invalid_file",
    );
    expect((await api().get(f, { key, query: { path: "/tmp/rootonly/s" } })).text).toBe("secret\n");
    expectOk(await put("/tmp/mine.txt", "x", { user: "nobody" }), 200, FileWritten);
    const owner = expectOk(
      await api().post(`/v1/sandboxes/${sandboxId}/exec`, {
        key,
        json: { command: "stat -c %U /tmp/mine.txt" },
      }),
      200,
      B.ExecResponseB,
    );
    expect(owner.stdout).toBe("nobody\n");
    expectError(await put("/tmp/x", "x", { user: "no-such-user" }), 400, "bad_request");
  },
  TEST_TIMEOUT_MS,
);

test(
  "an upload declaring more than MAX_FILE_TRANSFER_BYTES is 413 before its body is read",
  async () => {
    const url = new URL(service().url);
    const declared = MAX_FILE_TRANSFER_BYTES + 1;
    // A raw socket: the header declares the size, no body byte is ever sent.
    const text = await new Promise<string>((resolve, reject) => {
      const sock = connect({ host: url.hostname, port: Number(url.port) });
      let got = "";
      const timer = setTimeout(() => {
        sock.destroy();
        reject(new Error(`no answer within 30 s; got ${JSON.stringify(got)}`));
      }, 30_000);
      sock.on("data", (b) => {
        got += b.toString("latin1");
        if (/\r\n\r\n[\s\S]*\}/.test(got)) {
          clearTimeout(timer);
          sock.destroy();
          resolve(got);
        }
      });
      sock.on("error", reject);
      sock.on("connect", () =>
        sock.write(
          [
            `PUT ${filesOf(sandboxId)}?path=/tmp/huge HTTP/1.1`,
            `Host: ${url.host}`,
            `Authorization: Bearer ${keys.pro}`,
            "Content-Type: application/octet-stream",
            `Content-Length: ${declared}`,
            "",
            "",
          ].join("\r\n"),
        ),
      );
    });
    expect(text).toMatch(/^HTTP\/1\.1 413 /);
    expect(text).toContain('"code":"payload_too_large"');
  },
  TEST_TIMEOUT_MS,
);

/** A streamed session exec of `sh -c script` (tests/support/streamed-exec.ts). */
function streamedSessionExec(id: string, key: string, script: string) {
  return startStreamedExec(service().url, `/v1/sessions/${id}/exec`, key, {
    commands: [["sh", "-c", script]],
  });
}

test(
  "Sessions API: the same routes on a session, beside a running exec and after the idle pause",
  async () => {
    sessionId = expectOk(
      await api().post("/v1/sessions", { key: keys.live, json: { template_id: TEMPLATE } }),
      201,
      A.CreateSessionResponse,
    ).session_id;
    const f = `/v1/sessions/${sessionId}/files`;
    const key = keys.live;
    // An exec that runs for 4 s: file calls meanwhile are served, not `busy`. It streams, so that
    // the file calls go once it printed `started` (it runs then).
    const exec = streamedSessionExec(sessionId, key, "echo started; sleep 4; cat /work/in.txt");
    await Promise.race([exec.started, exec.done]);
    const bytes = randomBytes(3 * 1024 * 1024 + 17); // several guest frames each way
    const t0 = performance.now();
    expect(
      expectOk(
        await api().put(f, { key, query: { path: "/work/in.bin" }, raw: new Uint8Array(bytes) }),
        200,
        FileWritten,
      ).size,
    ).toBe(bytes.length);
    expectOk(
      await api().put(f, { key, query: { path: "/work/in.txt" }, raw: "from the file API" }),
      200,
      FileWritten,
    );
    const back = await fetch(new URL(`${f}?path=/work/in.bin`, service().url), {
      headers: { authorization: `Bearer ${key}` },
    });
    expect(sha256(new Uint8Array(await back.arrayBuffer()))).toBe(sha256(bytes));
    const doneAt = performance.now();
    const r = await exec.done;
    expect(r.status).toBe(200);
    expect(r.exit).toBeDefined();
    expect(A.ExecResultA.parse(r.exit).exit_code).toBe(0);
    // The cat after the sleep saw the file written meanwhile.
    expect(r.stdout).toBe("started\nfrom the file API");
    console.log(JSON.stringify({ file_calls_beside_exec_ms: Math.round(doneAt - t0) }));
    // Served while the 4 s exec still ran: all done before its end came (an ordering, not a time).
    expect(doneAt).toBeLessThan(r.exitAt);

    // Idle past the agent's idle pause (2 s), seen in the session's metering (the API shows a
    // paused VM as running): the VM's vCPUs are stopped; a file call wakes it.
    const mark = await pausedSeconds(fx.dataDir, TENANT, sessionId);
    expect(await waitForIdlePause(fx.dataDir, TENANT, sessionId, mark, 30_000)).toBe(true);
    const listed = expectOk(
      await api().get(f, { key, query: { path: "/work", list: "true" } }),
      200,
      FileList,
    );
    expect(listed.entries.map((e) => e.name).sort()).toEqual(["in.bin", "in.txt"]);
    expectError(await api().get(f, { key: keys.pro, query: { path: "/work/in.txt" } }), 403, "forbidden");
    expectOk(await api().delete(f, { key, query: { path: "/work/in.bin" } }), 200, FileDeleted);
  },
  TEST_TIMEOUT_MS,
);

test(
  "sandboxes API: a sandbox the service suspended for idleness is resumed by a file call",
  async () => {
    const id = expectOk(
      await api().post("/v1/sandboxes", {
        key: keys.pro,
        json: { template: TEMPLATE, idle_timeout_seconds: 3, idle_action: "suspend" },
      }),
      201,
      B.CreateSandboxResponse,
    ).id;
    try {
      expectOk(
        await api().put(filesOf(id), { key: keys.pro, query: { path: "/tmp/kept.txt" }, raw: "kept" }),
        200,
        FileWritten,
      );
      const suspended = await waitFor(async () => {
        const info = await api().get<{ state?: string }>(`/v1/sandboxes/${id}`, { key: keys.pro });
        return info.body?.state === "suspended";
      }, 60_000);
      expect(suspended).toBe(true);
      const got = await api().get(filesOf(id), {
        key: keys.pro,
        query: { path: "/tmp/kept.txt" },
        timeoutMs: 180_000,
      });
      expect(got.status).toBe(200);
      expect(got.text).toBe("kept");
      const info = expectOk(await api().get(`/v1/sandboxes/${id}`, { key: keys.pro }), 200, B.SandboxInfo);
      expect(info.state).toBe("running");
    } finally {
      await api()
        .delete(`/v1/sandboxes/${id}`, { key: keys.pro })
        .catch(() => {});
    }
  },
  TEST_TIMEOUT_MS,
);

test(
  "stopping the service leaves no QEMU",
  async () => {
    const s = service();
    await s.api.delete(`/v1/sandboxes/${sandboxId}`, { key: keys.pro });
    sandboxId = "";
    // Sessions outlive a restart of `up` (their VMs are kept): this one is ended first.
    await s.api.delete(`/v1/sessions/${sessionId}`, { key: keys.live, query: { force: "true" } });
    sessionId = "";
    const { exit, qemus } = await fx.stop();
    expect(exit).toBe(0);
    expect(qemus).toEqual([]);
  },
  TEST_TIMEOUT_MS,
);
