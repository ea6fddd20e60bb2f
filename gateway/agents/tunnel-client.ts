/**
 * `AgentHttpClient.openTunnel`: `GET /v1/vms/{id}/tunnel?port=N` upgraded to a WebSocket with the
 * `ws` package (Bun and Node alike), adapted to the gateway's `Tunnel` (web streams).
 * Back-pressure: incoming messages wait in a queue the consumer drains through `readable`; past
 * QUEUE_HIGH bytes the socket is paused (TCP back-pressure up to the agent, which then stops
 * reading the guest tunnel) and resumed below QUEUE_LOW. Writes resolve once `bufferedAmount` is
 * under SEND_HIGH, so a slow agent/guest slows the writer instead of growing our buffer.
 * The same client serves `openPty` (`GET /vms/{id}/pty`): `resize` sends the agent a text message.
 */
import WebSocket from "ws";
import { PTY_PID_HEADER, type PtyTunnel } from "../../contracts/agent/api.ts";
import { errorFromAgentAnswer } from "../../contracts/agent/schemas.ts";
import { SandboxdError } from "../../contracts/errors.ts";

/** Messages are cut to 64 KiB: the guest's DATA frame size, well under the agent's 1 MiB cap. */
const MESSAGE_MAX = 64 * 1024;
/** Received bytes held for a slow consumer before the socket is paused: 1 MiB, then 256 KiB. */
const QUEUE_HIGH = 1 << 20;
const QUEUE_LOW = 256 * 1024;
/** Unsent bytes in the socket above which a write waits: 1 MiB. */
const SEND_HIGH = 1 << 20;
/** How often a waiting write looks at `bufferedAmount` again (ws has no drain event). */
const SEND_POLL_MS = 5;

/** Opens the WebSocket; an HTTP error answer becomes the agent's `SandboxdError` code. */
export async function connectTunnel(url: string, token: string, timeoutMs: number): Promise<PtyTunnel> {
  const ws = new WebSocket(url, {
    headers: { authorization: `Bearer ${token}` },
    handshakeTimeout: timeoutMs,
    perMessageDeflate: false,
  });
  ws.binaryType = "nodebuffer";
  let pid: number | undefined;
  ws.once("upgrade", (res) => {
    const raw = res.headers[PTY_PID_HEADER];
    if (typeof raw === "string" && /^[1-9][0-9]{0,9}$/.test(raw)) pid = Number(raw);
  });
  await new Promise<void>((resolve, reject) => {
    ws.once("open", () => resolve());
    ws.once("unexpected-response", (_req, res) => {
      const parts: Buffer[] = [];
      res.on("data", (d: Buffer) => parts.push(d));
      res.on("end", () => {
        reject(
          errorFromAgentAnswer(res.statusCode ?? 0, Buffer.concat(parts).toString(), "a tunnel upgrade"),
        );
        ws.terminate();
      });
    });
    ws.once("error", (err) =>
      reject(new SandboxdError("agent_unavailable", `agent tunnel ${url} did not open`, { cause: err })),
    );
  });
  const tunnel = wsTunnel(ws);
  if (pid !== undefined) tunnel.pid = pid;
  return tunnel;
}

function wsTunnel(ws: WebSocket): PtyTunnel {
  const queue: Buffer[] = [];
  let queued = 0;
  let ended = false;
  let failure: Error | undefined;
  let wake: (() => void) | undefined;
  let paused = false;

  ws.on("message", (data: Buffer, isBinary: boolean) => {
    if (!isBinary || data.length === 0) return;
    queue.push(data);
    queued += data.length;
    if (queued > QUEUE_HIGH && !paused) {
      paused = true;
      ws.pause();
    }
    wake?.();
  });
  ws.on("close", (code: number, reason: Buffer) => {
    ended = true;
    if (code !== 1000 && code !== 1005) {
      failure = new SandboxdError(
        "gone",
        `tunnel closed by the agent (${code}): ${reason.toString() || "no reason"}`,
      );
    }
    wake?.();
  });
  ws.on("error", (err) => {
    failure ??= new SandboxdError("agent_unavailable", "tunnel connection to the agent failed", {
      cause: err,
    });
  });

  const readable = new ReadableStream<Uint8Array>(
    {
      async pull(c) {
        for (;;) {
          const chunk = queue.shift();
          if (chunk) {
            queued -= chunk.length;
            if (paused && queued < QUEUE_LOW) {
              paused = false;
              ws.resume();
            }
            c.enqueue(chunk);
            return;
          }
          if (ended) {
            if (failure) c.error(failure);
            else c.close();
            return;
          }
          await new Promise<void>((resolve) => {
            wake = resolve;
          });
          wake = undefined;
        }
      },
      cancel() {
        ws.close(1000);
      },
    },
    { highWaterMark: 0 },
  );

  const writable = new WritableStream<Uint8Array>({
    async write(chunk) {
      for (let off = 0; off < chunk.length; off += MESSAGE_MAX) {
        if (ended || ws.readyState !== WebSocket.OPEN)
          throw failure ?? new SandboxdError("gone", "tunnel closed");
        ws.send(chunk.subarray(off, off + MESSAGE_MAX), { binary: true });
        while (ws.bufferedAmount > SEND_HIGH && !ended) {
          await new Promise((resolve) => setTimeout(resolve, SEND_POLL_MS));
        }
      }
    },
    close() {
      ws.close(1000);
    },
    abort() {
      ws.close(1000);
    },
  });

  return {
    readable,
    writable,
    close() {
      if (ws.readyState === WebSocket.CONNECTING || ws.readyState === WebSocket.OPEN) ws.close(1000);
    },
    // Only the agent's pty route reads text messages; its port tunnels never get one.
    resize(cols, rows) {
      if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "resize", cols, rows }));
    },
  };
}
