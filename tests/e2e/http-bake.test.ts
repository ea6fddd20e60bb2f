/**
 * End to end over real HTTP, sandboxes API bake (docs/templates.md "Rules of templates"; docs/sandboxes.md "Rules of the sandboxes API"): a real OCI registry
 * (Debian's docker-registry on a free loopback port, tests/support/registry.ts) holding a busybox
 * image pushed by skopeo, the real service (`bin/sandboxd up`, its own data dir, keys from the
 * CLI), real pulls and real VMs under TCG. A bake with a ready command that starts busybox httpd
 * detached and waits for /health; every sandbox and fork restores with the server already up.
 * Failures (unknown tag, a ready command that fails), idempotence, tier and ownership rules, the
 * warm pool of expect/release. A second, private registry (basic auth): tenant A bakes with its
 * own `registry_auth`; tenant B, knowing the digest but not the credentials, is refused and gets
 * no template. The registries are on loopback, which the pull's egress fence refuses unless the
 * operator allows it: `up` runs with SANDBOXD_REGISTRY_ALLOW_INTERNAL=127.0.0.1/32. Figures (pull,
 * phases, spawn) are printed as JSON.
 */

import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import * as B from "../../contracts/api/sandboxes-api.ts";
import { expectError, expectOk, qemusUnder, waitFor } from "../support/e2e-service.ts";
import { type LocalRegistry, startBusyboxRegistry, startRegistry } from "../support/registry.ts";
import { useService } from "../support/service.ts";
import { wsExchange } from "../support/ws-exchange.ts";

/** A test boots a few VMs (~0.2 s restores, ~3 s template boots under TCG); generous for a slow host. */
const TEST_TIMEOUT_MS = 240_000;
/** The registries and their pushes, once `up` runs. */
const SETUP_TIMEOUT_MS = 240_000;
/** A bake: pull, import (mkfs), one boot, the ready command, the snapshot: ~10-30 s under TCG. */
const BAKE_TIMEOUT_MS = 180_000;
const PYTHON = "python";
const PORT = 8080;

/**
 * The docs/templates.md "Rules of templates" contract: start the service detached (busybox httpd forks into the background),
 * then block until GET /health answers, exit 0; give up (exit 1) after ~20 s.
 */
const READY_CMD =
  "mkdir -p /www && echo healthy > /www/health && httpd -p 0.0.0.0:8080 -h /www && " +
  "i=0; until wget -qO- http://127.0.0.1:8080/health; do i=$((i+1)); [ $i -gt 200 ] && exit 1; sleep 0.1; done";
const HEALTH = "wget -qO- http://127.0.0.1:8080/health";

let reg: LocalRegistry | undefined;
/** The private registry: only `PRIVATE_USER` reads it. */
let privateReg: LocalRegistry | undefined;
const PRIVATE_USER = { username: "acme-robot", password: "acme-only-token-1b2c" };
let work = "";
const liveSandboxes = new Map<string, string>();
const liveTemplates = new Map<string, string>();
const figures: Record<string, unknown> = {};

afterAll(async () => {
  await reg?.stop();
  await privateReg?.stop();
  if (work) await rm(work, { recursive: true, force: true });
  console.log(JSON.stringify({ bake_figures: figures }));
});

const fx = useService({
  keys: {
    demo: ["acme", "demo"],
    pro: ["acme", "pro"],
    other: ["globex", "pro"],
  },
  // The test registries are on loopback: the operator (not a tenant) lets pulls reach it.
  env: { SANDBOXD_REGISTRY_ALLOW_INTERNAL: "127.0.0.1/32" },
});

// Before the fixture stops `up`: what the tests left goes while `up` still runs.
fx.beforeStop(async () => {
  if (keys) await deleteLeftovers();
});

let keys: Record<"demo" | "pro" | "other", string>;
const service = () => fx.svc;
const api = () => service().api;
const registry = (): LocalRegistry => {
  if (!reg) throw new Error("the registry did not start (see beforeAll)");
  return reg;
};

beforeAll(async () => {
  work = await mkdtemp(join(tmpdir(), "sbx-bake-"));
  const busybox = await startBusyboxRegistry(work, "web/bb:1");
  reg = busybox.reg;
  const archive = busybox.archive;
  privateReg = await startRegistry({ auth: PRIVATE_USER });
  await privateReg.push(`oci-archive:${archive}`, "acme/secret:1");
  keys = fx.keys;
}, SETUP_TIMEOUT_MS);

async function deleteLeftovers(): Promise<void> {
  for (const [id, key] of liveSandboxes) {
    await fx.api.delete(`/v1/sandboxes/${id}`, { key }).catch(() => undefined);
    liveSandboxes.delete(id);
  }
  for (const [id, key] of liveTemplates) {
    await fx.api.delete(`/v1/templates/${id}`, { key }).catch(() => undefined);
    liveTemplates.delete(id);
  }
}

/** Deletes the sandbox after the current test (pass or fail) unless the test deleted it. */
function track(id: string, key: string): void {
  liveSandboxes.set(id, key);
  fx.cleanup(async () => {
    if (liveSandboxes.delete(id)) await fx.api.delete(`/v1/sandboxes/${id}`, { key });
  });
}

function imageRef(tag = "1"): string {
  return `${registry().host}/web/bb:${tag}`;
}

async function bake(body: Record<string, unknown>, key = keys.pro) {
  const res = await api().post("/v1/templates", { key, json: body });
  const t = expectOk(res, 202, B.TemplateB);
  liveTemplates.set(t.id, key);
  return t;
}

/** Polls GET /v1/templates/{id} until Live or Failed; returns the last body and the phases seen. */
async function settle(id: string, key = keys.pro) {
  const phases: string[] = [];
  const deadline = performance.now() + BAKE_TIMEOUT_MS;
  while (performance.now() < deadline) {
    const t = expectOk(await api().get(`/v1/templates/${id}`, { key }), 200, B.TemplateB);
    if (phases.at(-1) !== t.phase) phases.push(t.phase);
    if (t.phase === "Live" || t.phase === "Failed") return { t, phases };
    await Bun.sleep(100);
  }
  throw new Error(
    `template ${id} did not settle in ${BAKE_TIMEOUT_MS} ms (phases ${phases})\n${service().logTail()}`,
  );
}

async function createSandbox(template: string, key = keys.pro) {
  const res = await api().post("/v1/sandboxes", { key, json: { template } });
  const created = expectOk(res, 201, B.CreateSandboxResponse);
  track(created.id, key);
  return { ...created, ms: res.ms };
}

async function exec(id: string, command: string, key = keys.pro) {
  const res = await api().post(`/v1/sandboxes/${id}/exec`, { key, json: { command } });
  return { ...expectOk(res, 200, B.ExecResponseB), ms: res.ms };
}

async function deleteSandbox(id: string, key = keys.pro) {
  expectOk(await api().delete(`/v1/sandboxes/${id}`, { key }), 200, B.DeleteSandboxResponse);
  liveSandboxes.delete(id);
}

async function deleteTemplate(id: string, key = keys.pro) {
  const body = expectOk(await api().delete(`/v1/templates/${id}`, { key }), 200, B.DeleteTemplateResponseB);
  expect(body).toEqual({ deleted: true, id });
  liveTemplates.delete(id);
}

async function hostnameOf(id: string): Promise<string> {
  const r = await exec(id, "hostname");
  expect(r.exit_code).toBe(0);
  return r.stdout.trim();
}

function blobGets(): number {
  return (
    registry()
      .log()
      .match(/"GET \/v2\/web\/bb\/blobs\//g) ?? []
  ).length;
}

describe("the sandboxes API bake from a registry", () => {
  test("demo keys cannot bake (403 demo_tier_limit); a malformed reference is 400", async () => {
    const body = { name: "nope", image: imageRef() };
    expectError(await api().post("/v1/templates", { key: keys.demo, json: body }), 403, "demo_tier_limit");
    for (const image of ["--src-creds=a:b", "docker://x/y", "x y", "UPPER/case"]) {
      expectError(
        await api().post("/v1/templates", { key: keys.pro, json: { name: "bad-ref", image } }),
        400,
        "bad_request",
      );
    }
    expectError(await api().get("/v1/templates/nope", { key: keys.pro }), 404, "not_found");
  });

  test(
    "bake with a ready command: Pending/Converting -> Live, idempotent, telemetry; sandboxes and forks find the server running",
    async () => {
      const req = {
        name: "web",
        image: imageRef(),
        ready: { cmd: READY_CMD, ports: [PORT], http_timeout_s: 60 },
      };
      const blobsBefore = blobGets();
      const first = await bake(req);
      expect(first).toMatchObject({
        id: "web",
        visibility: "private",
        image: imageRef(),
        exposed_ports: [PORT],
      });
      expect(["Pending", "Converting", "Distributing"]).toContain(first.phase);
      // The same request again is the same template (docs/sandboxes.md "Rules of the sandboxes API": idempotent, safe to retry).
      const again = await bake(req);
      expect(again.id).toBe("web");
      // The same name with another definition is a conflict, not a second template.
      expectError(
        await api().post("/v1/templates", { key: keys.pro, json: { ...req, image: imageRef("2") } }),
        409,
        "conflict",
      );
      const { t, phases } = await settle("web");
      expect(t.phase).toBe("Live");
      expect(t.error).toBeUndefined();
      expect(phases.at(-1)).toBe("Live");
      expect(phases.every((p) => ["Pending", "Converting", "Distributing", "Live"].includes(p))).toBe(true);
      expect(t.exposed_ports).toEqual([PORT]);
      const tm = t.telemetry;
      for (const v of [
        tm.pull_ms,
        tm.import_ms,
        tm.boot_ms,
        tm.ready_cmd_ms,
        tm.snapshot_ms,
        tm.converting_ms,
      ])
        expect(v).toBeGreaterThan(0);
      expect(tm.distributing_ms).toBeGreaterThanOrEqual(0);
      expect(tm.total_ms!).toBeGreaterThanOrEqual(tm.converting_ms!);
      expect(tm.snapshot_bytes?.memory).toBeGreaterThan(0);
      expect(blobGets()).toBeGreaterThan(blobsBefore); // it really came from the registry
      // The list shows it once; the other tenant does not see it.
      const list = expectOk(await api().get("/v1/images", { key: keys.pro }), 200, B.CatalogList);
      expect(list.templates.filter((x) => x.id === "web")).toHaveLength(1);
      expectError(await api().get("/v1/templates/web", { key: keys.other }), 404, "not_found");
      // The POST answer is the template as GET shows it.
      const retry = await bake(req);
      expect(retry).toEqual(t);
      figures.bake = { phases_seen: phases, ...roundAll(tm) };

      // A sandbox restores with httpd already serving: the first exec answers at once.
      const sb = await createSandbox("web");
      expect(Object.keys(sb.endpoints)).toEqual([String(PORT)]);
      expect(sb.endpoints[String(PORT)]).toBe(`${sb.id}:${PORT}`); // a hint in the client's terms, not an address
      const health = await exec(sb.id, HEALTH);
      expect({ code: health.exit_code, out: health.stdout }).toEqual({ code: 0, out: "healthy\n" });
      const info = expectOk(await api().get(`/v1/sandboxes/${sb.id}`, { key: keys.pro }), 200, B.SandboxInfo);
      expect(Object.keys(info.endpoints)).toEqual([String(PORT)]);
      // A fork's children too (the server's memory is in the fork point).
      const forked = expectOk(
        await api().post(`/v1/sandboxes/${sb.id}/fork`, { key: keys.pro, json: { count: 2 } }),
        200,
        B.ForkResponse,
      );
      for (const c of forked.children) track(c.id, keys.pro);
      expect(forked.children).toHaveLength(2);
      for (const c of forked.children) {
        expect(Object.keys(c.endpoints)).toEqual([String(PORT)]);
        const r = await exec(c.id, HEALTH);
        expect({ code: r.exit_code, out: r.stdout }).toEqual({ code: 0, out: "healthy\n" });
      }
      // Connect from outside (docs/sandboxes.md "Rules of the sandboxes API"): a connect URL's WebSocket carries raw HTTP to httpd in
      // the sandbox, through the gateway, the agent and the guest agent (no guest network).
      const mint = async (id: string, ttl = 300) => {
        const r = expectOk(
          await api().post(`/v1/sandboxes/${id}/connect-url`, {
            key: keys.pro,
            json: { port: PORT, ttl_seconds: ttl, protocol: "tcp" },
          }),
          200,
          B.ConnectUrlResponse,
        );
        // `up` serves plain HTTP and has no --public-url here: ws:// on the host we reached it by.
        expect(r.url).toStartWith(`${service().url.replace(/^http:/, "ws:")}/v1/sandboxes/${id}/connect?`);
        return r.url;
      };
      const url = await mint(sb.id);
      const t0 = performance.now();
      const reply = await wsExchange(url, "GET /health HTTP/1.0\r\nHost: sandbox\r\n\r\n");
      expect(reply.text).toStartWith("HTTP/1.1 200 OK");
      expect(reply.text).toEndWith("healthy\n");
      figures.connect = { http_over_ws_ms: Math.round(performance.now() - t0) };
      // A token for another sandbox, an expired one: refused before any upgrade.
      const childUrl = await mint(forked.children[0]!.id);
      const foreign = childUrl.replace(forked.children[0]!.id, sb.id);
      expect((await wsExchange(foreign, "")).status).toBe(401);
      const shortLived = await mint(sb.id, 1);
      await Bun.sleep(2_100);
      expect((await wsExchange(shortLived, "")).status).toBe(401);
      // A deleted sandbox revokes its tokens.
      await deleteSandbox(forked.children[1]!.id);
      const revoked = await mint(forked.children[0]!.id);
      await deleteSandbox(forked.children[0]!.id);
      expect((await wsExchange(revoked, "")).status).toBe(401);
      forked.children.splice(0, 2);

      // A template with live sandboxes cannot go (docs/sandboxes.md "Rules of the sandboxes API"), the shared catalog never.
      expectError(await api().delete("/v1/templates/web", { key: keys.pro }), 409, "template_in_use");
      expectError(await api().delete(`/v1/templates/${PYTHON}`, { key: keys.pro }), 403, "forbidden");
      figures.spawn = {
        create_ms: Math.round(sb.ms),
        fork_time_ms: Math.round(sb.fork_time_ms),
        first_exec_ms: Math.round(health.ms),
      };
      for (const c of forked.children) await deleteSandbox(c.id);
      await deleteSandbox(sb.id);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "expect keeps warm VMs of the template, a create takes one, the pool refills; release leaves none",
    async () => {
      const expectPath = "/v1/templates/web/expect";
      expectError(
        await api().post(expectPath, { key: keys.demo, json: { width: 2 } }),
        403,
        "demo_tier_limit",
      );
      expectError(await api().post(expectPath, { key: keys.other, json: { width: 2 } }), 404, "not_found");
      expectError(
        await api().post(`/v1/templates/${PYTHON}/expect`, { key: keys.pro, json: { width: 2 } }),
        403,
        "forbidden",
      );
      expectError(await api().post(expectPath, { key: keys.pro, json: { width: 0 } }), 400, "bad_request");
      // A cold create (snapshot restore) for comparison.
      const cold = await createSandbox("web");
      await deleteSandbox(cold.id);
      expect(await waitFor(async () => (await fx.vmDirs()).length === 0, 10_000)).toBe(true);

      for (let i = 0; i < 2; i++) {
        const r = expectOk(
          await api().post(expectPath, { key: keys.pro, json: { width: 2 } }),
          200,
          B.ExpectResponse,
        );
        expect(r).toEqual({ id: "web", width: 2 }); // idempotent
      }
      expect(await waitFor(async () => (await fx.vmDirs()).length === 2, 60_000)).toBe(true);
      const pooled = new Set(await fx.vmDirs());
      const sb = await createSandbox("web");
      // The sandbox is one of the pooled VMs (a VM's hostname is its agent id), server running.
      expect(pooled.has(await hostnameOf(sb.id))).toBe(true);
      const health = await exec(sb.id, HEALTH);
      expect({ code: health.exit_code, out: health.stdout }).toEqual({ code: 0, out: "healthy\n" });
      expect(sb.fork_time_ms).toBeLessThan(cold.fork_time_ms);
      // The pool refills in the background: two warm VMs again beside the sandbox.
      expect(await waitFor(async () => (await fx.vmDirs()).length === 3, 60_000)).toBe(true);
      figures.warm_pool = {
        cold: { create_ms: Math.round(cold.ms), fork_time_ms: Math.round(cold.fork_time_ms) },
        warm: { create_ms: Math.round(sb.ms), fork_time_ms: Math.round(sb.fork_time_ms) },
      };
      for (let i = 0; i < 2; i++) {
        const r = expectOk(
          await api().post("/v1/templates/web/release", { key: keys.pro }),
          200,
          B.ReleaseResponse,
        );
        expect(r).toEqual({ id: "web", released: true }); // idempotent
      }
      // Capacity relaxes at once: only the sandbox's VM is left.
      expect(await waitFor(async () => (await fx.vmDirs()).length === 1, 10_000)).toBe(true);
      expect((await qemusUnder(fx.dataDir)).length).toBe(1);
      await deleteSandbox(sb.id);
      expect(await waitFor(async () => (await fx.vmDirs()).length === 0, 10_000)).toBe(true);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "a second bake of the same image fetches nothing from the registry; expected_width pre-warms it",
    async () => {
      const blobsBefore = blobGets();
      await bake({ name: "web-copy", image: imageRef(), expected_width: 1 });
      const { t } = await settle("web-copy");
      expect(t.phase).toBe("Live");
      expect(t.exposed_ports).toEqual([]); // no ready.ports and the image exposes none
      await Bun.sleep(200);
      expect(blobGets()).toBe(blobsBefore);
      figures.cached_bake = roundAll(t.telemetry);
      // expected_width: one warm VM once Live, taken by the first create.
      expect(await waitFor(async () => (await fx.vmDirs()).length === 1, 60_000)).toBe(true);
      const [warm] = await fx.vmDirs();
      const sb = await createSandbox("web-copy");
      expect(sb.endpoints).toEqual({});
      expect(await hostnameOf(sb.id)).toBe(warm!);
      await deleteSandbox(sb.id);
      // Deleting the template drops its pool (refilled meanwhile) with it.
      await deleteTemplate("web-copy");
      expect(await waitFor(async () => (await fx.vmDirs()).length === 0, 10_000)).toBe(true);
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "failures are a Failed phase with a readable reason: unknown tag, ready command exiting non-zero",
    async () => {
      await bake({ name: "no-tag", image: imageRef("nope") });
      const missing = await settle("no-tag");
      expect(missing.t.phase).toBe("Failed");
      expect(missing.t.error).toMatch(/manifest unknown/);
      expect(missing.t.error).toContain(imageRef("nope"));
      // A failed template cannot be spawned from (409), and can be deleted.
      const res = await api().post("/v1/sandboxes", { key: keys.pro, json: { template: "no-tag" } });
      expect(res.status).toBe(409);
      await deleteTemplate("no-tag");

      await bake({ name: "bad-ready", image: imageRef(), ready: { cmd: "echo starting; exit 3" } });
      const ready = await settle("bad-ready");
      expect(ready.t.phase).toBe("Failed");
      expect(ready.t.error).toMatch(/ready command .* exited with code 3/);
      await deleteTemplate("bad-ready");

      // A ready command that never finishes is bounded by ready.http_timeout_s.
      await bake({ name: "slow-ready", image: imageRef(), ready: { cmd: "sleep 600", http_timeout_s: 2 } });
      const slow = await settle("slow-ready");
      expect(slow.t.phase).toBe("Failed");
      expect(slow.t.error).toMatch(/timed out after 2000 ms/);
      await deleteTemplate("slow-ready");
      expect((await api().get("/v1/health")).status).toBe(200); // the service is fine
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "caches never cross tenants: B bakes the digest of A's private image and is refused; A's re-bake is cached",
    async () => {
      const priv = privateReg!;
      const privateBlobs = () => (priv.log().match(/"GET \/v2\/acme\/secret\/blobs\//g) ?? []).length;
      await bake({ name: "secret", image: `${priv.host}/acme/secret:1`, registry_auth: PRIVATE_USER });
      const a = await settle("secret");
      expect(a.t.phase).toBe("Live");
      const digest = /"GET \/v2\/acme\/secret\/manifests\/(sha256:[0-9a-f]{64})/.exec(priv.log())?.[1];
      expect(digest).toBeDefined();
      const pinned = `${priv.host}/acme/secret@${digest}`;
      const blobs = privateBlobs();

      // Tenant B (another Pro tenant) knows the digest, not the credentials: anonymous, then guessing.
      for (const [name, extra] of [
        ["stolen", {}],
        ["stolen-guess", { registry_auth: { username: PRIVATE_USER.username, password: "guess" } }],
      ] as const) {
        await bake({ name, image: pinned, ...extra }, keys.other);
        const b = await settle(name, keys.other);
        expect(b.t.phase).toBe("Failed");
        expect(b.t.error).toMatch(
          /^registry_denied: looking up \S+ failed: the registry refused the credentials or access to the image \(error id err-[0-9a-f]{12}\)$/,
        );
        for (const leak of [fx.dataDir, "/var/", "/tmp/", "level=", "msg=", "skopeo"])
          expect(b.t.error).not.toContain(leak);
        // No template: a sandbox from it is refused.
        const res = await api().post("/v1/sandboxes", { key: keys.other, json: { template: name } });
        expect(res.status).toBe(409);
        await deleteTemplate(name, keys.other);
      }
      await Bun.sleep(200);
      expect(privateBlobs()).toBe(blobs); // nothing was fetched for B, and B was served nothing

      // A's re-bake by digest: authorized again by the registry, served from the cache.
      await bake({ name: "secret-again", image: pinned, registry_auth: PRIVATE_USER });
      const again = await settle("secret-again");
      expect(again.t.phase).toBe("Live");
      await Bun.sleep(200);
      expect(privateBlobs()).toBe(blobs);
      figures.private_rebake = roundAll(again.t.telemetry);
      await deleteTemplate("secret-again");
      await deleteTemplate("secret");
    },
    TEST_TIMEOUT_MS,
  );

  test(
    "deleting the baked template frees its id; no VM is left",
    async () => {
      await deleteTemplate("web");
      expectError(await api().get("/v1/templates/web", { key: keys.pro }), 404, "not_found");
      expect(await waitFor(async () => (await fx.vmDirs()).length === 0, 10_000)).toBe(true);
      expect(await qemusUnder(fx.dataDir)).toEqual([]);
    },
    TEST_TIMEOUT_MS,
  );
});

function roundAll(o: Record<string, unknown>): Record<string, unknown> {
  return Object.fromEntries(
    Object.entries(o).map(([k, v]) => [k, typeof v === "number" ? Math.round(v) : v]),
  );
}
