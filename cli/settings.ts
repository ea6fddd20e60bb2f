/**
 * The operator settings of `up`, `gateway` and `agent`, parsed in this one place: each is a
 * command-line flag and an environment variable (and may come from a `--config FILE`), with a
 * documented default. Precedence: flag, then environment, then file, then the default. A value
 * out of range is refused at start with a message that names the setting (the commands exit 2).
 *
 * Every default is the code's own constant (contracts/api/limits.ts for the gateway's, the
 * agent's engine and manager for its own), so an unset setting changes nothing.
 * The table in README.md ("Operator settings") lists the same names, defaults and ranges; a
 * unit test checks the two agree.
 */
import { readFileSync } from "node:fs";
import { z } from "zod";
import { DEFAULT_IDLE_PAUSE_MS } from "../agent/sandbox/manager.ts";
import { MAX_CONCURRENT_BUILDS } from "../agent/sandbox/templates.ts";
import {
  DEFAULT_FORK_METHOD,
  FORK_METHODS,
  type ForkMethod,
  isForkMethod,
} from "../agent/snapshot/fork-method.ts";
import { DEFAULT_BRINGUP_TIMEOUT_MS, DEFAULT_READY_TIMEOUT_MS } from "../agent/snapshot/template.ts";
import { RESTORE_READY_TIMEOUT_MS } from "../agent/snapshot/vm.ts";
import {
  DEFAULT_LIMITS,
  FORK_CAP_BY_TIER,
  IDLE_ACTIONS,
  type Limits,
  MAX_IDLE_TIMEOUT_S,
  REAPER_INTERVAL_S,
  SANDBOX_QUOTA_BY_TIER,
  SESSION_CAP_PER_TENANT,
  SESSION_IDLE_TTL_S,
} from "../contracts/api/limits.ts";

/** Where a setting is used: the gateway's limits or the host agent's engine. */
type Scope = "gateway" | "agent";

interface SettingBase {
  /** The environment variable and the name in a config file. */
  env: string;
  /** The command-line flag, without `--`. */
  flag: string;
  scope: Scope;
  doc: string;
}

interface NumberSetting extends SettingBase {
  def: number;
  min: number;
  max: number;
  unit: "seconds" | "milliseconds" | "count";
}

/** A setting that names one of a few words (an action), not a number. */
interface ChoiceSetting extends SettingBase {
  def: string;
  choices: readonly string[];
  unit: "choice";
}

type SettingSpec = NumberSetting | ChoiceSetting;

/** One day: no deadline or interval of ours is meant to be longer; a larger value is a typo. */
const DAY_S = 24 * 3600;
/** The most of anything countable a setting may ask for: far above one host or tenant's scale. */
const MAX_COUNT = 1_000_000;
/** The sandboxes API tiers, whose sandbox quotas and fork caps are settings (sessions API has neither). */
const B_TIERS = ["demo", "pro", "enterprise"] as const;

export const SETTINGS: readonly SettingSpec[] = [
  {
    env: "SANDBOXD_SESSION_IDLE_TTL",
    flag: "session-idle-ttl",
    scope: "gateway",
    def: SESSION_IDLE_TTL_S,
    min: 1,
    max: 7 * DAY_S,
    unit: "seconds",
    doc: "a session with no exec for this long is reclaimed; later calls get 410 gone",
  },
  {
    env: "SANDBOXD_REAPER_INTERVAL",
    flag: "reaper-interval",
    scope: "gateway",
    def: REAPER_INTERVAL_S,
    min: 1,
    max: DAY_S,
    unit: "seconds",
    doc: "how often each gateway looks for idle sessions and sandboxes (the most a reclaim or idle suspend runs late)",
  },
  {
    env: "SANDBOXD_IDLE_TIMEOUT",
    flag: "idle-timeout",
    scope: "gateway",
    def: DEFAULT_LIMITS.idleTimeoutS,
    min: 0,
    // The same week as a sandbox's own idle_timeout_seconds may ask for.
    max: MAX_IDLE_TIMEOUT_S,
    unit: "seconds",
    doc: "the idle lifetime of sandboxes created without idle_timeout_seconds; 0: none (they run until deleted)",
  },
  {
    env: "SANDBOXD_IDLE_ACTION",
    flag: "idle-action",
    scope: "gateway",
    def: DEFAULT_LIMITS.idleAction,
    choices: IDLE_ACTIONS,
    unit: "choice",
    doc: "what SANDBOXD_IDLE_TIMEOUT does to an idle sandbox (one created without idle_action): suspend it (its next call resumes it) or delete it",
  },
  {
    env: "SANDBOXD_SESSION_CAP",
    flag: "session-cap",
    scope: "gateway",
    def: SESSION_CAP_PER_TENANT,
    min: 1,
    max: MAX_COUNT,
    unit: "count",
    doc: "live sessions per tenant; a create beyond it is 429",
  },
  ...B_TIERS.map(
    (tier): SettingSpec => ({
      env: `SANDBOXD_QUOTA_${tier.toUpperCase()}`,
      flag: `quota-${tier}`,
      scope: "gateway",
      def: SANDBOX_QUOTA_BY_TIER[tier],
      min: 0,
      max: MAX_COUNT,
      unit: "count",
      doc: `running sandboxes per ${tier} tenant; beyond it 429 quota_exceeded`,
    }),
  ),
  ...B_TIERS.map(
    (tier): SettingSpec => ({
      env: `SANDBOXD_FORK_CAP_${tier.toUpperCase()}`,
      flag: `fork-cap-${tier}`,
      scope: "gateway",
      def: FORK_CAP_BY_TIER[tier],
      min: 1,
      // A fork's children share the parent's host: more than 1024 in one call is no fan-out one
      // host can restore.
      max: 1024,
      unit: "count",
      doc: `children one fork call may ask for, ${tier} keys`,
    }),
  ),
  {
    env: "SANDBOXD_BOOT_TIMEOUT",
    flag: "boot-timeout",
    scope: "agent",
    def: DEFAULT_BRINGUP_TIMEOUT_MS / 1000,
    min: 1,
    max: DAY_S,
    unit: "seconds",
    doc: "a template build's cold boot, QEMU start to the guest agent's first answer",
  },
  {
    env: "SANDBOXD_READY_TIMEOUT",
    flag: "ready-timeout",
    scope: "agent",
    def: DEFAULT_READY_TIMEOUT_MS / 1000,
    min: 1,
    max: DAY_S,
    unit: "seconds",
    doc: "a template's ready command when the template names no timeout",
  },
  {
    env: "SANDBOXD_RESTORE_TIMEOUT",
    flag: "restore-timeout",
    scope: "agent",
    def: RESTORE_READY_TIMEOUT_MS / 1000,
    min: 1,
    max: DAY_S,
    unit: "seconds",
    doc: "a restore (create from a template, fork child, resume) to the guest's first answer",
  },
  {
    env: "SANDBOXD_BUILD_SLOTS",
    flag: "build-slots",
    scope: "agent",
    def: MAX_CONCURRENT_BUILDS,
    min: 1,
    // Each build boots a VM and runs the image tools: 64 at once is beyond any host we know.
    max: 64,
    unit: "count",
    doc: "template builds that run at once on one agent; later ones wait (Pending)",
  },
  {
    env: "SANDBOXD_IDLE_PAUSE_MS",
    flag: "idle-pause-ms",
    scope: "agent",
    def: DEFAULT_IDLE_PAUSE_MS,
    // Below 10 ms a VM would be stopped between the requests of one burst.
    min: 10,
    max: DAY_S * 1000,
    unit: "milliseconds",
    doc: "an idle VM's vCPUs are stopped after this long (restarted by the next call)",
  },
  {
    env: "SANDBOXD_FORK_METHOD",
    flag: "fork-method",
    scope: "agent",
    def: DEFAULT_FORK_METHOD,
    choices: FORK_METHODS,
    unit: "choice",
    doc: "how a fork copies its running parent's memory: snapshot (QEMU background snapshot, the parent stops ~10-50 ms; the agent sets vm.unprivileged_userfaultfd=1, else falls back to stop-copy), stop-copy (the parent stops for the whole copy), precopy (live precopy; not for TCG hosts)",
  },
];

/** Setting values by environment name, e.g. `SANDBOXD_SESSION_IDLE_TTL`: numbers, or a choice's word. */
export type Settings = Readonly<Record<string, number | string>>;

export type SettingsResult = { ok: true; settings: Settings } | { ok: false; error: string };

/** The flags every serving command accepts: one per setting, and `--config FILE`. */
export function settingFlags(): Record<string, { type: "string" }> {
  const out: Record<string, { type: "string" }> = { config: { type: "string" } };
  for (const s of SETTINGS) out[s.flag] = { type: "string" };
  return out;
}

/** A whole number, written as digits only (no sign, exponent, fraction or spaces). */
const WholeNumber = z
  .union([z.string(), z.number()])
  .transform((v) => String(v).trim())
  .pipe(z.string().regex(/^\d+$/))
  .transform(Number);

/** The value, or (a `{error}`) the refusal that names the setting. */
function parseValue(
  spec: SettingSpec,
  raw: string | number,
  from: string,
): number | string | { error: string } {
  if (spec.unit === "choice") {
    const word = String(raw).trim();
    if (spec.choices.includes(word)) return word;
    return {
      error: `${spec.env} (--${spec.flag}) must be one of ${spec.choices.join(", ")}, got ${JSON.stringify(raw)} from ${from}`,
    };
  }
  const n = WholeNumber.safeParse(raw);
  if (n.success && n.data >= spec.min && n.data <= spec.max) return n.data;
  const unit = spec.unit === "count" ? "" : ` (${spec.unit})`;
  return {
    error:
      `${spec.env} (--${spec.flag}) must be a whole number from ${spec.min} to ${spec.max}${unit}, ` +
      `got ${JSON.stringify(raw)} from ${from}`,
  };
}

/**
 * A config file: a JSON object, or `KEY=VALUE` lines (blank lines and `#` comments allowed),
 * with the environment names. A name that is not a setting is refused (a typo would otherwise
 * leave the default silently in force).
 */
export function parseConfigFile(text: string, path: string): Record<string, string | number> | string {
  const known = new Set(SETTINGS.map((s) => s.env));
  let entries: [string, unknown][];
  if (text.trimStart().startsWith("{")) {
    let obj: unknown;
    try {
      obj = JSON.parse(text);
    } catch (err) {
      return `config file ${path}: not valid JSON: ${err instanceof Error ? err.message : String(err)}`;
    }
    if (typeof obj !== "object" || obj === null || Array.isArray(obj))
      return `config file ${path}: must be a JSON object of settings`;
    entries = Object.entries(obj);
  } else {
    entries = [];
    const lines = text.split("\n");
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i]!.trim();
      if (line === "" || line.startsWith("#")) continue;
      const eq = line.indexOf("=");
      if (eq < 1)
        return `config file ${path}, line ${i + 1}: expected KEY=VALUE, got ${JSON.stringify(line)}`;
      entries.push([line.slice(0, eq).trim(), line.slice(eq + 1).trim()]);
    }
  }
  const out: Record<string, string | number> = {};
  for (const [k, v] of entries) {
    if (!known.has(k)) return `config file ${path}: ${k} is not a setting (known: ${[...known].join(", ")})`;
    if (typeof v !== "string" && typeof v !== "number")
      return `config file ${path}: ${k} must be a number, got ${JSON.stringify(v)}`;
    out[k] = v;
  }
  return out;
}

/**
 * The settings in force from `flags` (parseArgs values: the setting flags and `config`), `env`
 * and the config file `flags.config` names. Every setting is read and checked whichever command
 * runs, so one file or environment serves `up`, `gateway` and `agent` alike.
 */
export function readSettings(
  flags: Readonly<Record<string, unknown>>,
  env: NodeJS.ProcessEnv,
  readFile: (path: string) => string = (p) => readFileSync(p, "utf8"),
): SettingsResult {
  let file: Record<string, string | number> = {};
  const path = flags.config;
  if (typeof path === "string") {
    let text: string;
    try {
      text = readFile(path);
    } catch (err) {
      return { ok: false, error: `config file ${path}: ${err instanceof Error ? err.message : String(err)}` };
    }
    const parsed = parseConfigFile(text, path);
    if (typeof parsed === "string") return { ok: false, error: parsed };
    file = parsed;
  }
  const out: Record<string, number | string> = {};
  for (const spec of SETTINGS) {
    const flag = flags[spec.flag];
    const raw =
      typeof flag === "string"
        ? ([flag, `--${spec.flag}`] as const)
        : env[spec.env] !== undefined
          ? ([env[spec.env]!, "the environment"] as const)
          : file[spec.env] !== undefined
            ? ([file[spec.env]!, `config file ${path}`] as const)
            : undefined;
    if (raw === undefined) {
      out[spec.env] = spec.def;
      continue;
    }
    const v = parseValue(spec, raw[0], raw[1]);
    if (typeof v === "object") return { ok: false, error: v.error };
    out[spec.env] = v;
  }
  return { ok: true, settings: out };
}

/** The settings of one scope, for health to show what is in force in that process. */
export function settingsOf(settings: Settings, scope: Scope): Record<string, number | string> {
  return Object.fromEntries(SETTINGS.filter((s) => s.scope === scope).map((s) => [s.env, settings[s.env]!]));
}

/** The gateway's limits the settings override (gateway/config.ts merges them over the defaults). */
export function gatewayLimits(s: Settings): Partial<Limits> {
  const n = (env: string) => Number(s[env]);
  const byTier = (prefix: string) =>
    Object.fromEntries(B_TIERS.map((t) => [t, n(`${prefix}_${t.toUpperCase()}`)]));
  const action = IDLE_ACTIONS.find((a) => a === s.SANDBOXD_IDLE_ACTION) ?? DEFAULT_LIMITS.idleAction;
  return {
    sessionIdleTtlS: n("SANDBOXD_SESSION_IDLE_TTL"),
    reaperIntervalS: n("SANDBOXD_REAPER_INTERVAL"),
    idleTimeoutS: n("SANDBOXD_IDLE_TIMEOUT"),
    idleAction: action,
    sessionCapPerTenant: n("SANDBOXD_SESSION_CAP"),
    sandboxQuotaByTier: { ...SANDBOX_QUOTA_BY_TIER, ...byTier("SANDBOXD_QUOTA") },
    forkCapByTier: { ...FORK_CAP_BY_TIER, ...byTier("SANDBOXD_FORK_CAP") },
  };
}

/** The agent's options the settings set (agent/sandbox/manager.ts, drivers/snapshot.ts). */
export interface AgentSettings {
  idlePauseMs: number;
  buildSlots: number;
  forkMethod: ForkMethod;
  timeouts: { bootMs: number; readyMs: number; restoreMs: number };
}

export function agentSettings(s: Settings): AgentSettings {
  const n = (env: string) => Number(s[env]);
  return {
    idlePauseMs: n("SANDBOXD_IDLE_PAUSE_MS"),
    buildSlots: n("SANDBOXD_BUILD_SLOTS"),
    forkMethod: isForkMethod(s.SANDBOXD_FORK_METHOD) ? s.SANDBOXD_FORK_METHOD : DEFAULT_FORK_METHOD,
    timeouts: {
      bootMs: n("SANDBOXD_BOOT_TIMEOUT") * 1000,
      readyMs: n("SANDBOXD_READY_TIMEOUT") * 1000,
      restoreMs: n("SANDBOXD_RESTORE_TIMEOUT") * 1000,
    },
  };
}

/** The README's table of the settings (a test checks README.md carries it as written here). */
export function settingsTable(): string {
  const rows = SETTINGS.map((s) => {
    if (s.unit === "choice") {
      return `| \`${s.env}\` | \`--${s.flag}\` | ${s.scope} | ${s.def} | ${s.choices.join(", ")} | ${s.doc} |`;
    }
    const unit = s.unit === "count" ? "" : ` ${s.unit === "seconds" ? "s" : "ms"}`;
    return `| \`${s.env}\` | \`--${s.flag}\` | ${s.scope} | ${s.def}${unit} | ${s.min}-${s.max} | ${s.doc} |`;
  });
  return [
    "| environment | flag | used by | default | range | what |",
    "|---|---|---|---|---|---|",
    ...rows,
  ].join("\n");
}

/**
 * `readSettings` for a serving command: the settings, or null after writing the refusal to
 * stderr (the command then exits 2, a usage error, before it opens anything).
 */
export function settingsOrRefuse(
  flags: Readonly<Record<string, unknown>>,
  env: NodeJS.ProcessEnv = process.env,
): Settings | null {
  const r = readSettings(flags, env);
  if (r.ok) return r.settings;
  process.stderr.write(`sandboxd: error: ${r.error}\n`);
  return null;
}
