import { homedir } from "node:os";
import { join, resolve } from "node:path";
import { SandboxdError } from "../contracts/errors.ts";

/** Where sandboxd keeps images, guest artifacts, VM directories and (later) its database. */
export function defaultDataDir(env: NodeJS.ProcessEnv = process.env): string {
  if (env.SANDBOXD_DATA_DIR) return resolve(env.SANDBOXD_DATA_DIR);
  if (process.getuid?.() === 0) return "/var/lib/sandboxd";
  return join(env.XDG_DATA_HOME ?? join(homedir(), ".local", "share"), "sandboxd");
}

export const REPO_ROOT = resolve(import.meta.dir, "..");

/**
 * The public URL connect URLs are minted on: `--public-url`, else `SANDBOXD_PUBLIC_URL`, else
 * none (the gateway then follows each request's scheme and host). Checked at start: a typo
 * would otherwise surface only as connect URLs that lead nowhere.
 */
export function publicUrlOption(
  flag: string | undefined,
  env: NodeJS.ProcessEnv = process.env,
): { publicBaseUrl?: string } {
  const raw = flag ?? (env.SANDBOXD_PUBLIC_URL || undefined);
  if (raw === undefined) return {};
  let u: URL;
  try {
    u = new URL(raw);
  } catch {
    throw new SandboxdError("bad_request", `--public-url / SANDBOXD_PUBLIC_URL is not a URL: ${raw}`);
  }
  if (!["http:", "https:", "ws:", "wss:"].includes(u.protocol)) {
    throw new SandboxdError("bad_request", `--public-url must be http(s):// or ws(s)://, got ${raw}`);
  }
  return { publicBaseUrl: u.origin };
}
