/**
 * Metering end to end with real VMs and the real service (`bin/sandboxd up`, its agent's events
 * reaching the gateway over HTTP): a sandbox idle for 16 s after one exec is billed for its
 * running seconds only, with its disk measured; suspended and resumed, its time is split by
 * state; its QEMU killed with `kill -9` ends its row `failed` with the agent's reason and stops
 * its billing within seconds. Then `bin/sandboxd usage` prints the timeline from the database
 * (after `up` stopped: PGlite is one process's). The same flow with an injected clock, checked
 * to the second: tests/integration/usage-timeline.test.ts.
 */
import { beforeAll, expect, test } from "bun:test";
import { readdir, readFile, writeFile } from "node:fs/promises";
import { join } from "node:path";
import * as B from "../../contracts/api/sandboxes-api.ts";
import { expectOk, runCli, waitFor } from "../support/e2e-service.ts";
import { useService } from "../support/service.ts";

/** Create, exec, 16 s idle, suspend/resume, a kill: about 40 s of the test's own waiting. */
const TEST_TIMEOUT_MS = 240_000;
/**
 * The agent's idle pause for this service: short, so that the 16 s idle is nearly all paused
 * and a running second billed too many shows.
 */
const IDLE_PAUSE_MS = 1_000;
/**
 * Slack on each measured span: the test sees a state change from the client side of an HTTP
 * call (one round trip on loopback, plus the agent's event on its way) on a host shared with
 * other suites; the events themselves carry the agent's own time.
 */
const SLACK_S = 2.5;

const TENANT = "meter-co";

const fx = useService({
  keys: { key: [TENANT, "pro"] },
  env: { SANDBOXD_IDLE_PAUSE_MS: String(IDLE_PAUSE_MS) },
});
let key = "";
beforeAll(() => {
  ({ key } = fx.keys);
});
const service = () => fx.svc;

const WINDOW_FROM = new Date(Date.now() - 3_600_000);
async function totals() {
  const to = new Date(Date.now() + 3_600_000);
  const res = await service().api.get("/v1/usage", {
    key,
    query: { from: WINDOW_FROM.toISOString(), to: to.toISOString() },
  });
  return expectOk(res, 200, B.UsageResponse).totals;
}

/** The QEMU pid the agent recorded for its one sandbox VM. */
async function qemuPid(): Promise<number> {
  const dir = join(fx.dataDir, "agent", "records", "sandboxes");
  const files = (await readdir(dir)).filter((f) => f.endsWith(".json"));
  expect(files.length).toBe(1);
  const rec = JSON.parse(await readFile(join(dir, files[0]!), "utf8")) as { qemuPid?: number };
  return rec.qemuPid!;
}

const secs = (a: number, b: number) => (b - a) / 1000;
let sandboxId = "";
/** Client-side instants of the timeline, ms. */
const t: Record<string, number> = {};

test(
  "idle 16 s after one exec: billed for its running seconds only (vCPU), its disk metered",
  async () => {
    const api = service().api;
    t.create = Date.now();
    const sb = expectOk(
      await api.post("/v1/sandboxes", { key, json: { template: "python" } }),
      201,
      B.CreateSandboxResponse,
    );
    sandboxId = sb.id;
    // 8 MiB written to the root disk: the overlay grows, and the agent reports the new size.
    const ex = await api.post(`/v1/sandboxes/${sb.id}/exec`, {
      key,
      json: { command: "head -c 8388608 /dev/urandom > /var/tmp/blob && sync && echo ok" },
    });
    expect(expectOk(ex, 200, B.ExecResponseB).stdout.trim()).toBe("ok");
    t.execEnd = Date.now();
    await Bun.sleep(16_000);
    t.idleEnd = Date.now();
    const u = await totals();
    // The template's size: 1 vCPU, 256 MiB (the catalog's default).
    const running = u.cpu_core_hours * 3600;
    const runningAndPaused = (u.ram_gb_hours * 3600) / 0.25;
    console.log(JSON.stringify({ running_s: running, running_and_paused_s: runningAndPaused, ...u }));
    // Running: from the create to the idle pause one second after the exec, not the 16 s idle.
    expect(running).toBeGreaterThan(IDLE_PAUSE_MS / 1000 - SLACK_S / 2);
    expect(running).toBeLessThan(secs(t.create!, t.execEnd!) + IDLE_PAUSE_MS / 1000 + SLACK_S);
    // RAM is billed for the paused time too: the whole life so far.
    expect(runningAndPaused).toBeGreaterThan(secs(t.execEnd!, t.idleEnd!) - SLACK_S);
    expect(runningAndPaused).toBeLessThan(secs(t.create!, t.idleEnd!) + SLACK_S);
    // The overlay was measured (at create) and again after the 8 MiB write: on average over the
    // life, at least those 8 MiB over the idle time that followed the write.
    expect(u.disk_gb_hours).toBeGreaterThan(0);
    const idleShare = (secs(t.execEnd!, t.idleEnd!) - SLACK_S) / runningAndPaused;
    expect((u.disk_gb_hours * 3600) / runningAndPaused).toBeGreaterThan((8 / 1024) * idleShare);
  },
  TEST_TIMEOUT_MS,
);

test(
  "suspend, resume, kill -9: the row ends failed with the agent's reason and billing stops within seconds",
  async () => {
    expect(sandboxId).not.toBe("");
    const api = service().api;
    t.suspend = Date.now();
    expectOk(await api.post(`/v1/sandboxes/${sandboxId}/suspend`, { key }), 200, B.StateResponse);
    await Bun.sleep(4_000);
    t.resume = Date.now();
    expectOk(await api.post(`/v1/sandboxes/${sandboxId}/resume`, { key }), 200, B.StateResponse);
    t.resumed = Date.now();
    await Bun.sleep(3_000);
    const pid = await qemuPid();
    t.kill = Date.now();
    process.kill(pid, "SIGKILL");
    // Within seconds the sandbox is gone for its tenant: no longer listed, no longer counted.
    const ended = await waitFor(
      async () => (await api.get(`/v1/sandboxes/${sandboxId}`, { key })).status === 404,
      10_000,
    );
    t.gone = Date.now();
    expect(ended).toBe(true);
    const list = expectOk(await api.get("/v1/sandboxes", { key }), 200, B.SandboxList);
    expect(list.sandboxes.map((s) => s.id)).not.toContain(sandboxId);
    console.log(JSON.stringify({ kill_to_gone_ms: t.gone - t.kill }));
    // Nothing accrues after the death: two reads seconds apart agree.
    const a = await totals();
    await Bun.sleep(3_000);
    const b = await totals();
    expect(b.cpu_core_hours).toBeCloseTo(a.cpu_core_hours, 9);
    expect(b.ram_gb_hours).toBeCloseTo(a.ram_gb_hours, 9);
  },
  TEST_TIMEOUT_MS,
);

test(
  "sandboxd usage prints the timeline: running, paused, suspended seconds and how the sandbox ended",
  async () => {
    expect(t.gone).toBeDefined();
    expect((await fx.stop()).exit).toBe(0);
    const from = WINDOW_FROM.toISOString();
    const to = new Date(Date.now() + 60_000).toISOString();
    const base = ["usage", "--data-dir", fx.dataDir, "--tenant", TENANT, "--from", from, "--to", to];
    const json = await runCli([...base, "--by", "sandbox", "--json"]);
    expect(json.code).toBe(0);
    const report = JSON.parse(json.stdout) as { lines: Record<string, unknown>[] };
    const line = report.lines.find((l) => l.sandbox_id === sandboxId)!;
    expect(line).toMatchObject({ state: "destroyed", end_reason: "failed" });
    expect(String(line.end_detail)).toContain("QEMU exited (signal SIGKILL)");
    const n = (k: string) => Number(line[k]);
    // Suspended from the suspend's answer to the resume's call, give or take the calls themselves.
    expect(n("suspended_seconds")).toBeGreaterThan(secs(t.suspend!, t.resume!) - SLACK_S);
    expect(n("suspended_seconds")).toBeLessThan(secs(t.suspend!, t.resumed!) + SLACK_S);
    // Running again from the resume until the kill (plus the first stretch, checked above); one
    // vCPU, so its core-hours are its running hours.
    expect(n("cpu_core_hours") * 3600).toBeCloseTo(n("running_seconds"), 6);
    expect(n("running_seconds")).toBeGreaterThan(secs(t.resumed!, t.kill!) - SLACK_S);
    expect(n("paused_seconds")).toBeGreaterThan(16 - SLACK_S);
    // Everything the sandbox was billed for lies between its create and its death.
    const life = n("running_seconds") + n("paused_seconds") + n("suspended_seconds");
    expect(life).toBeLessThan(secs(t.create!, t.kill!) + SLACK_S);
    expect(life).toBeGreaterThan(secs(t.create!, t.kill!) - 2 * SLACK_S);

    const table = await runCli([...base, "--by", "sandbox"]);
    const days = await runCli([...base, "--by", "day"]);
    const total = await runCli(base);
    expect(table.code).toBe(0);
    expect(table.stdout).toContain(sandboxId);
    expect(days.stdout).toMatch(/\d{4}-\d{2}-\d{2}/);
    const out = [
      `$ sandboxd usage --tenant ${TENANT} --from ${from} --to ${to}`,
      total.stdout,
      `$ ... --by sandbox`,
      table.stdout,
      `$ ... --by day`,
      days.stdout,
    ].join("\n");
    console.log(out);
    if (process.env.SANDBOXD_USAGE_REPORT) await writeFile(process.env.SANDBOXD_USAGE_REPORT, out);
  },
  TEST_TIMEOUT_MS,
);
