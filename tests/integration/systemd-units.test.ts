/**
 * The systemd units in deploy/systemd/ (docs/deploy.md "systemd units"): `systemd-analyze verify`
 * finds nothing to say about them (an unknown key, a bad value, a missing binary are each a line
 * it prints), checked in a scratch root that holds systemd's own units and the app's entry point
 * where the units expect it; and each ExecStart, with its flags' defaults expanded, is a command
 * the real CLI takes: run with one extra unknown flag, the CLI refuses only that flag (a wrong
 * subcommand or flag of the unit's would be refused first). systemd is installed when missing.
 */
import { beforeAll, expect, test } from "bun:test";
import { spawnSync } from "node:child_process";
import { cpSync, existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { REPO } from "../support/e2e-service.ts";

const UNITS = ["sandboxd-gateway.service", "sandboxd-agent.service"] as const;
/** The CLI's start (Bun loading it) on a loaded host; it exits at argument parsing. */
const CLI_TIMEOUT_MS = 60_000;
/** apt-get update and the systemd package on a fresh machine. */
const INSTALL_TIMEOUT_MS = 300_000;

beforeAll(() => {
  if (spawnSync("systemd-analyze", ["--version"]).status === 0) return;
  if (process.getuid?.() !== 0) throw new Error("systemd-analyze is missing: install the systemd package");
  const env = { ...process.env, DEBIAN_FRONTEND: "noninteractive" };
  for (const args of [
    ["update", "-q"],
    ["install", "-y", "-q", "--no-install-recommends", "systemd"],
  ]) {
    const r = spawnSync("apt-get", args, { env, encoding: "utf8", timeout: INSTALL_TIMEOUT_MS });
    if (r.status !== 0) throw new Error(`apt-get ${args.join(" ")} failed: ${r.stderr}`);
  }
}, INSTALL_TIMEOUT_MS * 2);

function unitText(name: string): string {
  return readFileSync(join(REPO, "deploy/systemd", name), "utf8");
}

/** `Key=value` lines of a unit (all of them, in order; quotes around a whole value dropped). */
function directives(text: string, key: string): string[] {
  return [...text.matchAll(new RegExp(`^${key}=(.*)$`, "gm"))].map((m) => m[1]!.replace(/^"(.*)"$/, "$1"));
}

test("systemd-analyze verify has nothing to say about either unit", () => {
  const root = mkdtempSync(join(tmpdir(), "sbx-units-"));
  try {
    // The entry point the units start, where they expect it, and systemd's own units (the
    // targets they order after).
    mkdirSync(join(root, "opt/sandboxd/bin"), { recursive: true });
    cpSync(join(REPO, "deploy/images/sandboxd.sh"), join(root, "opt/sandboxd/bin/sandboxd"));
    const systemUnits = ["/usr/lib/systemd/system", "/lib/systemd/system"].find((d) => existsSync(d))!;
    cpSync(systemUnits, join(root, "usr/lib/systemd/system"), { recursive: true, dereference: false });
    mkdirSync(join(root, "etc/systemd/system"), { recursive: true });
    for (const u of UNITS) cpSync(join(REPO, "deploy/systemd", u), join(root, "etc/systemd/system", u));
    const r = spawnSync("systemd-analyze", [`--root=${root}`, "verify", ...UNITS], { encoding: "utf8" });
    expect(`${r.stdout}${r.stderr}`).toBe("");
    expect(r.status).toBe(0);
  } finally {
    rmSync(root, { recursive: true, force: true });
  }
});

test("the units stop by SIGTERM and wait longer than the default drain", () => {
  for (const u of UNITS) {
    const text = unitText(u);
    expect(directives(text, "KillSignal")).toEqual(["SIGTERM"]);
    // SANDBOXD_DRAIN_DELAY (2 s) + SANDBOXD_DRAIN_TIMEOUT (60 s) by default.
    expect(Number(directives(text, "TimeoutStopSec")[0])).toBeGreaterThan(62);
    expect(directives(text, "EnvironmentFile")[0]).toStartWith("-/etc/sandboxd/");
  }
  // The agent's VMs outlive its restarts: only the agent itself is signalled.
  expect(directives(unitText("sandboxd-agent.service"), "KillMode")).toEqual(["process"]);
  expect(directives(unitText("sandboxd-gateway.service"), "DynamicUser")).toEqual(["yes"]);
});

for (const u of UNITS) {
  test(`${u}: ExecStart is a subcommand with flags the CLI takes`, () => {
    const text = unitText(u);
    const env = new Map(
      directives(text, "Environment").map((e) => [e.slice(0, e.indexOf("=")), e.slice(e.indexOf("=") + 1)]),
    );
    const [exec] = directives(text, "ExecStart");
    const words = exec!.split(/\s+/).flatMap((w) => {
      const m = /^\$\{?(\w+)\}?$/.exec(w);
      return m ? (env.get(m[1]!) ?? "").split(/\s+/).filter(Boolean) : [w];
    });
    expect(words[0]).toBe("/opt/sandboxd/bin/sandboxd");
    const probe = "--no-such-flag-probe";
    const r = spawnSync(join(REPO, "bin/sandboxd"), [...words.slice(1), probe], {
      encoding: "utf8",
      timeout: CLI_TIMEOUT_MS,
      env: { ...process.env, SANDBOXD_DATA_DIR: join(tmpdir(), "sbx-units-never-made") },
    });
    expect(r.stderr).toContain(`Unknown option '${probe}'`);
  });
}
