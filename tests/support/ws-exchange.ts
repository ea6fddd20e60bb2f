/**
 * One exchange over a WebSocket relay (connect URLs, process relays): opens `url`, sends `send` as
 * one binary message (or closes at once when it is empty) and collects what comes back until the
 * relay closes. A refused handshake gives its HTTP status and body instead of 101.
 */
import WebSocket from "ws";

export function wsExchange(url: string, send: string): Promise<{ status: number; text: string }> {
  return new Promise((resolve, reject) => {
    const ws = new WebSocket(url, { perMessageDeflate: false });
    const parts: Buffer[] = [];
    ws.once("open", () => {
      if (send) ws.send(Buffer.from(send));
      else ws.close();
    });
    ws.on("message", (d: Buffer) => parts.push(Buffer.from(d)));
    ws.once("close", () => resolve({ status: 101, text: Buffer.concat(parts).toString() }));
    ws.once("unexpected-response", (_req, res) => {
      const body: Buffer[] = [];
      res.on("data", (b: Buffer) => body.push(b));
      res.on("end", () => resolve({ status: res.statusCode ?? 0, text: Buffer.concat(body).toString() }));
    });
    ws.once("error", reject);
  });
}
