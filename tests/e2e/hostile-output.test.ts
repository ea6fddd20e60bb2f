/**
 * A guest that floods its output, end to end over real HTTP (`bin/sandboxd up`, real VMs under
 * TCG): an exec printing far more than the exec output cap answers a bounded response with
 * `truncated: true` (sandboxes API sandbox exec and sessions API one-shot exec; an answer under the cap
 * carries no flag) while the service's memory stays bounded, and a guest writing to its serial
 * console grows the data dir by no more than the console's bound and keeps answering execs, also
 * under the next agent process after a restart (the running VM is adopted, its console drained).
 *
 * The service is one process under `up` (gateway and agent), so its /proc status is the memory of
 * both: VmHWM is reset through /proc/<pid>/clear_refs ("5") before each flood and read after it.
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { spawnSync } from "node:child_process";
import { existsSync, readdirSync, readFileSync, statSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { CONSOLE_DISK_BYTES } from "../../agent/qemu/console.ts";
import { MAX_EXEC_OUTPUT_BYTES, MAX_EXEC_RESPONSE_BYTES } from "../../contracts/api/limits.ts";
import * as B from "../../contracts/api/sandboxes-api.ts";
import * as A from "../../contracts/api/sessions-api.ts";
import {
  createKeys,
  expectOk,
  prepareDataDir,
  qemusUnder,
  type RunningService,
  removeDataDir,
  startUp,
  waitFor,
  waitForTemplate,
} from "../support/e2e-service.ts";

const SETUP_TIMEOUT_MS = 480_000;
const PYTHON = "python";
/**
 * What one exec may add to the service's peak RSS: the guest's answer (<= 1 MiB), its UTF-8
 * string, the agent's JSON (<= 6 MiB), the gateway's parse and its own JSON, and GC slack.
 * Without the cap a 300 MB output would need several hundred MiB here.
 */
const EXEC_RSS_BOUND_BYTES = 96 * 1024 * 1024;
/**
 * Seconds the console flood runs. A guest's writes to its 16550 UART moved 78-160 KB/s under TCG
 * here (measured with this test, depending on the host's load), so a 200 MB flood would take
 * 20-40 minutes; 40 s writes 3-6 MiB, several times the console bound, which is what the flood
 * shows: whatever the guest writes, the disk holds at most the bound.
 */
const CONSOLE_FLOOD_S = 40;

let svc: RunningService | undefined;
let dataDir = "";
let key = "";
/** A sessions API key (one-shot `/v1/exec`). */
let keyA = "";
let sandboxId = "";

const service = () => {
  if (!svc) throw new Error("the service did not start (see beforeAll)");
  return svc;
};

beforeAll(async () => {
  dataDir = await prepareDataDir();
  ({ pro: key, live: keyA } = await createKeys(dataDir, { pro: ["acme", "pro"], live: ["acme", "live"] }));
  svc = await startUp(dataDir);
  await waitForTemplate(svc, PYTHON, 300_000);
  const created = expectOk(
    await svc.api.post("/v1/sandboxes", { key, json: { template: PYTHON } }),
    201,
    B.CreateSandboxResponse,
  );
  sandboxId = created.id;
}, SETUP_TIMEOUT_MS);

afterAll(async () => {
  const s = svc;
  svc = undefined;
  if (s) {
    if (sandboxId) await s.api.delete(`/v1/sandboxes/${sandboxId}`, { key }).catch(() => undefined);
    await s.stop();
  }
  for (const q of await qemusUnder(dataDir)) process.kill(q.pid, "SIGKILL");
  if (dataDir) await removeDataDir(dataDir);
}, 120_000);

function status(pid: number): { rss: number; hwm: number } {
  const text = readFileSync(`/proc/${pid}/status`, "utf8");
  const kib = (name: string) =>
    Number(new RegExp(`^${name}:\\s+(\\d+) kB`, "m").exec(text)?.[1] ?? Number.NaN) * 1024;
  return { rss: kib("VmRSS"), hwm: kib("VmHWM") };
}

/** Resets the peak RSS (VmHWM) to the current RSS (proc(5) clear_refs "5"). */
function resetPeak(pid: number): void {
  writeFileSync(`/proc/${pid}/clear_refs`, "5");
}

function exec(command: string, timeoutSeconds: number) {
  return service().api.post(`/v1/sandboxes/${sandboxId}/exec`, {
    key,
    json: { command, timeout_seconds: timeoutSeconds },
    timeoutMs: (timeoutSeconds + 60) * 1000,
  });
}

const MiB = (n: number) => Math.round((n / 1048576) * 10) / 10;

test("an exec printing 300 MB answers a bounded response with truncated: true; the service's RSS stays bounded", async () => {
  const pid = service().pid;
  // Under the cap: the response is what it always was, with no `truncated` at all.
  const small = await exec("printf hello; printf oops >&2", 60);
  const s = expectOk(small, 200, B.ExecResponseB);
  expect([s.stdout, s.stderr, s.exit_code]).toEqual(["hello", "oops", 0]);
  expect(small.text).not.toContain("truncated");

  resetPeak(pid);
  const before = status(pid);
  const t0 = performance.now();
  const res = await exec("head -c 300000000 /dev/zero | tr '\\0' a", 600);
  const seconds = (performance.now() - t0) / 1000;
  const after = status(pid);
  const r = expectOk(res, 200, B.ExecResponseB);
  expect(r.exit_code).toBe(0);
  expect(r.truncated).toBe(true);
  expect(r.stdout).toBe("a".repeat(MAX_EXEC_OUTPUT_BYTES));
  expect(r.stderr).toBe("");
  const responseBytes = Buffer.byteLength(res.text);
  expect(responseBytes).toBeLessThanOrEqual(MAX_EXEC_RESPONSE_BYTES);
  const peakGrowth = after.hwm - before.rss;

  // The worst case for JSON: control bytes, 6 bytes each once escaped.
  resetPeak(pid);
  const before0 = status(pid);
  const nul = await exec("head -c 3000000 /dev/zero", 120);
  const after0 = status(pid);
  const z = expectOk(nul, 200, B.ExecResponseB);
  expect(z.truncated).toBe(true);
  expect(z.stdout.length).toBe(MAX_EXEC_OUTPUT_BYTES);
  const nulBytes = Buffer.byteLength(nul.text);
  expect(nulBytes).toBeGreaterThan(6 * MAX_EXEC_OUTPUT_BYTES);
  expect(nulBytes).toBeLessThanOrEqual(MAX_EXEC_RESPONSE_BYTES);
  const peakGrowth0 = after0.hwm - before0.rss;

  console.log(
    JSON.stringify({
      exec_flood: {
        guest_output_bytes: 300_000_000,
        seconds: Math.round(seconds * 10) / 10,
        response_bytes: responseBytes,
        nul_response_bytes: nulBytes,
        response_bound_bytes: MAX_EXEC_RESPONSE_BYTES,
        rss_before_mib: MiB(before.rss),
        rss_after_mib: MiB(after.rss),
        peak_mib: MiB(after.hwm),
        peak_growth_mib: MiB(peakGrowth),
        nul_peak_growth_mib: MiB(peakGrowth0),
        rss_bound_mib: MiB(EXEC_RSS_BOUND_BYTES),
      },
    }),
  );
  expect(peakGrowth).toBeLessThanOrEqual(EXEC_RSS_BOUND_BYTES);
  expect(peakGrowth0).toBeLessThanOrEqual(EXEC_RSS_BOUND_BYTES);
}, 900_000);

test("Sessions API: a one-shot exec printing past the cap answers truncated: true, one under it has no flag", async () => {
  const big = ["import sys", "for _ in range(20):", "    sys.stdout.write('b' * 1000000)"].join("\n");
  const res = await service().api.post("/v1/exec", {
    key: keyA,
    json: { code: big, template_id: PYTHON, timeout_seconds: 120 },
    timeoutMs: 240_000,
  });
  const r = expectOk(res, 200, A.ExecResultA);
  expect(r.exit_code).toBe(0);
  expect(r.truncated).toBe(true);
  expect(r.stdout).toBe("b".repeat(MAX_EXEC_OUTPUT_BYTES));
  expect(Buffer.byteLength(res.text)).toBeLessThanOrEqual(MAX_EXEC_RESPONSE_BYTES);

  const small = await service().api.post("/v1/exec", {
    key: keyA,
    json: { code: "print('fits')", template_id: PYTHON },
  });
  expect(expectOk(small, 200, A.ExecResultA).stdout).toBe("fits\n");
  expect(small.text).not.toContain("truncated");
}, 300_000);

/** `du -sb`: bytes of the files under `path` (apparent size, like the files' own sizes). */
function du(path: string, exclude: string[] = []): number {
  const r = spawnSync("du", ["-sb", ...exclude.map((e) => `--exclude=${e}`), path], { encoding: "utf8" });
  if (r.status !== 0) throw new Error(`du ${path}: ${r.stderr}`);
  return Number(r.stdout.split("\t")[0]);
}

function vmDirOf(): string {
  const vms = join(dataDir, "agent", "vms");
  const live = readdirSync(vms).filter((d) => existsSync(join(vms, d, "console.sock")));
  if (live.length !== 1) throw new Error(`expected one running VM under ${vms}, found ${live.join(", ")}`);
  return join(vms, live[0]!);
}

const consoleBytes = (dir: string) =>
  ["console.log", "console.log.1"].reduce((sum, f) => {
    const p = join(dir, f);
    return sum + (existsSync(p) ? statSync(p).size : 0);
  }, 0);

/** Floods /dev/console for about `seconds`, 1 MiB at a time; returns the bytes the guest wrote. */
async function floodConsole(seconds: number): Promise<number> {
  const res = await exec(
    `end=$(( $(date +%s) + ${seconds} )); n=0; while [ "$(date +%s)" -lt "$end" ]; do head -c 1048576 /dev/zero | tr '\\0' x > /dev/console; n=$((n + 1)); done; echo $n`,
    seconds + 120,
  );
  const r = expectOk(res, 200, B.ExecResponseB);
  const mib = Number(r.stdout.trim());
  if (!Number.isInteger(mib) || r.exit_code !== 0) throw new Error(`flood said: ${r.stdout} ${r.stderr}`);
  return mib * 1048576;
}

test("a guest flooding its console grows the data dir by no more than the console bound, and still answers execs (also after an agent restart)", async () => {
  const dir = vmDirOf();
  // The database (PGlite) grows by the exec's own rows whatever the console does: measured apart.
  const dataBefore = du(dataDir, ["pglite"]);
  const dbBefore = du(join(dataDir, "pglite"));
  const vmBefore = du(dir);
  const t0 = performance.now();
  const written = await floodConsole(CONSOLE_FLOOD_S);
  const seconds = (performance.now() - t0) / 1000;
  const vmAfter = du(dir);
  const dataAfter = du(dataDir, ["pglite"]);
  const dbAfter = du(join(dataDir, "pglite"));
  const onDisk = consoleBytes(dir);
  const tailLine = readFileSync(join(dir, "console.log"), "utf8").slice(-64);

  const ok = expectOk(await exec("echo still-here", 60), 200, B.ExecResponseB);
  expect(ok.stdout).toBe("still-here\n");

  // The next agent process adopts the running VM and drains its console from then on.
  await service().stop();
  svc = await startUp(dataDir, ["--no-catalog"]);
  const again = expectOk(await exec("echo adopted", 120), 200, B.ExecResponseB);
  expect(again.stdout).toBe("adopted\n");
  const writtenAfterRestart = await floodConsole(10);
  const onDiskAfterRestart = consoleBytes(dir);
  const marker = `console-after-restart-${Date.now()}`;
  expectOk(await exec(`echo ${marker} > /dev/console`, 60), 200, B.ExecResponseB);
  // The agent drains the console as it comes: wait for the marker itself (bounded), not a while.
  let tailAfterRestart = "";
  const drained = await waitFor(() => {
    tailAfterRestart = readFileSync(join(dir, "console.log"), "utf8");
    return tailAfterRestart.includes(marker);
  }, 30_000);

  console.log(
    JSON.stringify({
      console_flood: {
        guest_bytes_written: written,
        seconds: Math.round(seconds * 10) / 10,
        console_bytes_on_disk: onDisk,
        console_bound_bytes: CONSOLE_DISK_BYTES,
        vm_dir_growth_bytes: vmAfter - vmBefore,
        data_dir_growth_bytes: dataAfter - dataBefore,
        database_growth_bytes: dbAfter - dbBefore,
        after_restart_guest_bytes_written: writtenAfterRestart,
        after_restart_console_bytes_on_disk: onDiskAfterRestart,
      },
    }),
  );
  expect(written).toBeGreaterThan(2 * CONSOLE_DISK_BYTES);
  expect(tailLine).toMatch(/x{32}/);
  expect(onDisk).toBeLessThanOrEqual(CONSOLE_DISK_BYTES);
  expect(vmAfter - vmBefore).toBeLessThanOrEqual(CONSOLE_DISK_BYTES);
  expect(dataAfter - dataBefore).toBeLessThanOrEqual(CONSOLE_DISK_BYTES);
  expect(onDiskAfterRestart).toBeLessThanOrEqual(CONSOLE_DISK_BYTES);
  expect(drained).toBe(true);
  expect(tailAfterRestart).toContain(marker);
}, 900_000);
