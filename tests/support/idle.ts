/** Measuring a server's idle and header timeouts from the outside, on a raw TCP connection. */
import { connect } from "node:net";

/**
 * Seconds until the server at `url` closes a connection that sent `send` (nothing, or part of a
 * request) and then nothing; Infinity when it is still open after `capS`.
 */
export function secondsUntilClosed(url: string, send: string, capS: number): Promise<number> {
  const u = new URL(url);
  return new Promise((resolve) => {
    const t0 = performance.now();
    const sock = connect(Number(u.port), u.hostname, () => {
      if (send) sock.write(send);
    });
    sock.on("data", () => {});
    sock.on("error", () => {});
    const cap = setTimeout(() => {
      sock.destroy();
      resolve(Number.POSITIVE_INFINITY);
    }, capS * 1000);
    sock.once("close", () => {
      clearTimeout(cap);
      resolve((performance.now() - t0) / 1000);
    });
  });
}

/** A request cut off inside its headers. */
export const HALF_HEADERS = "GET /v1/health HTTP/1.1\r\nHost: x\r\n";
