/**
 * What both ends of an agent's dial-out link agree on (docs/regions.md "BYOC agents: who dials
 * whom"): where the gateway takes it, how the agent's URL says it dials out, the greeting and the
 * liveness bounds. The encryption is dial-cipher.ts, the streams dial-mux.ts.
 */
import { DIAL_CHUNK_BYTES } from "./dial-mux.ts";

/** Where a gateway takes an agent's dial-out link: a WebSocket upgrade. */
export const DIAL_PATH = "/internal/agents/dial";
/** The upgrade's header carrying the agent's greeting nonce (hex). */
export const DIAL_NONCE_HEADER = "x-sandboxd-dial-nonce";
/** The scheme of the URL an agent that dials out is enrolled with: `dial://<agent id>`. */
export const DIAL_URL_SCHEME = "dial:";
/** A sealed message: a frame's header, its largest payload, the GCM tag, and slack. */
export const DIAL_MESSAGE_MAX = DIAL_CHUNK_BYTES + 1024;
/**
 * Each end pings every 15 s; a link that brings nothing for 45 s (three pings) is dead (a host
 * gone without a close, a NAT that dropped its mapping): it is closed and the agent dials again.
 */
export const DIAL_PING_MS = 15_000;
export const DIAL_IDLE_MS = 3 * DIAL_PING_MS;

export function dialUrl(agentId: string): string {
  return `${DIAL_URL_SCHEME}//${agentId}`;
}

export function isDialUrl(url: string): boolean {
  return url.startsWith(DIAL_URL_SCHEME);
}
