/**
 * skopeo run for a pull (pull.ts) with a deadline and the caller's abort signal, and its failures
 * as tenant-safe pull errors: a stable `details.reason` and a short text that never quotes skopeo,
 * whose words stay in the ToolError kept as `cause` for the agent's log.
 *
 * With a pull proxy (pull-proxy.ts), skopeo runs in a network namespace of its own
 * (`unshare --net`): `lo` is its only interface, so it has no route to any address; the one way
 * out is the proxy's unix socket, reached through pull-forwarder.ts (run by the agent's own Bun).
 */
import { fileURLToPath } from "node:url";
import { asNoSpace, isNoSpace } from "../../contracts/disk-space.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { runTool, ToolError } from "../host/tool.ts";

/** A failed pull as the tenant sees it: `image_pull_failed`, a stable `details.reason`, a short text. */
export function pullError(what: string, reason: string, text: string, cause?: unknown): SandboxdError {
  return new SandboxdError("image_pull_failed", `${what} failed: ${text}`, {
    ...(cause === undefined ? {} : { cause }),
    details: { reason },
  });
}

/** The forwarder script, run by the agent's own Bun inside the namespace. */
export const FORWARDER = fileURLToPath(new URL("./pull-forwarder.ts", import.meta.url));
/**
 * The port the forwarder listens on for HTTP(S)_PROXY, on the namespace's own 127.0.0.1: the
 * namespace is new, so it is free; a loopback registry tunnelled on the same port moves it by one.
 */
export const NAMESPACE_PROXY_PORT = 3128;

/** Where skopeo's connections go: the proxy's unix socket, and a loopback registry to tunnel. */
export interface PullRoute {
  socket: string;
  /** `host:port` of a loopback registry (Go never proxies loopback), e.g. `127.0.0.1:5000`. */
  tunnels: string[];
}

/**
 * argv and environment that run `command` in a fresh network namespace whose only way out is
 * `route.socket`: `lo` up, the forwarder relaying to the proxy, the proxy variables set.
 */
export function inPullNamespace(
  command: string[],
  route: PullRoute,
): { argv: string[]; env: Record<string, string> } {
  const port = route.tunnels.some((t) => t.endsWith(`:${NAMESPACE_PROXY_PORT}`))
    ? NAMESPACE_PROXY_PORT + 1
    : NAMESPACE_PROXY_PORT;
  const url = `http://127.0.0.1:${port}`;
  return {
    argv: [
      "unshare",
      "--net",
      "--",
      "/bin/sh",
      "-c",
      // `lo` comes up first: a new namespace's loopback is down and nothing could listen on it.
      'ip link set lo up && exec "$@"',
      "sh",
      process.execPath,
      FORWARDER,
      route.socket,
      String(port),
      ...route.tunnels,
      "--",
      ...command,
    ],
    env: { HTTP_PROXY: url, HTTPS_PROXY: url, http_proxy: url, https_proxy: url, NO_PROXY: "", no_proxy: "" },
  };
}

/** Runs skopeo with a deadline and the caller's abort signal; a failure says a tenant-safe reason. */
export async function runSkopeo(
  args: string[],
  o: { signal?: AbortSignal; timeoutMs: number; what: string; tmp?: string; route?: PullRoute },
  log: (m: string) => void,
): Promise<Buffer> {
  const ns = o.route ? inPullNamespace(["skopeo", ...args], o.route) : undefined;
  try {
    const { stdout } = await runTool(ns?.argv ?? ["skopeo", ...args], {
      timeoutMs: o.timeoutMs,
      signal: o.signal,
      // skopeo stages blobs in TMPDIR (/var/tmp otherwise): keep them in the work dir we remove.
      env: { ...(o.tmp ? { TMPDIR: o.tmp } : {}), ...ns?.env },
      log: (line) => log(`image: ${line}`),
    });
    return stdout;
  } catch (err) {
    if (!(err instanceof ToolError)) throw err;
    switch (err.kind) {
      case "aborted":
        throw new SandboxdError("gone", `${o.what}: cancelled`, { cause: err });
      case "timeout":
        throw new SandboxdError(
          "image_pull_failed",
          `${o.what}: no answer within ${Math.round(o.timeoutMs / 1000)} s`,
          { cause: err, details: { reason: "registry_timeout" } },
        );
      case "spawn":
        throw pullError(o.what, "internal", "the agent cannot run its image tool", err);
      case "output_too_large":
        throw pullError(o.what, "image_too_large", "the registry's answer is too large", err);
      default: {
        const output = err.details.output ?? "";
        if (isNoSpace(output)) throw asNoSpace(new Error(output), o.what);
        const [reason, text] = classifySkopeoFailure(output);
        throw pullError(o.what, reason, text, err);
      }
    }
  }
}

/**
 * skopeo's failure as a stable reason and a short text for the tenant. The text never quotes
 * skopeo: its lines carry the registry's internal URLs, token realms and host paths.
 */
export function classifySkopeoFailure(output: string): [reason: string, text: string] {
  const msg = skopeoReason(output);
  // A status code standing alone: never the digits of an address or a port (`127.0.0.3:40412`
  // once made a refused connection read as a missing image).
  const status = (codes: string) => new RegExp(`(?<![\\w.:])(?:${codes})(?![\\w.:])`);
  if (
    /unauthorized|authentication required|denied|forbidden|invalid username|credentials/i.test(msg) ||
    status("401|403").test(msg)
  )
    return ["registry_denied", "the registry refused the credentials or access to the image"];
  if (/manifest unknown|name unknown|not found/i.test(msg) || status("404").test(msg))
    return [
      "image_not_found",
      "manifest unknown: the registry has no such image, or not for these credentials",
    ];
  if (/x509|certificate|tls:|https? response to https? client/i.test(msg))
    return ["registry_tls", "the registry's TLS could not be verified"];
  if (/too large|exceeds|no space/i.test(msg)) return ["image_too_large", "image too large"];
  if (
    /connection refused|no such host|dial tcp|i\/o timeout|network is unreachable|no route|connection reset|EOF/i.test(
      msg,
    )
  )
    return ["registry_unreachable", "the registry could not be reached"];
  if (/unsupported|no image found|choosing image instance|manifest list/i.test(msg))
    return ["image_unsupported", "the image has no linux/amd64 variant or an unsupported format"];
  return ["image_pull_failed", "the registry transfer failed"];
}

/**
 * The readable part of a skopeo error, for the agent's log: its last line, without the
 * `time=... level=fatal msg=` logging prefix.
 */
export function skopeoReason(output: string): string {
  const last =
    output
      .split("\n")
      .filter((l) => l.trim() !== "")
      .pop() ?? "skopeo failed";
  const msg = /msg="((?:[^"\\]|\\.)*)"/.exec(last)?.[1]?.replace(/\\"/g, '"') ?? last;
  return msg.length > 600 ? `...${msg.slice(-600)}` : msg;
}
