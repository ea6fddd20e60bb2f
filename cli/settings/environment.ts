/**
 * The process's environment, read here and nowhere else in product code: the serving commands
 * parse it with the settings (parse.ts), the other commands ask for the one or two values they
 * use, and child processes get a copy with their own changes.
 */
import { homedir } from "node:os";
import { join, resolve } from "node:path";

/** The environment variables as this process started with them (read-only for callers). */
export function processEnv(): NodeJS.ProcessEnv {
  return process.env;
}

/**
 * The environment a child process starts with: ours, with `set` added and the names in `unset`
 * removed. Not a setting read: the child reads its own.
 */
export function childEnv(set: Record<string, string> = {}, unset: readonly string[] = []): NodeJS.ProcessEnv {
  const env: NodeJS.ProcessEnv = { ...process.env, ...set };
  for (const name of unset) delete env[name];
  return env;
}

/** Where sandboxd keeps images, guest artifacts, VM directories and its database (SANDBOXD_DATA_DIR). */
export function defaultDataDir(env: Readonly<Record<string, string | undefined>> = process.env): string {
  if (env.SANDBOXD_DATA_DIR) return resolve(env.SANDBOXD_DATA_DIR);
  if (process.getuid?.() === 0) return "/var/lib/sandboxd";
  return join(env.XDG_DATA_HOME ?? join(homedir(), ".local", "share"), "sandboxd");
}

/** SANDBOXD_QUIET=1: the CLI's log lines are not written (read for every command, not only serving ones). */
export function quiet(): boolean {
  return process.env.SANDBOXD_QUIET === "1";
}

/** SANDBOXD_LOG_FORMAT=json: the CLI's log lines as JSON objects (contracts/log.ts); else text. */
export function logFormat(): "text" | "json" {
  return process.env.SANDBOXD_LOG_FORMAT === "json" ? "json" : "text";
}

/** DATABASE_URL for the operator commands that open the gateway's database themselves. */
export function databaseUrl(): string | undefined {
  return process.env.DATABASE_URL || undefined;
}
