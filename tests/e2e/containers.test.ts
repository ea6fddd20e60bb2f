/**
 * The README's deployment walk-through ("Deploying: an edge, a region's gateways, three agents"),
 * run block by block as written (tests/support/readme-blocks.ts `deployStep`), every host on
 * loopback: deploy/images/build.sh builds sandboxd-gateway and sandboxd-agent with podman (a
 * rebuild with nothing changed is skipped by its content hash); the fleet's secrets go to an env
 * file; the migration runs from the gateway image; two gateway containers share a real
 * PostgreSQL; one token of three uses enrolls three agent containers (privileged, QEMU under TCG
 * here); a key; the edge entry (real workerd) in front of the gateways; then a sandbox created,
 * used and deleted through the edge. Every container stopped by SIGTERM exits 0 after its drain.
 * From the host: the gateway image holds no QEMU and runs as uid 10001.
 *
 * What differs from the README's hosts, and only that: names, ports and paths are swapped for this
 * test's own (each swap below says which), `THIS_HOST` is 127.0.0.1, and podman reads a
 * containers.conf (CONTAINERS_CONF) with what this kind of host needs: runc (bookworm's crun
 * refuses a host with cgroup v1 and v2 mounted together) and the host's own rlimits
 * (tests/support/podman.ts `ulimitArgs`). Each agent's data dir is seeded from the shared test
 * cache (guest artifacts, the debootstrapped python image), so its catalog build goes straight
 * to the template's boot. Every container and volume the test made is removed, also on failure.
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { spawnSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdtemp, readFile, rm, stat, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import * as B from "../../contracts/api/sandboxes-api.ts";
import { Api, expectOk, prepareDataDir, REPO, runCommand } from "../support/e2e-service.ts";
import { podman, podmanSync, ulimitArgs } from "../support/podman.ts";
import { freePort, startPostgres, type TestPostgres } from "../support/postgres.ts";
import { deployStep } from "../support/readme-blocks.ts";

/** The images' build (cold: a few minutes), then three templates' boots under TCG. */
const SETUP_TIMEOUT_MS = 25 * 60_000;
/** One README block other than the build: a podman run, exec or migration. */
const STEP_TIMEOUT_MS = 180_000;
/** The build block: deploy/images/build.sh cold (debootstrap, apt, the guest build). */
const BUILD_TIMEOUT_MS = 15 * 60_000;
/** One agent's python template build (boot and snapshot under TCG, a loaded host). */
const TEMPLATE_READY_MS = 6 * 60_000;
/** A sandbox's create, exec and delete, and every container's stop. */
const TEST_TIMEOUT_MS = 6 * 60_000;
/** `podman stop --time`: above the drain (2 s delay + requests in flight, none by then). */
const STOP_GRACE_S = 90;

const VERSION: string = JSON.parse(await readFile(join(REPO, "package.json"), "utf8")).version;
const run = randomBytes(4).toString("hex");
const names = {
  gateways: [1, 2].map((i) => `sbx-ctr-gw${i}-${run}`),
  agents: [1, 2, 3].map((i) => `sbx-ctr-agent${i}-${run}`),
};
const all = () => [...names.agents, ...names.gateways];
let images: { gateway: string; agent: string };
let pg: TestPostgres | null = null;
let work = "";
const agentDirs: string[] = [];
let env: NodeJS.ProcessEnv = {};
const gatewayPorts: number[] = [];
let key = "";
let edgeUrl = "";
/** The edge's address in the README, for this test's edge. */
const edgeSwap = (): [string, string] => ["edge.internal:8443", edgeUrl.replace("http://", "")];

/**
 * Runs the README's block of deployment step `name` in bash (`set -eo pipefail`: a failing
 * command fails it, as an operator would see), after `swaps` (each a [what the README says, what
 * this test uses] pair, every occurrence; one the block lacks fails, so a README edit cannot
 * silently drop a swap), with `extra` in the environment.
 */
async function step(
  name: string,
  swaps: Array<[string, string]> = [],
  extra: Record<string, string> = {},
  timeoutMs = STEP_TIMEOUT_MS,
): Promise<string> {
  let script = deployStep(REPO, name).script;
  for (const [from, to] of swaps) {
    if (!script.includes(from)) throw new Error(`deploy step ${name} no longer says ${JSON.stringify(from)}`);
    script = script.replaceAll(from, to);
  }
  const r = await runCommand("bash", ["-c", `set -eo pipefail\n${script}`], {
    env: { ...env, ...extra },
    cwd: REPO,
    timeoutMs,
  });
  if (r.code !== 0) {
    throw new Error(
      `deploy step ${name} exited ${r.code}:\n${script}\n--- stderr:\n${r.stderr.slice(-4000)}`,
    );
  }
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
  const tails = await Promise.all(all().map(async (n) => `--- ${n}:\n${await logs(n)}`));
  throw new Error(`${what} not within ${ms} ms\n${tails.join("\n")}`);
}

const lastLine = (out: string) => out.trim().split("\n").at(-1)!;

beforeAll(async () => {
  work = await mkdtemp(join(tmpdir(), "sbx-ctr-"));
  // What this kind of host needs of podman, for every podman command the README's blocks run.
  const rlimits = ulimitArgs().filter((a) => a !== "--ulimit");
  const conf = join(work, "containers.conf");
  await writeFile(
    conf,
    `[engine]\nruntime = "runc"\n[containers]\ndefault_ulimits = [${rlimits.map((l) => `"${l}"`).join(", ")}]\n`,
  );
  env = { ...process.env, CONTAINERS_CONF: conf, THIS_HOST: "127.0.0.1" };

  // 1. Images: the block names the version the images are tagged with.
  const built = await step("images", [], {}, BUILD_TIMEOUT_MS);
  const image = (kind: string) => {
    const m = new RegExp(`^${kind} (\\S+)$`, "m").exec(built);
    if (!m) throw new Error(`deploy/images/build.sh named no ${kind} image:\n${built}`);
    return m[1]!;
  };
  images = { gateway: image("gateway"), agent: image("agent") };
  expect(images.gateway).toStartWith(`localhost/sandboxd-gateway:${VERSION}-`);
  // The README names the images by the version build.sh tags them with (kept, not swapped: a
  // block naming another version fails).
  const tag = (kind: string): [string, string] => [
    `localhost/sandboxd-${kind}:${VERSION}`,
    `localhost/sandboxd-${kind}:${VERSION}`,
  ];

  // 2. PostgreSQL and the secrets' file (its path and the database's URL swapped).
  pg = await startPostgres();
  if (!pg) throw new Error("no PostgreSQL binaries (bin/sandboxd test installs postgresql)");
  const etc = join(work, "etc-sandboxd");
  await step("secrets", [
    ["/etc/sandboxd", etc],
    ["postgres://sandboxd:secret@db.internal:5432/sandboxd", pg.url],
  ]);
  const envFile = join(etc, "gateway.env");
  expect((await stat(envFile)).mode & 0o777).toBe(0o600);
  const secrets = (await readFile(envFile, "utf8")).match(
    /^SANDBOXD_\w+_SECRET=[0-9a-f]{64}$|^SANDBOXD_KEY_PEPPER=[0-9a-f]{64}$/gm,
  );
  expect(secrets?.length).toBe(3);
  const etcSwap: [string, string] = ["/etc/sandboxd", etc];
  const edgePort = await freePort();
  edgeUrl = `http://127.0.0.1:${edgePort}`;
  const edgeSwapHere = edgeSwap();

  // 3. The migration, from the gateway image.
  await step("migrate", [etcSwap, tag("gateway")]);

  // 4. Two gateways (their names and ports swapped; loopback for 0.0.0.0).
  for (const name of names.gateways) {
    const port = await freePort();
    gatewayPorts.push(port);
    await step("gateway", [
      etcSwap,
      tag("gateway"),
      ["--name sandboxd-gateway", `--name ${name}`],
      ["8080", String(port)],
      ["0.0.0.0", "127.0.0.1"],
      edgeSwapHere,
    ]);
  }
  for (const port of gatewayPorts) {
    await until(
      `the gateway on ${port}'s /readyz`,
      120_000,
      async () => (await fetch(`http://127.0.0.1:${port}/readyz`)).ok,
    );
  }
  const onGateway: [string, string] = ["podman exec sandboxd-gateway", `podman exec ${names.gateways[0]}`];

  // 5. One token of three uses.
  const token = lastLine(await step("token", [onGateway]));
  expect(token).toStartWith("sbxe_");

  // 6. Three agents, each behind one of the gateways (the load balancer's address swapped), its
  // data dir, name and port swapped. One after another: each builds its python template under
  // TCG at its start, and three at once on a 2-core host would starve the VM tests that run
  // beside this file.
  const readyAgents = async () => {
    const r = await podman(["exec", names.gateways[0]!, "sandboxd", "fleet", "list"]);
    const rows = r.stdout
      .trim()
      .split("\n")
      .filter(Boolean)
      .map((l) => JSON.parse(l) as { state: string; templates?: string[] });
    // The python catalog template is the one each agent builds at its start.
    return rows.filter((a) => a.state === "live" && (a.templates ?? []).length > 0).length;
  };
  for (const [i, name] of names.agents.entries()) {
    const dir = await prepareDataDir("sbx-e2e-ctr-");
    agentDirs.push(dir);
    await step(
      "agent",
      [
        tag("agent"),
        ["--name sandboxd-agent", `--name ${name}`],
        ["/var/lib/sandboxd:/var/lib/sandboxd", `${dir}:/var/lib/sandboxd`],
        ["gw.internal:8080", `127.0.0.1:${gatewayPorts[i % gatewayPorts.length]}`],
        ["7070", String(await freePort())],
        ["0.0.0.0", "127.0.0.1"],
      ],
      { TOKEN: token },
    );
    // Enrolled with the one token, live, holding the python template.
    await until(
      `agent ${i + 1} live with its python template`,
      TEMPLATE_READY_MS,
      async () => (await readyAgents()) === i + 1,
    );
  }

  // 7. A key; it names its home region.
  key = lastLine(await step("key", [onGateway]));
  expect(key).toStartWith("svc_pro_eu_");

  // 8. The edge: real workerd with the repository's capnp file, in front of both gateways.
  await step("edge", [
    ["/opt/sandboxd-edge", join(work, "edge")],
    ["/var/log/sandboxd-edge.log", join(work, "edge.log")],
    ["http://gw1.internal:8080", `http://127.0.0.1:${gatewayPorts[0]}`],
    ["http://gw2.internal:8080", `http://127.0.0.1:${gatewayPorts[1]}`],
    ["0.0.0.0:8443", `127.0.0.1:${edgePort}`],
  ]);
  await until("the edge answering", 60_000, async () => {
    const res = await fetch(`${edgeUrl}/v1/health`);
    return res.ok && res.headers.get("x-sandboxd-edge-region") === "eu";
  });
}, SETUP_TIMEOUT_MS);

afterAll(async () => {
  // The edge's workerd, started in the background by its block: found by its config's path.
  if (work) spawnSync("pkill", ["-f", join(work, "edge", "workerd.capnp")]);
  for (const name of all()) podmanSync(["rm", "--force", "--volumes", "--time", "0", name]);
  pg?.stop();
  for (const d of agentDirs) await rm(d, { recursive: true, force: true });
  if (work) await rm(work, { recursive: true, force: true });
});

test("the gateway image has no QEMU and runs as a non-root user", async () => {
  const user = (
    await podman(["image", "inspect", "--format", "{{.Config.User}}", images.gateway])
  ).stdout.trim();
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
  "through the edge: the README's check, then a sandbox's create, exec, delete; SIGTERM stops every container with exit 0",
  async () => {
    // 9. The README's check, as written.
    const checked = await step("check", [edgeSwap()], { KEY: key });
    expect(checked).toContain('"status":"ok"');
    expect(checked).toMatch(/"stdout":"hello from [^"]+\\n"/);

    const api = new Api(edgeUrl);
    const created = await api.post("/v1/sandboxes", { key, json: { template: "python" } });
    expect(created.headers.get("x-sandboxd-edge-region")).toBe("eu");
    const id = expectOk(created, 201, B.CreateSandboxResponse).id;
    const exec = expectOk(
      await api.post(`/v1/sandboxes/${id}/exec`, { key, json: { command: "echo hi" } }),
      200,
      B.ExecResponseB,
    );
    expect({ stdout: exec.stdout, exit_code: exec.exit_code }).toEqual({ stdout: "hi\n", exit_code: 0 });
    expectOk(await api.delete(`/v1/sandboxes/${id}`, { key }), 200, B.DeleteSandboxResponse);

    for (const name of all()) {
      const stop = await podman(["stop", "--time", String(STOP_GRACE_S), name]);
      expect(stop.code).toBe(0);
      const state = (
        await podman(["inspect", "--format", "{{.State.ExitCode}} {{.State.OOMKilled}}", name])
      ).stdout.trim();
      if (state !== "0 false") throw new Error(`${name} exited "${state}":\n${await logs(name)}`);
    }
    // Each drained before it stopped (cli/serve.ts's last line), with nothing in flight.
    for (const name of names.gateways)
      expect(await logs(name)).toContain("stopping: no request was in flight");
    for (const name of names.agents) expect(await logs(name)).toContain("stopping: no call was in flight");
  },
  TEST_TIMEOUT_MS,
);
