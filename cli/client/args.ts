/**
 * Argument parsing for the client commands (`sandboxd sbx ...`, `sandboxd template ...`). Each
 * command is one `CommandSpec`: its options, its positionals and its help text live together, so
 * `--help` cannot drift from what the parser accepts. A bad command line is a `UsageError` (exit 2
 * with a short message); nothing here talks to a server.
 */
import { parseArgs } from "node:util";

/** A command line the parser refuses: the caller prints the message and exits 2. */
export class UsageError extends Error {
  constructor(
    message: string,
    /** The command whose `--help` explains it, e.g. `sbx create`. */
    readonly command: string,
  ) {
    super(message);
    this.name = "UsageError";
  }
}

export interface OptionSpec {
  type: "string" | "boolean";
  short?: string;
  /** May be given more than once (each value kept, in order). */
  multiple?: boolean;
  /** The value's name in the help text, e.g. `ID` for `--template ID`. */
  arg?: string;
  help: string;
}

export interface CommandSpec {
  /** `sbx create`: the words after `sandboxd`. */
  name: string;
  /** What follows the name in the usage line, e.g. `--template ID [--label K=V]...`. */
  usage: string;
  summary: string;
  /** More lines of help (examples, what the output is). */
  details?: string;
  options: Record<string, OptionSpec>;
  /** The positionals' names, in order; a name ending in `...` takes the rest. */
  positionals: string[];
  /** How many positionals must be given (default: all that do not end in `...` or start with `[`). */
  minPositionals?: number;
  /**
   * The positional (0-based) from which everything is the command's own, options included, as
   * `sbx exec ID ls -la` runs `ls -la`. Without it, options may follow positionals.
   */
  restFrom?: number;
}

/** Options every client command takes: where the server is, and help. */
export const COMMON_OPTIONS: Record<string, OptionSpec> = {
  url: {
    type: "string",
    arg: "URL",
    help: "the server (default: $SANDBOXD_URL, else http://127.0.0.1:8080)",
  },
  "api-key": { type: "string", arg: "KEY", help: "the API key (default: $SANDBOXD_API_KEY)" },
  help: { type: "boolean", short: "h", help: "show this help" },
};

export interface Parsed {
  values: Record<string, string | boolean | string[] | undefined>;
  positionals: string[];
  /** The command's own words (`restFrom`), empty otherwise. */
  rest: string[];
  help: boolean;
}

/** Splits `args` where the command's own words start (`restFrom`), honouring `--`. */
function splitRest(spec: CommandSpec, args: string[]): { mine: string[]; rest: string[] } {
  if (spec.restFrom === undefined) return { mine: args, rest: [] };
  const all = { ...COMMON_OPTIONS, ...spec.options };
  const takesValue = (tok: string): boolean => {
    if (tok.startsWith("--")) return !tok.includes("=") && all[tok.slice(2)]?.type === "string";
    // -x VALUE: a short option of type string whose value is the next word.
    const opt = Object.values(all).find((o) => o.short === tok.slice(1, 2));
    return tok.length === 2 && opt?.type === "string";
  };
  let seen = 0;
  for (let i = 0; i < args.length; i++) {
    const tok = args[i]!;
    if (tok === "--") {
      // Positionals before the rest may still follow `--` (sbx exec -- ID cmd): the parser sees them.
      return { mine: args.slice(0, i), rest: args.slice(i + 1) };
    }
    if (tok.startsWith("-") && tok !== "-") {
      if (takesValue(tok)) i++;
      continue;
    }
    if (seen === spec.restFrom) return { mine: args.slice(0, i), rest: args.slice(i) };
    seen++;
  }
  return { mine: args, rest: [] };
}

/** Parses `args` (the words after the command's name) by `spec`; throws `UsageError`. */
export function parseCommand(spec: CommandSpec, args: string[]): Parsed {
  const { mine, rest } = splitRest(spec, args);
  const options: Record<string, { type: "string" | "boolean"; short?: string; multiple?: boolean }> = {};
  for (const [name, o] of Object.entries({ ...COMMON_OPTIONS, ...spec.options })) {
    options[name] = { type: o.type, ...(o.short ? { short: o.short } : {}), multiple: o.multiple ?? false };
  }
  let parsed: ReturnType<typeof parseArgs>;
  try {
    parsed = parseArgs({ args: mine, options, allowPositionals: true, strict: true });
  } catch (err) {
    // node's messages are long and name the API ("To specify a positional argument..."): keep the first sentence.
    const msg = err instanceof Error ? err.message.split(". ")[0]!.replace(/\.$/, "") : String(err);
    throw new UsageError(msg.replace(/^Unknown option/, "unknown option"), spec.name);
  }
  const values = parsed.values as Parsed["values"];
  const help = values.help === true;
  const positionals = parsed.positionals;
  // `sbx exec -- ID CMD`: the positionals before the rest came after `--`.
  while (spec.restFrom !== undefined && positionals.length < spec.restFrom && rest.length > 0) {
    positionals.push(rest.shift()!);
  }
  if (!help) {
    const fixed = spec.positionals.filter((p) => !p.endsWith("...") && !p.startsWith("["));
    const min = spec.minPositionals ?? fixed.length;
    const takesRest = spec.positionals.some((p) => p.endsWith("..."));
    if (positionals.length + (spec.restFrom !== undefined && rest.length > 0 ? 1 : 0) < min) {
      const missing = spec.positionals[positionals.length] ?? spec.positionals.at(-1) ?? "argument";
      throw new UsageError(`missing ${missing.replace(/[[\]]|\.\.\./g, "")}`, spec.name);
    }
    if (!takesRest && spec.restFrom === undefined && positionals.length > spec.positionals.length) {
      throw new UsageError(`unexpected argument ${positionals[spec.positionals.length]}`, spec.name);
    }
  }
  return { values, positionals, rest, help };
}

/** A string option's value, or undefined. */
export function str(p: Parsed, name: string): string | undefined {
  const v = p.values[name];
  return typeof v === "string" ? v : undefined;
}

/** A repeated string option's values (none: empty). */
export function list(p: Parsed, name: string): string[] {
  const v = p.values[name];
  return Array.isArray(v) ? v : typeof v === "string" ? [v] : [];
}

export function flag(p: Parsed, name: string): boolean {
  return p.values[name] === true;
}

/** An integer option within [min, max], or undefined when absent. */
export function intOpt(
  p: Parsed,
  spec: CommandSpec,
  name: string,
  min: number,
  max: number,
): number | undefined {
  const v = str(p, name);
  if (v === undefined) return undefined;
  const n = Number(v);
  if (!/^\d+$/.test(v) || !Number.isSafeInteger(n) || n < min || n > max) {
    throw new UsageError(`--${name} must be an integer from ${min} to ${max}, got ${v}`, spec.name);
  }
  return n;
}

/** `K=V` pairs (labels, env) into a record; a word without `=` is a usage error. */
export function pairs(p: Parsed, spec: CommandSpec, name: string): Record<string, string> | undefined {
  const words = list(p, name);
  if (words.length === 0) return undefined;
  const out: Record<string, string> = {};
  for (const w of words) {
    const eq = w.indexOf("=");
    if (eq <= 0) throw new UsageError(`--${name} takes KEY=VALUE, got ${w}`, spec.name);
    out[w.slice(0, eq)] = w.slice(eq + 1);
  }
  return out;
}

/** The help text of one command, from its spec. */
export function helpText(spec: CommandSpec): string {
  const lines = [`usage: sandboxd ${spec.name} ${spec.usage}`.trimEnd(), "", spec.summary];
  if (spec.details) lines.push("", spec.details);
  const opts = Object.entries({ ...spec.options, ...COMMON_OPTIONS });
  lines.push("", "options:");
  const heads = opts.map(([name, o]) => {
    const short = o.short ? `-${o.short}, ` : "";
    return `  ${short}--${name}${o.type === "string" ? ` ${o.arg ?? "VALUE"}` : ""}`;
  });
  const width = Math.max(...heads.map((h) => h.length)) + 2;
  opts.forEach(([, o], i) => {
    lines.push(`${heads[i]!.padEnd(width)}${o.help}${o.multiple ? " (repeatable)" : ""}`);
  });
  return lines.join("\n");
}
