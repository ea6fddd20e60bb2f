/**
 * WebSocket settings shared by the runtime adapters (connect relays, spec 4.2). The values and
 * their reasons are in docs/decisions.md ("Connect relays").
 */

/**
 * Largest message a client may send, bytes: a CDP command (a big `Page.setContent`, a file
 * upload) fits; one frame can never make the gateway hold more than this.
 */
export const WS_MAX_MESSAGE_BYTES = 64 * 1024 * 1024;

/**
 * Seconds without any frame after which a WebSocket is closed; the server pings before that
 * (Bun, Node), so only a client that stopped answering is cut. Relays themselves have no data
 * idle timeout: a tunnel to a database may be silent for hours.
 */
export const WS_IDLE_TIMEOUT_S = 120;

export function isUpgradeRequest(request: Request): boolean {
  return request.headers.get("upgrade")?.toLowerCase() === "websocket";
}
