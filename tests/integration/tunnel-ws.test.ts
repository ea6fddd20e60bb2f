/**
 * The WebSocket leg of a tunnel without a VM: the agent's handlers (tunnel-ws.ts) under a real
 * Bun.serve and the gateway's client adapter (tunnel-client.ts, `ws`), over a fake tunnel whose
 * producer and sink we control. Proves bytes arrive intact both ways, that back-pressure holds
 * (a slow consumer on either end bounds how far the other end gets ahead), that an error ends
 * the WebSocket with the reason, and that an HTTP error before the upgrade is the agent's code.
 */
import { afterAll, beforeAll, expect, test } from "bun:test";
import { createHash } from "node:crypto";
import { type TunnelSocketData, tunnelWebSocket } from "../../agent/api/tunnel-ws.ts";
import type { Tunnel } from "../../contracts/agent/api.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { connectTunnel } from "../../gateway/agents/tunnel-client.ts";

const MiB = 1 << 20;
let server: ReturnType<typeof Bun.serve<TunnelSocketData>>;
/** The fake guest side of the next upgrade. */
let next: () => Tunnel;

beforeAll(() => {
  server = Bun.serve<TunnelSocketData>({
    hostname: "127.0.0.1",
    port: 0,
    fetch(req, srv) {
      if (new URL(req.url).searchParams.get("fail")) {
        return Response.json({ code: "port_unreachable", message: "refused" }, { status: 502 });
      }
      if (srv.upgrade(req, { data: { kind: "tunnel", tunnel: next() } })) return undefined;
      return new Response("no upgrade", { status: 400 });
    },
    websocket: tunnelWebSocket,
  });
});
afterAll(() => server.stop(true));

const url = (q = "") => `ws://127.0.0.1:${server.port}/t${q}`;

test("a slow client reader holds back the producer; bytes arrive intact", async () => {
  const TOTAL = 32 * MiB;
  const CHUNK = 64 * 1024;
  let produced = 0;
  const source = createHash("sha256");
  next = () => ({
    readable: new ReadableStream<Uint8Array>(
      {
        pull(c) {
          if (produced >= TOTAL) return c.close();
          const b = Buffer.alloc(CHUNK, (produced / CHUNK) & 0xff);
          source.update(b);
          produced += CHUNK;
          c.enqueue(b);
        },
      },
      { highWaterMark: 0 },
    ),
    writable: new WritableStream(),
    close() {},
  });
  const t = await connectTunnel(url(), "token", 5_000);
  const got = createHash("sha256");
  let consumed = 0;
  let maxAhead = 0;
  for await (const c of t.readable) {
    got.update(c);
    consumed += c.length;
    maxAhead = Math.max(maxAhead, produced - consumed);
    if (consumed % (2 * MiB) < c.length) await Bun.sleep(20); // slow reader
  }
  expect(consumed).toBe(TOTAL);
  expect(got.digest("hex")).toBe(source.digest("hex"));
  // Client queue (1 MiB) + socket buffers on both sides + Bun's send buffer: far below 32 MiB.
  expect(maxAhead).toBeLessThan(12 * MiB);
});

test("a slow guest sink holds back the client writer; bytes arrive intact", async () => {
  const TOTAL = 32 * MiB;
  let sunk = 0;
  const sink = createHash("sha256");
  const done = Promise.withResolvers<void>();
  next = () => ({
    readable: new ReadableStream<Uint8Array>({ pull: () => done.promise }), // silent until the end
    writable: new WritableStream<Uint8Array>(
      {
        async write(c) {
          sink.update(c);
          sunk += c.length;
          if (sunk % (2 * MiB) < c.length) await Bun.sleep(20); // slow guest reader
          if (sunk === TOTAL) done.resolve();
        },
      },
      { highWaterMark: 1 },
    ),
    close() {},
  });
  const t = await connectTunnel(url(), "token", 5_000);
  const w = t.writable.getWriter();
  const source = createHash("sha256");
  let written = 0;
  let maxAhead = 0;
  for (let i = 0; i < TOTAL / MiB; i++) {
    const b = Buffer.alloc(MiB, i);
    source.update(b);
    await w.write(b);
    written += MiB;
    maxAhead = Math.max(maxAhead, written - sunk);
  }
  await done.promise;
  expect(sink.digest("hex")).toBe(source.digest("hex"));
  expect(maxAhead).toBeLessThan(12 * MiB);
  t.close();
});

test("a failing tunnel closes the WebSocket with the reason; HTTP errors keep their code", async () => {
  next = () => ({
    readable: new ReadableStream<Uint8Array>({
      start(c) {
        c.enqueue(Buffer.from("partial"));
        c.error(new Error("sandbox vm-x is being destroyed"));
      },
    }),
    writable: new WritableStream(),
    close() {},
  });
  const t = await connectTunnel(url(), "token", 5_000);
  const r = t.readable.getReader();
  const parts: string[] = [];
  const err = await (async () => {
    for (;;) {
      const { value, done } = await r.read();
      if (done) return undefined;
      parts.push(Buffer.from(value).toString());
    }
  })().catch((e) => e);
  expect(err).toBeInstanceOf(SandboxdError);
  expect(err.message).toContain("being destroyed");

  const refused = await connectTunnel(url("?fail=1"), "token", 5_000).catch((e) => e);
  expect(refused).toBeInstanceOf(SandboxdError);
  expect(refused.code).toBe("port_unreachable");
});
