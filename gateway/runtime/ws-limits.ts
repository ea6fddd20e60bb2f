/**
 * WebSocket settings shared by the runtime adapters and the connect relays (docs/sandboxes.md "Rules of the sandboxes API"). The values
 * and their reasons are in docs/connect.md "Connect relays".
 */

/**
 * Largest message a `tcp` relay takes from its client, bytes (1009 beyond). A WebSocket-to-TCP
 * bridge (websocat, a local forwarder in front of psql) sends one message per socket read,
 * 64 KiB or less; 1 MiB leaves 16 times that.
 */
export const TCP_MESSAGE_BYTES = 1024 * 1024;

/**
 * Largest CDP message either way, bytes (1009 beyond). Chromium's DevTools server reads client
 * messages up to 100 MiB (its `kReceiveBufferSizeForDevTools`), so nothing larger could reach the
 * browser; Playwright's largest command, a 50 MiB `setInputFiles` payload (its
 * `fileUploadSizeLimit`) as base64, is ~67 MiB. The browser's answers (screenshots, DOM
 * snapshots) are tens of MB; Playwright's client would take up to 256 MiB, but one relay holding
 * that for a guest that chose to send it is what this bound is for.
 */
export const CDP_MESSAGE_BYTES = 100 * 1024 * 1024;

/**
 * What the runtime itself accepts in one client message: the largest of any relay. Each relay
 * checks its own, smaller limit; Node applies each relay's limit in the parser already.
 */
export const WS_MAX_MESSAGE_BYTES = Math.max(TCP_MESSAGE_BYTES, CDP_MESSAGE_BYTES);

/**
 * Seconds without any frame after which a WebSocket is closed; the server pings before that
 * (every adapter), so only a client that stopped answering is cut. Relays themselves have no data
 * idle timeout: a tunnel to a database may be silent for hours.
 */
export const WS_IDLE_TIMEOUT_S = 120;

export function isUpgradeRequest(request: Request): boolean {
  return request.headers.get("upgrade")?.toLowerCase() === "websocket";
}
