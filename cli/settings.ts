/**
 * The operator settings, declared, parsed and range-checked in one place (cli/settings/): each
 * is an environment variable and a `--config FILE` key of the same name, most also a flag, with
 * a documented default. Precedence: flag, then environment, then file, then the default. A value
 * out of range is refused at start with a message that names the setting and its range (the
 * serving commands exit 2). The code that uses a setting receives it as an option (views.ts);
 * only cli/settings/environment.ts reads the process environment.
 *
 * The table in README.md ("Operator settings") is rendered from the same declarations; a unit
 * test checks the two agree.
 */

import type { VmHostSettings } from "../agent/vm/host-settings.ts";
import type { OperatorSecrets } from "../gateway/auth/secrets.ts";
import { processEnv } from "./settings/environment.ts";
import { readSettings, type Settings } from "./settings/parse.ts";
import { hostSettings, secretsFrom } from "./settings/views.ts";

export {
  childEnv,
  databaseUrl,
  defaultDataDir,
  logFormat,
  processEnv,
  quiet,
} from "./settings/environment.ts";
export {
  parseConfigFile,
  readSettings,
  type Settings,
  type SettingsResult,
  settingFlags,
} from "./settings/parse.ts";
export { settingsTable } from "./settings/readme.ts";
export { type Scope, SETTINGS, type SettingSpec } from "./settings/table.ts";
export {
  type AgentSettings,
  agentSettings,
  dataDirOf,
  drainOptions,
  firstStartEnrollToken,
  type GatewayStart,
  gatewayLimits,
  gatewayStart,
  hostSettings,
  metricsToken,
  otlpEndpoint,
  reportedSettings,
  secretsFrom,
  settingsOf,
} from "./settings/views.ts";

/**
 * `readSettings` for a serving command: the settings, or null after writing the refusal to
 * stderr (the command then exits 2, a usage error, before it opens anything).
 */
/** The secrets the operator set, for the commands that read no other setting (key, agent-token). */
export function operatorSecrets(): OperatorSecrets {
  return secretsFrom(processEnv());
}

export function settingsOrRefuse(
  flags: Readonly<Record<string, unknown>>,
  env: Readonly<Record<string, string | undefined>> = processEnv(),
): Settings | null {
  const r = readSettings(flags, env);
  if (r.ok) return r.settings;
  process.stderr.write(`sandboxd: error: ${r.error}\n`);
  return null;
}

/** What a command that launches VMs itself obeys: SANDBOXD_ACCEL, the jail and the disk reserve. */
export interface MachineSettings {
  /** auto (probe), kvm or tcg. */
  accel: string;
  host: VmHostSettings;
}

/**
 * The machine settings of `run`, `bench` and `doctor`, from the environment (and their
 * defaults); null after writing the refusal of a malformed setting to stderr (exit 2).
 */
export function machineSettingsOrRefuse(): MachineSettings | null {
  const s = settingsOrRefuse({});
  return s ? { accel: String(s.SANDBOXD_ACCEL), host: hostSettings(s) } : null;
}
