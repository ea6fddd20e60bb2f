/**
 * Reading the settings of the table (table.ts): flag, then environment, then `--config FILE`,
 * then the default. A value out of range is refused with a message that names the setting, its
 * range and where the value came from; the serving commands then exit 2 before opening anything.
 */
import { readFileSync } from "node:fs";
import { z } from "zod";
import { SETTINGS, type SettingSpec } from "./table.ts";

/** Setting values by environment name, e.g. `SANDBOXD_SESSION_IDLE_TTL`: numbers, or text. */
export type Settings = Readonly<Record<string, number | string>>;

export type SettingsResult = { ok: true; settings: Settings } | { ok: false; error: string };

/** The flags every serving command accepts: one per setting that has one, and `--config FILE`. */
export function settingFlags(): Record<string, { type: "string" }> {
  const out: Record<string, { type: "string" }> = { config: { type: "string" } };
  for (const s of SETTINGS) if (s.flag) out[s.flag] = { type: "string" };
  return out;
}

/** A whole number, written as digits only (no sign, exponent, fraction or spaces). */
const WholeNumber = z
  .union([z.string(), z.number()])
  .transform((v) => String(v).trim())
  .pipe(z.string().regex(/^\d+$/))
  .transform(Number);

/** How a refusal names the setting: its variable, and its flag where it has one. */
export function settingName(spec: SettingSpec): string {
  return spec.flag ? `${spec.env} (--${spec.flag})` : spec.env;
}

/** The value, or (a `{error}`) the refusal that names the setting. */
function parseValue(
  spec: SettingSpec,
  raw: string | number,
  from: string,
): number | string | { error: string } {
  const got = `got ${JSON.stringify(raw)} from ${from}`;
  if (spec.unit === "text") {
    const text = String(raw).trim();
    const wrong = text === "" ? undefined : spec.check?.(text);
    if (wrong === undefined) return text;
    return { error: `${settingName(spec)} must be ${spec.rangeText} (${wrong}), ${got}` };
  }
  if (spec.unit === "choice") {
    const word = String(raw).trim();
    if (spec.choices.includes(word)) return word;
    return { error: `${settingName(spec)} must be one of ${spec.choices.join(", ")}, ${got}` };
  }
  const n = WholeNumber.safeParse(raw);
  if (n.success && n.data >= spec.min && n.data <= spec.max) return n.data;
  const unit = spec.unit === "count" ? "" : ` (${spec.unit})`;
  return {
    error: `${settingName(spec)} must be a whole number from ${spec.min} to ${spec.max}${unit}, ${got}`,
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

/** The raw value in force and where it came from, or undefined for the default. */
function rawValue(
  spec: SettingSpec,
  flags: Readonly<Record<string, unknown>>,
  env: Readonly<Record<string, string | undefined>>,
  file: Record<string, string | number>,
  path: unknown,
): readonly [string | number, string] | undefined {
  const flag = spec.flag ? flags[spec.flag] : undefined;
  if (typeof flag === "string") return [flag, `--${spec.flag}`];
  const fromEnv = env[spec.env];
  const unsetWhenEmpty = spec.unit === "text" || spec.emptyIsUnset;
  if (fromEnv !== undefined && !(unsetWhenEmpty && fromEnv.trim() === ""))
    return [fromEnv, "the environment"];
  if (file[spec.env] !== undefined) return [file[spec.env]!, `config file ${path}`];
  return undefined;
}

/**
 * The settings in force from `flags` (parseArgs values: the setting flags and `config`), `env`
 * and the config file `flags.config` names. Every setting is read and checked whichever command
 * runs, so one file or environment serves `up`, `gateway` and `agent` alike.
 */
export function readSettings(
  flags: Readonly<Record<string, unknown>>,
  env: Readonly<Record<string, string | undefined>>,
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
    const raw = rawValue(spec, flags, env, file, path);
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
