import { homedir } from "node:os";
import { join, resolve } from "node:path";

/** Where sandboxd keeps images, guest artifacts, VM directories and (later) its database. */
export function defaultDataDir(env: NodeJS.ProcessEnv = process.env): string {
  if (env.SANDBOXD_DATA_DIR) return resolve(env.SANDBOXD_DATA_DIR);
  if (process.getuid?.() === 0) return "/var/lib/sandboxd";
  return join(env.XDG_DATA_HOME ?? join(homedir(), ".local", "share"), "sandboxd");
}

export const REPO_ROOT = resolve(import.meta.dir, "..");
