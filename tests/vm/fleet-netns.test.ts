/**
 * A fleet on one machine, each host agent in a network namespace of its own (docs/fleet.md "The
 * fleet test"): a real PostgreSQL, two `bin/sandboxd gateway` processes behind one address (a
 * TCP edge in this test that sends each connection to a live gateway), and three
 * `bin/sandboxd agent` processes over REAL VMs under TCG in two regions: `fa` (eu) and `fc` (us)
 * reached at their namespace's address, `fb` (eu) a BYOC agent that dials out to the one address
 * (its link lands on one gateway; the other relays to it, gateway/agents/dial-relay.ts) and that
 * nothing can reach (it listens on its namespace's loopback, and its namespace drops
 * every new connection coming in). Tenants at home in each region.
 *
 * - kill -9 of `fc`: its sessions end (`failed`, host lost) and the tenant's quota is free again;
 * - a partition of `fa` (its link down past the staleness bound, within the lost bound): it leaves
 *   placement, comes back, its session answers again, and no session is billed twice (no two
 *   open usage intervals, none overlapping);
 * - kill -9 of a gateway in the middle of execs: clients that retry through the one address land
 *   on the other gateway, every exec is answered, and the BYOC agent's sessions stay reachable
 *   (its link moves to the gateway left when it was on the one killed).
 *
 * The timeline measured is printed as JSON. Needs root, `ip netns`, iptables and PostgreSQL;
 * skipped otherwise.
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { spawnSync } from "node:child_process";
import { readFile } from "node:fs/promises";
import { createServer, type Server, connect as tcpConnect } from "node:net";
import { join } from "node:path";
import { eq } from "drizzle-orm";
import { DIAL_URL_SCHEME } from "../../contracts/agent/dial.ts";
import { type DbHandle, openDb } from "../../db/client.ts";
import { agents } from "../../db/schema/agents.ts";
import { dialLinks } from "../../db/schema/dial-links.ts";
import { sandboxes } from "../../db/schema/sandboxes.ts";
import { usageIntervals } from "../../db/schema/usage-intervals.ts";
import { RELAY_SCAN_MS } from "../../gateway/agents/dial-relay.ts";
import { createEnrollmentToken } from "../../gateway/agents/enrollment.ts";
import { createKey } from "../../gateway/auth/keys.ts";
import { busyboxImageSpec, makeDockerArchive } from "../fixtures/images.ts";
import {
  Api,
  childEnv,
  prepareDataDir,
  type RunningService,
  reapDataDir,
  startServing,
  uploadTemplate,
} from "../support/e2e-service.ts";
import { findPgBin, freePort, startPostgres, type TestPostgres } from "../support/postgres.ts";

const SECRETS = {
  SANDBOXD_KEY_PEPPER: "fleet-netns-pepper-0123456789abcdef",
  SANDBOXD_CONNECT_SECRET: "fleet-netns-connect-0123456789abcdef",
  SANDBOXD_AGENT_SECRET: "fleet-netns-agent-secret-0123456789abcdef",
};
/** Three template builds (one per agent of each tenant's region) at once under TCG, and the starts. */
const SETUP_TIMEOUT_MS = 420_000;
/** The lost bound is 60 s (gateway/core/host-loss.ts); the rest is seconds. */
const TEST_TIMEOUT_MS = 420_000;

const enabled =
  process.getuid?.() === 0 &&
  spawnSync("ip", ["netns", "list"]).status === 0 &&
  spawnSync("iptables", ["--version"]).status === 0 &&
  findPgBin() !== null;

interface Ns {
  name: string;
  /** The host's end of its link (what the namespace reaches the gateways at). */
  hostIp: string;
  nsIp: string;
  hostIf: string;
}

function sh(cmd: string[], ok = true): string {
  const r = spawnSync(cmd[0] as string, cmd.slice(1), { encoding: "utf8" });
  if (ok && r.status !== 0) throw new Error(`${cmd.join(" ")}: ${r.stderr}`);
  return r.stdout;
}

function makeNs(n: number): Ns {
  const name = `sbxfleet${n}`;
  const hostIf = `sbxfl${n}h`;
  const nsIf = `sbxfl${n}n`;
  const ns: Ns = { name, hostIp: `10.231.${n}.1`, nsIp: `10.231.${n}.2`, hostIf };
  removeNs(ns);
  sh(["ip", "netns", "add", name]);
  sh(["ip", "link", "add", hostIf, "type", "veth", "peer", "name", nsIf]);
  sh(["ip", "link", "set", nsIf, "netns", name]);
  sh(["ip", "addr", "add", `${ns.hostIp}/30`, "dev", hostIf]);
  sh(["ip", "link", "set", hostIf, "up"]);
  const inNs = (...c: string[]) => sh(["ip", "netns", "exec", name, ...c]);
  inNs("ip", "addr", "add", `${ns.nsIp}/30`, "dev", nsIf);
  inNs("ip", "link", "set", nsIf, "up");
  inNs("ip", "link", "set", "lo", "up");
  inNs("ip", "route", "add", "default", "via", ns.hostIp);
  return ns;
}

function removeNs(ns: { name: string; hostIf: string }): void {
  sh(["ip", "link", "del", ns.hostIf], false);
  sh(["ip", "netns", "del", ns.name], false);
}

/** One address for both gateways: each connection goes to the first gateway that accepts it. */
async function edge(ports: () => number[]): Promise<{ server: Server; port: number }> {
  let next = 0;
  const server = createServer((client) => {
    const order = ports();
    const start = next++;
    const attempt = (i: number) => {
      if (i >= order.length) return client.destroy();
      const port = order[(start + i) % order.length] as number;
      const up = tcpConnect({ host: "127.0.0.1", port });
      up.once("connect", () => {
        client.pipe(up);
        up.pipe(client);
        up.on("error", () => client.destroy());
        client.on("error", () => up.destroy());
        up.on("close", () => client.destroy());
        client.on("close", () => up.destroy());
      });
      up.once("error", () => attempt(i + 1));
    };
    // Paused until the upstream is there: pipe() resumes it, so no byte is read before.
    client.pause();
    attempt(0);
  });
  await new Promise<void>((r) => server.listen(0, "0.0.0.0", r));
  return { server, port: (server.address() as { port: number }).port };
}

let pg: TestPostgres | null = null;
let db: DbHandle | undefined;
const gws: { svc: RunningService; dir: string; port: number; alive: boolean }[] = [];
const agentsRun: { id: string; svc: RunningService; dir: string; ns: Ns }[] = [];
const nss: Ns[] = [];
let front: { server: Server; port: number } | undefined;
let keys: { eu: string; us: string } = { eu: "", us: "" };
const api = () => new Api(`http://127.0.0.1:${front?.port}`);

async function startAgent(id: string, ns: Ns, region: string, byoc: boolean): Promise<void> {
  const token = (
    await createEnrollmentToken(db!.db, SECRETS.SANDBOXD_AGENT_SECRET, {
      region,
      ...(byoc ? { url: DIAL_URL_SCHEME } : {}),
    })
  ).token;
  const dir = await prepareDataDir(`sbx-e2e-fleet-${id}-`, { python: false });
  const gateway = `http://${ns.hostIp}:${front!.port}`;
  const where = byoc
    ? // The one address, like every other agent: its link lands on one gateway, which the other relays to.
      ["--listen", "127.0.0.1:7070", "--dial", gateway]
    : ["--listen", `${ns.nsIp}:7070`, "--advertise", `http://${ns.nsIp}:7070`];
  const args = ["agent", "--gateway", gateway, "--enroll", token, "--id", id, "--region", region];
  const svc = await startServing(
    [...args, ...where, "--no-catalog", "--data-dir", dir],
    dir,
    { ...childEnv(), ...SECRETS },
    // nsenter joins the network namespace only: `ip netns exec` also mounts a fresh /sys, which
    // hides the host's cgroup hierarchies the agent's jails need.
    ["nsenter", `--net=/var/run/netns/${ns.name}`],
  );
  agentsRun.push({ id, svc, dir, ns });
}

beforeAll(async () => {
  if (!enabled) return;
  pg = await startPostgres();
  if (!pg) return;
  db = await openDb({ url: pg.url });
  for (const g of [0, 1]) {
    const dir = await prepareDataDir(`sbx-e2e-fleet-gw${g}-`, { python: false });
    // Its peers reach it at a port known before it starts (its peer URL names it).
    const port = await freePort();
    const svc = await startServing(
      [
        "gateway",
        "--host",
        "0.0.0.0",
        "--port",
        String(port),
        "--peer-url",
        `http://127.0.0.1:${port}`,
        "--region",
        "eu",
        "--no-catalog",
        "--data-dir",
        dir,
      ],
      dir,
      { ...childEnv(), ...SECRETS, DATABASE_URL: pg.url },
    );
    gws.push({ svc, dir, port: Number(new URL(svc.url).port), alive: true });
  }
  front = await edge(() => gws.filter((g) => g.alive).map((g) => g.port));
  for (const n of [1, 2, 3]) nss.push(makeNs(n));
  // The BYOC namespace takes no connection in: only what it opened comes back.
  sh([
    "ip",
    "netns",
    "exec",
    nss[1]!.name,
    "iptables",
    "-A",
    "INPUT",
    "-m",
    "conntrack",
    "--ctstate",
    "NEW",
    "!",
    "-i",
    "lo",
    "-j",
    "DROP",
  ]);
  keys = {
    eu: (await createKey(db.db, SECRETS.SANDBOXD_KEY_PEPPER, { tenant: "acme", tier: "scale", region: "eu" }))
      .key,
    us: (
      await createKey(db.db, SECRETS.SANDBOXD_KEY_PEPPER, { tenant: "globex", tier: "scale", region: "us" })
    ).key,
  };
  await Promise.all([
    startAgent("fa", nss[0]!, "eu", false),
    startAgent("fb", nss[1]!, "eu", true),
    startAgent("fc", nss[2]!, "us", false),
  ]);
  // The BYOC agent's one link is up (its row), and the other gateway has looked for it (one
  // relay scan): both gateways take it as live before the uploads build on the region's agents.
  const linkedBy = performance.now() + SETUP_TIMEOUT_MS / 2;
  while ((await db.db.select().from(dialLinks).where(eq(dialLinks.agentId, "fb"))).length === 0) {
    if (performance.now() > linkedBy) throw new Error("the BYOC agent's link never came up");
    await Bun.sleep(200);
  }
  await Bun.sleep(RELAY_SCAN_MS + 1_000);
  const spec = await busyboxImageSpec(join(gws[0]!.dir, "img"));
  const archive = await makeDockerArchive(join(gws[0]!.dir, "busybox.tar"), spec);
  const image = new Uint8Array(await readFile(archive.path));
  const svc = {
    ...gws[0]!.svc,
    api: api(),
    logTail: () => agentsRun.map((a) => a.svc.logTail(10)).join("\n"),
  };
  await Promise.all([
    uploadTemplate(svc, keys.eu, "bb", image, SETUP_TIMEOUT_MS),
    uploadTemplate(svc, keys.us, "bb", image, SETUP_TIMEOUT_MS),
  ]);
  // Both eu agents report acme's template (built on both, or copied to one that missed the
  // build), so placement spreads acme's sessions over them.
  const heldBy = performance.now() + SETUP_TIMEOUT_MS / 2;
  for (;;) {
    const rows = await db.db.select().from(agents).where(eq(agents.region, "eu"));
    if (rows.length === 2 && rows.every((r) => r.templates.some((t) => t.endsWith(".bb")))) break;
    if (performance.now() > heldBy)
      throw new Error(
        `eu agents without acme's template: ${JSON.stringify(rows.map((r) => [r.id, r.templates]))}`,
      );
    await Bun.sleep(500);
  }
}, SETUP_TIMEOUT_MS);

afterAll(async () => {
  front?.server.close();
  // Each step whatever the others did: a namespace or a server left behind outlives the test.
  const steps = [
    ...agentsRun.map((a) => async () => {
      await a.svc.stop(5_000);
      await reapDataDir(a.dir);
    }),
    ...gws.map((g) => async () => {
      await g.svc.stop(5_000);
      await reapDataDir(g.dir);
    }),
    async () => {
      for (const ns of nss) removeNs(ns);
    },
    async () => db?.close(),
    async () => pg?.stop(),
  ];
  const errors: unknown[] = [];
  for (const step of steps) await step().catch((e) => errors.push(e));
  if (errors.length) throw errors[0];
}, 120_000);

/** Requests that needed more than one try (a gateway gone under them). */
let retried = 0;

/** A request through the one address, tried again (on another gateway) while none answers. */
async function call(method: string, path: string, key: string, json?: unknown) {
  for (let i = 0; ; i++) {
    if (i === 1) retried++;
    try {
      const r = await api().request<Record<string, unknown>>(method, path, {
        key,
        ...(json ? { json } : {}),
      });
      if (r.status !== 502 && r.status !== 503) return { ...r, tries: i + 1 };
      if (i > 40) return { ...r, tries: i + 1 };
    } catch (err) {
      if (i > 40) throw err;
    }
    await Bun.sleep(250);
  }
}

async function session(key: string): Promise<{ id: string; agent: string }> {
  const r = await call("POST", "/v1/sessions", key, { template_id: "bb" });
  expect(r.status).toBe(201);
  const id = r.body.session_id as string;
  return { id, agent: (await rowOf(id))?.agentId ?? "" };
}

const rowOf = async (id: string) => (await db!.db.select().from(sandboxes).where(eq(sandboxes.id, id)))[0];

const execOk = async (key: string, id: string, text: string) => {
  const r = await call("POST", `/v1/sessions/${id}/exec`, key, { commands: [["echo", text]] });
  return r.status === 200 && JSON.stringify(r.body).includes(text);
};

test.skipIf(!enabled)(
  "agent killed, agent partitioned, gateway killed mid-execs: rows end, quota returns, nothing double-billed, nothing lost",
  async () => {
    if (!pg) throw new Error("PostgreSQL did not start");
    const timeline: Record<string, number> = {};
    const eu = [
      await session(keys.eu),
      await session(keys.eu),
      await session(keys.eu),
      await session(keys.eu),
    ];
    const us = [await session(keys.us), await session(keys.us)];
    for (const s of us) expect(await execOk(keys.us, s.id, "us")).toBe(true);
    for (const s of eu) expect(await execOk(keys.eu, s.id, "eu")).toBe(true);

    // The BYOC agent cannot be reached: a connection to its namespace is dropped.
    const reached = await new Promise<boolean>((r) => {
      const c = tcpConnect({ host: nss[1]!.nsIp, port: 7070 });
      const t = setTimeout(() => {
        c.destroy();
        r(false);
      }, 1_500);
      c.once("connect", () => {
        clearTimeout(t);
        c.destroy();
        r(true);
      });
      c.once("error", () => {
        clearTimeout(t);
        r(false);
      });
    });
    expect(reached).toBe(false);
    // Its one link is held by one gateway; the other relays to it: each gateway, asked directly,
    // runs an exec in one of its sessions.
    const links = await db!.db.select().from(dialLinks).where(eq(dialLinks.agentId, "fb"));
    expect(links).toHaveLength(1);
    // Placement spreads acme's four sessions over its two agents (least loaded first).
    const onByoc = eu.find((s) => s.agent === "fb");
    if (!onByoc) throw new Error(`no session on the BYOC agent: ${JSON.stringify(eu)}`);
    for (const g of gws) {
      const r = await new Api(`http://127.0.0.1:${g.port}`).request<Record<string, unknown>>(
        "POST",
        `/v1/sessions/${onByoc.id}/exec`,
        { key: keys.eu, json: { commands: [["echo", `via-${g.port}`]] } },
      );
      expect(JSON.stringify(r.body)).toContain(`via-${g.port}`);
    }

    // 1. kill -9 of the us agent: its sessions end and globex's quota is free.
    const fc = agentsRun.find((a) => a.id === "fc")!;
    const t0 = performance.now();
    process.kill(fc.svc.pid, "SIGKILL");
    const ended = async () => {
      for (const s of us) if ((await rowOf(s.id))?.endReason !== "host_lost") return false;
      return true;
    };
    const stale = async () =>
      (await call("POST", "/v1/sessions", keys.us, { template_id: "bb" })).status === 503;
    while (!(await stale()) && performance.now() - t0 < 60_000) await Bun.sleep(500);
    timeline.agent_kill_to_out_of_placement_ms = Math.round(performance.now() - t0);
    while (!(await ended()) && performance.now() - t0 < 150_000) await Bun.sleep(1000);
    timeline.agent_kill_to_rows_ended_ms = Math.round(performance.now() - t0);
    expect(await ended()).toBe(true);
    // The quota: globex holds no session any more (each ended row gave its place back).
    for (const s of us) expect((await rowOf(s.id))?.destroyedAt).not.toBeNull();

    // 2. a partition of fa, past staleness, within the lost bound: it comes back.
    const fa = agentsRun.find((a) => a.id === "fa")!;
    const onFa = eu.filter((s) => s.agent === "fa");
    sh(["ip", "link", "set", fa.ns.hostIf, "down"]);
    const t1 = performance.now();
    await Bun.sleep(20_000);
    // Meanwhile acme's creates go to fb.
    const during = await session(keys.eu);
    expect(during.agent).toBe("fb");
    sh(["ip", "link", "set", fa.ns.hostIf, "up"]);
    for (const s of onFa) {
      while (!(await execOk(keys.eu, s.id, "back")) && performance.now() - t1 < 90_000) await Bun.sleep(500);
      expect(await execOk(keys.eu, s.id, "back")).toBe(true);
    }
    timeline.partition_to_answer_again_ms = Math.round(performance.now() - t1);
    const open = await db!.db.select().from(usageIntervals);
    const bySandbox = new Map<string, (typeof open)[number][]>();
    for (const iv of open) bySandbox.set(iv.sandboxId, [...(bySandbox.get(iv.sandboxId) ?? []), iv]);
    for (const [, ivs] of bySandbox) {
      expect(ivs.filter((iv) => iv.endedAt === null).length).toBeLessThanOrEqual(1);
      const sorted = ivs.sort((a, b) => a.startedAt.getTime() - b.startedAt.getTime());
      for (let i = 1; i < sorted.length; i++)
        expect(sorted[i]!.startedAt.getTime()).toBeGreaterThanOrEqual(sorted[i - 1]!.endedAt!.getTime());
    }

    // 3. kill -9 of a gateway in the middle of execs: retries through the one address answer all.
    const onFb = [...eu, during].filter((s) => s.agent === "fb");
    const targets = [...eu, during];
    let answered = 0;
    const runs = targets.map(async (s, i) => {
      for (let n = 0; n < 5; n++) if (await execOk(keys.eu, s.id, `g${i}-${n}`)) answered++;
    });
    await Bun.sleep(300);
    const retriedBefore = retried;
    gws[0]!.alive = false;
    process.kill(gws[0]!.svc.pid, "SIGKILL");
    const t2 = performance.now();
    await Promise.all(runs);
    timeline.gateway_kill_execs_answered = answered;
    timeline.gateway_kill_execs_sent = targets.length * 5;
    timeline.gateway_kill_requests_retried = retried - retriedBefore;
    for (const s of onFb) expect(await execOk(keys.eu, s.id, "byoc-after")).toBe(true);
    timeline.gateway_kill_to_all_answered_ms = Math.round(performance.now() - t2);
    console.log(`FLEET_TIMELINE ${JSON.stringify(timeline)}`);
    expect(answered).toBe(targets.length * 5);
  },
  TEST_TIMEOUT_MS,
);
