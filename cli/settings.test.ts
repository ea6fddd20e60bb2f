/**
 * The operator settings parser (cli/settings.ts): defaults, environment, flag over environment,
 * config files (JSON and KEY=VALUE), refusals that name the setting, and the README's table.
 * Also the commands themselves: an invalid value makes `up`, `gateway` and `agent` exit 2 with
 * that message before they open anything.
 */
import { describe, expect, test } from "bun:test";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { FORK_CAP_BY_TIER, SESSION_IDLE_TTL_S } from "../contracts/api/limits.ts";
import { runCli } from "../tests/support/e2e-service.ts";
import { REPO_ROOT } from "./config.ts";
import {
  agentSettings,
  gatewayLimits,
  gatewayStart,
  readSettings,
  SETTINGS,
  type Settings,
  settingsTable,
} from "./settings.ts";

const noFile = (p: string): string => {
  throw new Error(`ENOENT: no such file, open '${p}'`);
};

function ok(flags: Record<string, unknown>, env: NodeJS.ProcessEnv = {}, files: Record<string, string> = {}) {
  const r = readSettings(flags, env, (p) => files[p] ?? noFile(p));
  if (!r.ok) throw new Error(r.error);
  return r.settings;
}

function refused(
  flags: Record<string, unknown>,
  env: NodeJS.ProcessEnv = {},
  files: Record<string, string> = {},
) {
  const r = readSettings(flags, env, (p) => files[p] ?? noFile(p));
  if (r.ok) throw new Error(`accepted: ${JSON.stringify(r.settings)}`);
  return r.error;
}

describe("readSettings", () => {
  test("defaults: every setting at its documented default, the code's own constants", () => {
    const s = ok({});
    expect(Object.keys(s).sort()).toEqual(SETTINGS.map((x) => x.env).sort());
    expect(s.SANDBOXD_SESSION_IDLE_TTL).toBe(SESSION_IDLE_TTL_S);
    expect(s.SANDBOXD_REAPER_INTERVAL).toBe(30);
    expect(s.SANDBOXD_SESSION_CAP).toBe(100);
    expect(s.SANDBOXD_FORK_CAP_PRO).toBe(FORK_CAP_BY_TIER.pro);
    expect(s.SANDBOXD_QUOTA_DEMO).toBe(5);
    expect(s.SANDBOXD_BUILD_SLOTS).toBe(2);
    expect(s.SANDBOXD_IDLE_PAUSE_MS).toBe(2000);
    expect(s.SANDBOXD_BOOT_TIMEOUT).toBe(60);
    expect(s.SANDBOXD_RESTORE_TIMEOUT).toBe(30);
  });

  test("the environment sets a value; the flag beats the environment", () => {
    expect(ok({}, { SANDBOXD_SESSION_IDLE_TTL: "4" }).SANDBOXD_SESSION_IDLE_TTL).toBe(4);
    const s = ok({ "session-idle-ttl": "7" }, { SANDBOXD_SESSION_IDLE_TTL: "4", SANDBOXD_QUOTA_PRO: "9" });
    expect(s.SANDBOXD_SESSION_IDLE_TTL).toBe(7);
    expect(s.SANDBOXD_QUOTA_PRO).toBe(9);
  });

  test("a config file (JSON or KEY=VALUE) sets values below the environment and the flags", () => {
    const files = {
      "/c.json": JSON.stringify({ SANDBOXD_SESSION_CAP: 3, SANDBOXD_BUILD_SLOTS: "5" }),
      "/c.env": "# operator settings\n\nSANDBOXD_SESSION_CAP = 3\nSANDBOXD_REAPER_INTERVAL=2\n",
    };
    const j = ok({ config: "/c.json" }, {}, files);
    expect([j.SANDBOXD_SESSION_CAP, j.SANDBOXD_BUILD_SLOTS]).toEqual([3, 5]);
    const e = ok({ config: "/c.env", "reaper-interval": "8" }, { SANDBOXD_SESSION_CAP: "6" }, files);
    expect([e.SANDBOXD_SESSION_CAP, e.SANDBOXD_REAPER_INTERVAL]).toEqual([6, 8]);
  });

  test("an invalid value is refused with the setting's name, its range and where it came from", () => {
    expect(refused({}, { SANDBOXD_SESSION_IDLE_TTL: "0" })).toBe(
      'SANDBOXD_SESSION_IDLE_TTL (--session-idle-ttl) must be a whole number from 1 to 604800 (seconds), got "0" from the environment',
    );
    expect(refused({ "session-cap": "ten" })).toContain("SANDBOXD_SESSION_CAP (--session-cap)");
    expect(refused({ "session-cap": "ten" })).toContain("from --session-cap");
    for (const bad of ["-1", "1.5", "1e3", "", " ", "0x10", "99999999"])
      expect(refused({}, { SANDBOXD_BUILD_SLOTS: bad })).toContain("SANDBOXD_BUILD_SLOTS");
    expect(refused({ config: "/c" }, {}, { "/c": "SANDBOXD_IDLE_PAUSE_MS=5\n" })).toContain(
      "from config file /c",
    );
  });

  test("the idle lifetime default: off unless set; its action is a word from the list", () => {
    const d = gatewayLimits(ok({}));
    expect([d.idleTimeoutS, d.idleAction]).toEqual([0, "suspend"]);
    const s = ok({ "idle-action": "delete" }, { SANDBOXD_IDLE_TIMEOUT: "600" });
    expect([s.SANDBOXD_IDLE_TIMEOUT, s.SANDBOXD_IDLE_ACTION]).toEqual([600, "delete"]);
    expect(gatewayLimits(s)).toMatchObject({ idleTimeoutS: 600, idleAction: "delete" });
    expect(
      ok({ config: "/c" }, {}, { "/c": '{"SANDBOXD_IDLE_ACTION": "delete"}' }).SANDBOXD_IDLE_ACTION,
    ).toBe("delete");
    expect(refused({}, { SANDBOXD_IDLE_ACTION: "pause" })).toBe(
      'SANDBOXD_IDLE_ACTION (--idle-action) must be one of suspend, delete, got "pause" from the environment',
    );
    expect(refused({ "idle-timeout": "604801" })).toContain("SANDBOXD_IDLE_TIMEOUT (--idle-timeout)");
  });

  test("a config file with an unknown name, bad syntax or a missing path is refused by name", () => {
    expect(refused({ config: "/c" }, {}, { "/c": "SANDBOXD_SESION_CAP=3" })).toContain(
      "SANDBOXD_SESION_CAP is not a setting",
    );
    expect(refused({ config: "/c" }, {}, { "/c": "just words" })).toContain("line 1: expected KEY=VALUE");
    expect(refused({ config: "/c" }, {}, { "/c": "{ nope" })).toContain("not valid JSON");
    expect(refused({ config: "/c" }, {}, { "/c": '{"SANDBOXD_SESSION_CAP": true}' })).toContain(
      "SANDBOXD_SESSION_CAP must be a number",
    );
    expect(refused({ config: "/missing" })).toContain("config file /missing");
  });

  test("the gateway's limits and the agent's options carry the values", () => {
    const s: Settings = ok(
      { "fork-cap-pro": "3" },
      { SANDBOXD_QUOTA_ENTERPRISE: "7", SANDBOXD_RESTORE_TIMEOUT: "12" },
    );
    const l = gatewayLimits(s);
    expect(l.forkCapByTier?.pro).toBe(3);
    expect(l.forkCapByTier?.live).toBe(FORK_CAP_BY_TIER.live);
    expect(l.sandboxQuotaByTier?.enterprise).toBe(7);
    expect(agentSettings(s).timeouts.restoreMs).toBe(12_000);
  });
});

test("README.md's settings table, between its markers, is the one rendered from the declarations", () => {
  const readme = readFileSync(join(REPO_ROOT, "README.md"), "utf8");
  const section = /<!-- settings-table:[^\n]*-->\n([\s\S]*?)\n<!-- \/settings-table -->/.exec(readme);
  expect(section?.[1]).toBe(settingsTable());
});

describe("the settings read deep in the agent and at start", () => {
  test("byte budgets, the jail's uids and the accelerator are range-checked by name", () => {
    expect(refused({}, { SANDBOXD_DISK_RESERVE_BYTES: "1k" })).toContain(
      "SANDBOXD_DISK_RESERVE_BYTES (--disk-reserve-bytes) must be a whole number from 0",
    );
    expect(refused({}, { SANDBOXD_ACCEL: "hvf" })).toBe(
      'SANDBOXD_ACCEL (--accel) must be one of auto, kvm, tcg, got "hvf" from the environment',
    );
    expect(refused({ prelaunch: "99" })).toContain("SANDBOXD_PRELAUNCH (--prelaunch)");
    expect(refused({}, { SANDBOXD_EGRESS_DEFAULT: "open" })).toContain("deny, allow");
    // Empty stays "unset" where it always was.
    expect(ok({}, { SANDBOXD_IMAGE_CACHE_BYTES: "", SANDBOXD_ACCEL: "" })).toMatchObject({
      SANDBOXD_IMAGE_CACHE_BYTES: 20 * 1024 ** 3,
      SANDBOXD_ACCEL: "auto",
    });
  });

  test("lists and URLs are checked entry by entry; secrets have no flag", () => {
    expect(refused({}, { SANDBOXD_EGRESS_ALLOW_INTERNAL: "10.0.0.0/8,nope" })).toContain(
      "SANDBOXD_EGRESS_ALLOW_INTERNAL (--egress-allow-internal) must be cidr,...",
    );
    expect(refused({ "insecure-registries": "http://x" })).toContain("must be host[:port],...");
    expect(SETTINGS.find((s) => s.env === "SANDBOXD_KEY_PEPPER")?.flag).toBeUndefined();
  });

  test("the agent's registry and egress options, and the gateway's start options, carry the values", () => {
    const s = ok(
      { "egress-default": "allow" },
      { SANDBOXD_SHARED_REGISTRIES: "reg.example", DATABASE_URL: "postgres://x/y", SANDBOXD_KEY_PEPPER: "p" },
    );
    const a = agentSettings(s);
    expect([a.egressDefault, a.prelaunch, a.registry.SANDBOXD_SHARED_REGISTRIES]).toEqual([
      "allow",
      1,
      "reg.example",
    ]);
    expect(gatewayStart(s)).toEqual({
      databaseUrl: "postgres://x/y",
      secrets: { keyPepper: "p" },
      migrate: true,
    });
    const behindPooler = ok(
      { migrate: "off" },
      { DATABASE_URL: "postgres://pooler/y", SANDBOXD_DATABASE_LISTEN_URL: "postgres://direct/y" },
    );
    expect(gatewayStart(behindPooler)).toEqual({
      databaseUrl: "postgres://pooler/y",
      databaseListenUrl: "postgres://direct/y",
      secrets: {},
      migrate: false,
    });
  });
});

describe("the serving commands refuse an invalid setting with exit 2", () => {
  const env = { ...process.env, SANDBOXD_DATA_DIR: "/nonexistent/sandboxd-settings-test" };
  test.each([
    [["up"], { SANDBOXD_SESSION_IDLE_TTL: "soon" }, "SANDBOXD_SESSION_IDLE_TTL"],
    [["gateway", "--reaper-interval", "0"], {}, "SANDBOXD_REAPER_INTERVAL (--reaper-interval)"],
    [["agent", "--gateway", "http://127.0.0.1:1"], { SANDBOXD_BUILD_SLOTS: "0" }, "SANDBOXD_BUILD_SLOTS"],
  ] as const)("%p", async (args, extra, named) => {
    const r = await runCli([...args], { ...env, ...extra }, 60_000);
    expect(r.stderr).toContain(named);
    expect(r.code).toBe(2);
  });
});
