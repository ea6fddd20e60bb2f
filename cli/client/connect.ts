/**
 * The SDK client a command talks through: the server from --url, else $SANDBOXD_URL, else the
 * address `sandboxd up` listens on by default; the key from --api-key, else $SANDBOXD_API_KEY.
 * A missing key or a URL that is not http(s) is a usage error (exit 2): nothing was sent.
 */
import { Sandboxd } from "../../sdk/typescript/src/index.ts";
import { type CommandSpec, type Parsed, str, UsageError } from "./args.ts";
import type { Ctx } from "./context.ts";

/** Where `sandboxd up` listens without --port/--host. */
export const DEFAULT_URL = "http://127.0.0.1:8080";

export function serverOf(p: Parsed, spec: CommandSpec, ctx: Ctx): { baseUrl: string; apiKey: string } {
  const baseUrl = str(p, "url") ?? ctx.env.SANDBOXD_URL ?? DEFAULT_URL;
  if (!/^https?:\/\/[^/]/.test(baseUrl)) {
    throw new UsageError(`the server URL must be http:// or https://, got ${baseUrl}`, spec.name);
  }
  const apiKey = str(p, "api-key") ?? ctx.env.SANDBOXD_API_KEY;
  if (!apiKey) throw new UsageError("no API key: set SANDBOXD_API_KEY or pass --api-key", spec.name);
  return { baseUrl, apiKey };
}

export function clientOf(p: Parsed, spec: CommandSpec, ctx: Ctx): Sandboxd {
  return new Sandboxd(serverOf(p, spec, ctx));
}
