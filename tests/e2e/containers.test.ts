/**
 * The deployable images (deploy/images/, docs/deploy.md), built and run: deploy/images/build.sh
 * builds sandboxd-gateway and sandboxd-agent with podman (a rebuild with nothing changed is
 * skipped by its content hash); a real PostgreSQL; the gateway container on it (host network,
 * DATABASE_URL, non-root); the agent container (privileged, host network, QEMU under TCG here)
 * enrolled with a token the gateway container's CLI makes; a key; then a sandbox created through
 * them, an exec, a delete; both containers stopped by SIGTERM exit 0 (the graceful drain). From
 * the host: the gateway image holds no QEMU and runs as uid 10001. Every container and volume the
 * test made is removed, also when it fails.
 *
 * The agent's data volume is seeded from the shared test cache (guest artifacts and the
 * debootstrapped python image, tests/support/e2e-service.ts) so its catalog build goes straight
 * to the template's boot; the image's own guest artifacts (built at image build time) are the
 * same files by key.
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { randomBytes } from "node:crypto";
import { rm } from "node:fs/promises";
import * as B from "../../contracts/api/sandboxes-api.ts";
import { Api, expectOk, prepareDataDir } from "../support/e2e-service.ts";
import { buildImages, podman, podmanSync, ulimitArgs } from "../support/podman.ts";
import { freePort, startPostgres, type TestPostgres } from "../support/postgres.ts";

/** The images' build (cold: a few minutes), then the template's boot under TCG. */
const SETUP_TIMEOUT_MS = 20 * 60_000;
/** The python template's first build in the agent (boot and snapshot under TCG, a loaded host). */
const TEMPLATE_READY_MS = 10 * 60_000;
/** A sandbox's create, exec and delete, and both containers' stops. */
const TEST_TIMEOUT_MS = 5 * 60_000;
/** `podman stop --time`: above the drain (2 s delay + requests in flight, none here). */
const STOP_GRACE_S = 90;

const run = randomBytes(4).toString("hex");
const names = { gateway: `sbx-ctr-gw-${run}`, agent: `sbx-ctr-agent-${run}`, volume: `sbx-ctr-gw-${run}` };
let images: { gateway: string; agent: string };
let pg: TestPostgres | null = null;
let agentData = "";
let gatewayUrl = "";
let key = "";

async function ok(args: string[], what: string): Promise<string> {
  const r = await podman(args);
  if (r.code !== 0) throw new Error(`${what}: podman ${args.join(" ")} exited ${r.code}: ${r.stderr}`);
  return r.stdout;
}

async function logs(name: string): Promise<string> {
  const r = await podman(["logs", name]);
  return `${r.stdout}${r.stderr}`.slice(-4000);
}

/** Polls `fn` until it is true; throws with `what` (and the containers' logs) at the deadline. */
async function until(what: string, ms: number, fn: () => Promise<boolean>): Promise<void> {
  const end = Date.now() + ms;
  while (Date.now() < end) {
    if (await fn().catch(() => false)) return;
    await Bun.sleep(1000);
  }
  throw new Error(
    `${what} not within ${ms} ms\n--- gateway:\n${await logs(names.gateway)}\n--- agent:\n${await logs(names.agent)}`,
  );
}

beforeAll(async () => {
  images = await buildImages();
  pg = await startPostgres();
  if (!pg) throw new Error("no PostgreSQL binaries (bin/sandboxd test installs postgresql)");
  agentData = await prepareDataDir("sbx-ctr-");

  const gwPort = await freePort();
  gatewayUrl = `http://127.0.0.1:${gwPort}`;
  await ok(["volume", "create", names.volume], "gateway volume");
  await ok(
    [
      "run",
      "--detach",
      "--name",
      names.gateway,
      "--network",
      "host",
      ...ulimitArgs(),
      "--env",
      `DATABASE_URL=${pg.url}`,
      "--env",
      "SANDBOXD_DRAIN_DELAY=1",
      "--volume",
      `${names.volume}:/var/lib/sandboxd`,
      images.gateway,
      "gateway",
      "--host",
      "127.0.0.1",
      "--port",
      String(gwPort),
    ],
    "gateway start",
  );
  await until("the gateway's /readyz", 120_000, async () => (await fetch(`${gatewayUrl}/readyz`)).ok);

  // The enrollment token and the key, made by the CLI inside the gateway container (its
  // operator socket).
  const token = (
    await ok(["exec", names.gateway, "sandboxd", "agent-token", "create", "--ttl", "1h"], "token")
  )
    .trim()
    .split("\n")
    .at(-1)!;
  expect(token).toStartWith("sbxe_");
  key = (
    await ok(["exec", names.gateway, "sandboxd", "key", "create", "--tenant", "acme", "--tier", "pro"], "key")
  )
    .trim()
    .split("\n")
    .at(-1)!;

  const agentPort = await freePort();
  await ok(
    [
      "run",
      "--detach",
      "--name",
      names.agent,
      "--network",
      "host",
      "--privileged",
      ...ulimitArgs(),
      // The VMs' RAM files live in /dev/shm: podman's default is a 64 MiB tmpfs.
      "--shm-size",
      "4g",
      "--env",
      "SANDBOXD_DRAIN_DELAY=1",
      "--env",
      "SANDBOXD_PRELAUNCH=0",
      "--volume",
      `${agentData}:/var/lib/sandboxd`,
      images.agent,
      "agent",
      "--gateway",
      gatewayUrl,
      "--enroll",
      token,
      "--listen",
      `127.0.0.1:${agentPort}`,
      "--advertise",
      `http://127.0.0.1:${agentPort}`,
    ],
    "agent start",
  );
  await until("the python template on the agent", TEMPLATE_READY_MS, async () => {
    const text = await (await fetch(`${gatewayUrl}/v1/health`)).text();
    return text.includes('"python":{"ready":true}');
  });
}, SETUP_TIMEOUT_MS);

afterAll(async () => {
  for (const name of [names.agent, names.gateway]) podmanSync(["rm", "--force", "--time", "0", name]);
  podmanSync(["volume", "rm", "--force", names.volume]);
  pg?.stop();
  if (agentData) await rm(agentData, { recursive: true, force: true });
});

test("the gateway image has no QEMU and runs as a non-root user", async () => {
  const user = (
    await ok(["image", "inspect", "--format", "{{.Config.User}}", images.gateway], "inspect")
  ).trim();
  expect(user).toBe("10001:10001");
  const probe = await podman([
    "run",
    "--rm",
    ...ulimitArgs(),
    "--entrypoint",
    "/bin/sh",
    images.gateway,
    "-c",
    "id -u; command -v qemu-system-x86_64 qemu-img gcc debootstrap || echo none",
  ]);
  expect(probe.stdout.trim().split("\n")).toEqual(["10001", "none"]);
  // The agent image does hold them (the same probe can tell).
  const agent = await podman([
    "run",
    "--rm",
    ...ulimitArgs(),
    "--entrypoint",
    "/bin/sh",
    images.agent,
    "-c",
    "command -v qemu-system-x86_64",
  ]);
  expect(agent.stdout.trim()).toBe("/usr/bin/qemu-system-x86_64");
});

test(
  "a sandbox through the containers: create, exec, delete; SIGTERM stops both with exit 0",
  async () => {
    const api = new Api(gatewayUrl);
    const created = await api.post("/v1/sandboxes", { key, json: { template: "python" } });
    const id = expectOk(created, 201, B.CreateSandboxResponse).id;
    const exec = expectOk(
      await api.post(`/v1/sandboxes/${id}/exec`, { key, json: { command: "echo hi" } }),
      200,
      B.ExecResponseB,
    );
    expect({ stdout: exec.stdout, exit_code: exec.exit_code }).toEqual({ stdout: "hi\n", exit_code: 0 });
    expectOk(await api.delete(`/v1/sandboxes/${id}`, { key }), 200, B.DeleteSandboxResponse);

    for (const name of [names.agent, names.gateway]) {
      await ok(["stop", "--time", String(STOP_GRACE_S), name], `stop ${name}`);
      const state = (
        await ok(["inspect", "--format", "{{.State.ExitCode}} {{.State.OOMKilled}}", name], "inspect")
      ).trim();
      if (state !== "0 false") throw new Error(`${name} exited "${state}":\n${await logs(name)}`);
      expect(state).toBe("0 false");
    }
    // Each drained before it stopped (cli/serve.ts's last line), with nothing in flight.
    expect(await logs(names.gateway)).toContain("stopping: no request was in flight");
    expect(await logs(names.agent)).toContain("stopping: no call was in flight");
  },
  TEST_TIMEOUT_MS,
);
