/**
 * Black-box, through a fresh `bin/sandboxd up` (docs/fleet.md "Nothing accepted is lost for want
 * of an agent"): as soon as `GET /v1/health` answers 200, a bake sent at once reaches `Live`, and
 * its sandbox runs a command. Health is 503 `starting` until the service's own agent is live, so
 * an operator or a script waiting for 200 never sends work the service would have to drop. The
 * image is a busybox in a real registry on loopback (SANDBOXD_REGISTRY_ALLOW_INTERNAL lets the pull
 * reach it). Figures (time to healthy, the bake's phases) are printed as JSON.
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import * as B from "../../contracts/api/sandboxes-api.ts";
import { expectOk } from "../support/e2e-service.ts";
import { type LocalRegistry, startBusyboxRegistry } from "../support/registry.ts";
import { useService } from "../support/service.ts";

/** The registry, its push, and the service's start. */
const SETUP_TIMEOUT_MS = 240_000;
/** Health turns 200 within seconds of `listening` (the agent's first heartbeat). */
const HEALTHY_TIMEOUT_MS = 60_000;
/** A bake: pull, import (mkfs), one boot, the snapshot: ~10-30 s under TCG. */
const BAKE_TIMEOUT_MS = 180_000;

let reg: LocalRegistry | undefined;
let work = "";

const fx = useService({
  python: false,
  keys: { pro: ["acme", "pro"] },
  env: { SANDBOXD_REGISTRY_ALLOW_INTERNAL: "127.0.0.1/32" },
});

beforeAll(async () => {
  work = await mkdtemp(join(tmpdir(), "sbx-bake-after-up-"));
  ({ reg } = await startBusyboxRegistry(work, "up/bb:1"));
}, SETUP_TIMEOUT_MS);

afterAll(async () => {
  await reg?.stop();
  if (work) await rm(work, { recursive: true, force: true });
});

test(
  "a bake sent the moment health says 200 reaches Live, and its sandbox runs",
  async () => {
    const t0 = performance.now();
    let health = 0;
    while (performance.now() - t0 < HEALTHY_TIMEOUT_MS) {
      health = (await fx.api.get("/v1/health")).status;
      if (health === 200) break;
      expect(health).toBe(503); // starting: never another answer on the way to healthy
      await Bun.sleep(20);
    }
    expect(health).toBe(200);
    const healthyMs = performance.now() - t0;

    const key = fx.keys.pro;
    const baked = expectOk(
      await fx.api.post("/v1/templates", { key, json: { name: "at-once", image: `${reg?.host}/up/bb:1` } }),
      202,
      B.TemplateB,
    );
    const phases: string[] = [];
    const deadline = performance.now() + BAKE_TIMEOUT_MS;
    let t = baked;
    while (performance.now() < deadline) {
      t = expectOk(await fx.api.get(`/v1/templates/${baked.id}`, { key }), 200, B.TemplateB);
      if (phases.at(-1) !== t.phase) phases.push(t.phase);
      if (t.phase === "Live" || t.phase === "Failed") break;
      await Bun.sleep(100);
    }
    console.log(JSON.stringify({ bake_after_up: { healthy_ms: Math.round(healthyMs), phases } }));
    expect(t.phase, fx.svc.logTail()).toBe("Live");

    const created = expectOk(
      await fx.api.post("/v1/sandboxes", { key, json: { template: baked.id } }),
      201,
      B.CreateSandboxResponse,
    );
    const ran = expectOk(
      await fx.api.post(`/v1/sandboxes/${created.id}/exec`, { key, json: { command: "echo at-once" } }),
      200,
      B.ExecResponseB,
    );
    expect(ran.stdout.trim()).toBe("at-once");
    expectOk(await fx.api.delete(`/v1/sandboxes/${created.id}`, { key }), 200, B.DeleteSandboxResponse);
    expectOk(await fx.api.delete(`/v1/templates/${baked.id}`, { key }), 200, B.DeleteTemplateResponseB);
  },
  BAKE_TIMEOUT_MS + HEALTHY_TIMEOUT_MS,
);
