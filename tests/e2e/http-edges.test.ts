/**
 * End to end over real HTTP with real VMs (`bin/sandboxd up --no-catalog`, a busybox image
 * uploaded as a sessions API template that exposes port 8080): the build stamp in `GET /v1/health`
 * and the served `openapi.yaml`; a batch whose failed items are envelopes beside the results of
 * the others; a connect to an exposed port where nothing listens (502 `port_unreachable`) and
 * connect URLs that follow the serving scheme and host, or `SANDBOXD_PUBLIC_URL` after a restart;
 * and a sessions API template deleted while VMs still run on it (docs/templates.md "Rules of templates": they finish, nothing new
 * spawns, the id is free again, the agent reclaims the template once its last VM has ended).
 *
 * Tests run in order and share one service; the last restarts it and the teardown checks that no
 * QEMU is left for its data dir.
 */

import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdtemp, readdir, readFile, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { engineTemplateId } from "../../agent/sandbox/drivers/snapshot.ts";
import { buildCommit } from "../../cli/build-stamp.ts";
import { HealthResponse } from "../../contracts/api/health.ts";
import * as B from "../../contracts/api/sandboxes-api.ts";
import * as A from "../../contracts/api/sessions-api.ts";
import { OPENAPI_PATH } from "../../gateway/openapi.ts";
import { busyboxImageSpec, makeDockerArchive } from "../fixtures/images.ts";
import {
  createKeys,
  expectError,
  expectOk,
  prepareDataDir,
  qemusUnder,
  REPO,
  type RunningService,
  removeDataDir,
  startUp,
  uploadTemplate,
  waitFor,
} from "../support/e2e-service.ts";
import { streamedExec as startStreamedExec } from "../support/streamed-exec.ts";
import { wsExchange } from "../support/ws-exchange.ts";

/** A test boots a few VMs (~0.2-1 s each under TCG) and at most one template build. */
const TEST_TIMEOUT_MS = 240_000;
/** Three keys (~5 s each), `up`, one template build (import, boot, snapshot: ~10-60 s under TCG). */
const SETUP_TIMEOUT_MS = 420_000;
/** A template build: the image import, one boot and the snapshot; generous for a loaded host. */
const BUILD_TIMEOUT_MS = 180_000;
const TEMPLATE = "edges";
const PORT = 8080;

let svc: RunningService | undefined;
let dataDir = "";
let imgDir = "";
let image = new Uint8Array();
let keys: Record<"live" | "scale" | "pro", string>;
/** Sandboxes of the sandboxes API still alive (deleted by the teardown if a test failed midway). */
const liveSandboxes = new Set<string>();
/** The sessions API sessions still alive. */
const liveSessions = new Set<string>();

function service(): RunningService {
  if (!svc) throw new Error("the service did not start (see beforeAll)");
  return svc;
}
const api = () => service().api;

async function register(id: string) {
  const registered = await uploadTemplate(service(), keys.scale, id, image, BUILD_TIMEOUT_MS);
  expect(registered).toEqual({ id, status: "building" });
}

beforeAll(async () => {
  dataDir = await prepareDataDir("sbx-e2e-edges-");
  keys = await createKeys(dataDir, {
    live: ["acme", "live"],
    scale: ["acme", "scale"],
    pro: ["acme", "pro"],
  });
  svc = await startUp(dataDir, ["--no-catalog"]);
  imgDir = await mkdtemp(join(tmpdir(), "sbx-edges-img-"));
  const spec = await busyboxImageSpec(imgDir, { config: { ExposedPorts: { [`${PORT}/tcp`]: {} } } });
  const archive = await makeDockerArchive(join(imgDir, "busybox.tar"), spec);
  image = new Uint8Array(await readFile(archive.path));
  await register(TEMPLATE);
}, SETUP_TIMEOUT_MS);

afterAll(async () => {
  const s = svc;
  svc = undefined;
  if (s) {
    for (const id of liveSessions)
      await s.api.delete(`/v1/sessions/${id}`, { key: keys.live, query: { force: "true" } }).catch(() => {});
    for (const id of liveSandboxes)
      await s.api.delete(`/v1/sandboxes/${id}`, { key: keys.pro }).catch(() => {});
    for (const id of [TEMPLATE])
      await s.api.delete(`/v1/templates/${id}`, { key: keys.scale }).catch(() => {});
    await s.stop();
  }
  if (dataDir) {
    const clean = await waitFor(async () => (await qemusUnder(dataDir)).length === 0, 10_000);
    const left = await qemusUnder(dataDir);
    for (const p of left) process.kill(p.pid, "SIGKILL"); // ours: started by our `up`
    await removeDataDir(dataDir);
    expect({ clean, left: left.map((p) => p.pid) }).toEqual({ clean: true, left: [] });
  }
  if (imgDir) await rm(imgDir, { recursive: true, force: true });
});

/** A streamed session exec of `sh -c script` with the live key (tests/support/streamed-exec.ts). */
function streamedSessionExec(id: string, script: string) {
  return startStreamedExec(service().url, `/v1/sessions/${id}/exec`, keys.live, {
    commands: [["sh", "-c", script]],
  });
}

/** A sandboxes API sandbox (Pro key) of the uploaded template, deleted by the teardown if a test fails. */
async function createSandbox() {
  const sb = expectOk(
    await api().post("/v1/sandboxes", { key: keys.pro, json: { template: TEMPLATE } }),
    201,
    B.CreateSandboxResponse,
  );
  liveSandboxes.add(sb.id);
  return sb;
}

async function mintUrl(id: string): Promise<string> {
  const r = expectOk(
    await api().post(`/v1/sandboxes/${id}/connect-url`, {
      key: keys.pro,
      json: { port: PORT, ttl_seconds: 300 },
    }),
    200,
    B.ConnectUrlResponse,
  );
  return r.url;
}

describe("build stamp and API description", () => {
  test("GET /v1/health's version is the package version + the commit; GET /v1/openapi.yaml is the file", async () => {
    const pkg = JSON.parse(await readFile(join(REPO, "package.json"), "utf8")) as { version: string };
    const h = expectOk(await api().get("/v1/health"), 200, HealthResponse);
    const commit = buildCommit(REPO);
    expect(commit).toMatch(/^[0-9a-f]{7,40}$/); // this suite runs in a checkout
    expect(h.version).toBe(`${pkg.version}+${commit}`);
    const doc = await api().get("/v1/openapi.yaml"); // no key: public documentation
    expect(doc.status).toBe(200);
    expect(doc.text).toBe(await readFile(OPENAPI_PATH, "utf8"));
  });
});

describe("POST /v1/exec/batch: one result per item", () => {
  test(
    "an item that fails is its own error envelope; the items that ran keep their results",
    async () => {
      const res = await api().post("/v1/exec/batch", {
        key: keys.live,
        json: {
          executions: [
            { code: "echo first; exit 3", template_id: TEMPLATE },
            { code: "echo never", template_id: "no-such-template" },
            { code: 'echo "$FIXTURE_GREETING"', template_id: TEMPLATE },
          ],
        },
      });
      const { results } = expectOk(res, 200, A.BatchExecResponse);
      expect(results).toHaveLength(3);
      expect(results[0]).toMatchObject({ stdout: "first\n", exit_code: 3 });
      expect(results[1]).toEqual({
        status: 404,
        error: { code: "not_found", message: expect.stringContaining("no-such-template") },
      });
      expect(results[2]).toMatchObject({ stdout: "hello-from-image\n", exit_code: 0 });
    },
    TEST_TIMEOUT_MS,
  );
});

describe("connect", () => {
  test(
    "nothing listening on an exposed port is 502 port_unreachable; the URL is ws:// on the host we reached",
    async () => {
      const sb = await createSandbox();
      expect(Object.keys(sb.endpoints ?? {})).toEqual([String(PORT)]);
      const url = await mintUrl(sb.id);
      // `up` serves plain HTTP and was given no --public-url.
      expect(url).toStartWith(`${service().url.replace(/^http:/, "ws:")}/v1/sandboxes/${sb.id}/connect?`);
      const refused = await wsExchange(url, "");
      expect(refused.status).toBe(502);
      expect(JSON.parse(refused.text)).toMatchObject({ code: "port_unreachable" });
      // The same URL once a server listens in the guest: the 502 was about the port, not the path.
      const start = await api().post(`/v1/sandboxes/${sb.id}/exec`, {
        key: keys.pro,
        json: {
          command: `mkdir -p /srv && echo served > /srv/index.html && setsid busybox httpd -p 127.0.0.1:${PORT} -h /srv`,
        },
      });
      expect(expectOk(start, 200, B.ExecResponseB).exit_code).toBe(0);
      const ok = await wsExchange(url, "GET /index.html HTTP/1.0\r\n\r\n");
      expect(ok.status).toBe(101);
      expect(ok.text).toMatch(/^HTTP\/1\.[01] 200 OK/);
      expect(ok.text).toEndWith("served\n");
    },
    TEST_TIMEOUT_MS,
  );
});

/** The agent's record of a template, by the end of the agent's name for it (`<tenant>.<tag>.<id>`). */
async function agentTemplateRefs(id: string): Promise<string[]> {
  const dir = join(dataDir, "agent", "records", "templates");
  return (await readdir(dir).catch(() => [] as string[]))
    .filter((f) => f.endsWith(`.${id}.json`))
    .map((f) => f.slice(0, -".json".length));
}

describe("the sessions API template delete (docs/templates.md#rules-of-templates)", () => {
  test(
    "in-flight VMs finish, nothing new spawns, the id is free again; the agent reclaims it after the last VM",
    async () => {
      const [oldRef] = await agentTemplateRefs(TEMPLATE);
      expect(oldRef).toBeDefined();
      const meta = join(dataDir, "agent", "templates", engineTemplateId(oldRef!), "meta.json");
      expect(await Bun.file(meta).exists()).toBe(true);

      const session = expectOk(
        await api().post("/v1/sessions", { key: keys.live, json: { template_id: TEMPLATE } }),
        201,
        A.CreateSessionResponse,
      ).session_id;
      liveSessions.add(session);
      // An exec in flight while the template is deleted: it streams, so that the delete goes once
      // it printed `started` (it runs then).
      const inFlight = streamedSessionExec(session, "echo started; sleep 3; echo finished");
      await Promise.race([inFlight.started, inFlight.done]);
      const del = await api().delete(`/v1/templates/${TEMPLATE}`, { key: keys.scale });
      expect(del.status).toBe(204);
      // Removed for the API at once: no status, no new session or exec on it.
      expectError(await api().get(`/v1/templates/${TEMPLATE}`, { key: keys.scale }), 404, "not_found");
      expectError(
        await api().post("/v1/sessions", { key: keys.live, json: { template_id: TEMPLATE } }),
        404,
        "not_found",
      );
      expectError(
        await api().post("/v1/exec", { key: keys.live, json: { code: "echo x", template_id: TEMPLATE } }),
        404,
        "not_found",
      );
      // The exec that was running finishes; the session (and the sandboxes API sandbox) go on working.
      const finished = await inFlight.done;
      expect(finished.status).toBe(200);
      expect(A.ExecResultA.parse(finished.exit).exit_code).toBe(0);
      expect(finished.stdout).toBe("started\nfinished\n");
      const after = await api().post(`/v1/sessions/${session}/exec`, {
        key: keys.live,
        json: { commands: [["echo", "still here"]] },
      });
      expect(expectOk(after, 200, A.ExecResultA).stdout).toBe("still here\n");
      // The agent keeps the template's files while VMs run on it.
      expect(await Bun.file(meta).exists()).toBe(true);

      // The id is free again: a new registration builds beside the one being deleted.
      await register(TEMPLATE);
      const refs = await agentTemplateRefs(TEMPLATE);
      expect(refs).toHaveLength(2);
      const s2 = expectOk(
        await api().post("/v1/sessions", { key: keys.live, json: { template_id: TEMPLATE } }),
        201,
        A.CreateSessionResponse,
      ).session_id;
      liveSessions.add(s2);
      expect(
        expectOk(
          await api().post(`/v1/sessions/${s2}/exec`, {
            key: keys.live,
            json: { commands: [["echo", "new"]] },
          }),
          200,
          A.ExecResultA,
        ).stdout,
      ).toBe("new\n");

      // The last VMs on the old template end: the agent removes it (record and files).
      for (const id of [session, s2]) {
        expect((await api().delete(`/v1/sessions/${id}`, { key: keys.live })).status).toBe(204);
        liveSessions.delete(id);
      }
      for (const id of liveSandboxes) {
        expect((await api().delete(`/v1/sandboxes/${id}`, { key: keys.pro })).status).toBe(200);
        liveSandboxes.delete(id);
      }
      const gone = await waitFor(async () => !(await agentTemplateRefs(TEMPLATE)).includes(oldRef!), 30_000);
      expect(gone).toBe(true);
      expect(await Bun.file(meta).exists()).toBe(false);
      // The new registration is untouched.
      expect(await agentTemplateRefs(TEMPLATE)).toHaveLength(1);
    },
    TEST_TIMEOUT_MS + BUILD_TIMEOUT_MS,
  );
});

describe("SANDBOXD_PUBLIC_URL", () => {
  test(
    "after a restart with SANDBOXD_PUBLIC_URL, connect URLs are minted on it (wss for https)",
    async () => {
      const sb = await createSandbox();
      expect(await service().stop()).toBe(0);
      svc = await startUp(dataDir, ["--no-catalog"], {
        SANDBOXD_PUBLIC_URL: "https://sandboxes.example.test",
      });
      const url = await mintUrl(sb.id); // the sandbox was re-adopted by the new `up`
      expect(url).toStartWith(`wss://sandboxes.example.test/v1/sandboxes/${sb.id}/connect?port=${PORT}&`);
      expect((await api().delete(`/v1/sandboxes/${sb.id}`, { key: keys.pro })).status).toBe(200);
      liveSandboxes.delete(sb.id);
    },
    TEST_TIMEOUT_MS,
  );
});
