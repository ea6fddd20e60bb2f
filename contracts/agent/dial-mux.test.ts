/**
 * The dial-out link's streams and encryption over real sockets: a gateway end (a loopback
 * listener whose connections become streams) and an agent end (each stream bridged to an echo
 * server, the stand-in for the agent's API), joined by the two ciphers as the WebSocket would
 * join them. Many streams at once keep their bytes apart and intact; a reader that stops reading
 * holds its sender at the window, not the other streams; a peer that breaks the window, opens a
 * stream twice or speaks first, and a message altered, replayed or sealed with another key, end
 * the link.
 */
import { afterEach, expect, test } from "bun:test";
import { randomBytes } from "node:crypto";
import { connect, createServer, type Server, type Socket } from "node:net";
import { DialCipher, dialNonce } from "./dial-cipher.ts";
import { DIAL_STREAM_WINDOW, DialFrame, DialMux, encodeDialFrame } from "./dial-mux.ts";

const servers: Server[] = [];
afterEach(() => {
  for (const s of servers.splice(0)) s.close();
});

async function listen(onConn: (s: Socket) => void): Promise<number> {
  const server = createServer({ allowHalfOpen: true }, onConn);
  servers.push(server);
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  return (server.address() as { port: number }).port;
}

/** Both ends, the sealed messages between them counted; `fails` collects each end's breaks. */
async function link(target: number) {
  const key = randomBytes(32);
  const an = dialNonce();
  const gn = dialNonce();
  const gwCipher = new DialCipher(key, an, gn, "gateway");
  const agCipher = new DialCipher(key, an, gn, "agent");
  const fails: string[] = [];
  let bytesOnWire = 0;
  // Messages cross on the next tick, as a socket's would: neither end runs inside the other.
  const gw: DialMux = new DialMux({
    send: (f) => {
      const sealed = gwCipher.seal(f);
      bytesOnWire += sealed.length;
      setImmediate(() => agent.receive(agCipher.open(sealed)));
    },
    fail: (why) => fails.push(`gateway: ${why}`),
  });
  const agent: DialMux = new DialMux({
    send: (f) => {
      const sealed = agCipher.seal(f);
      bytesOnWire += sealed.length;
      setImmediate(() => gw.receive(gwCipher.open(sealed)));
    },
    fail: (why) => fails.push(`agent: ${why}`),
    accept: () => connect({ host: "127.0.0.1", port: target, allowHalfOpen: true }),
  });
  const port = await listen((c) => gw.open(c));
  return { gw, agent, port, fails, wire: () => bytesOnWire, ciphers: { gwCipher, agCipher } };
}

/** Sends `data`, half-closes, and reads the whole answer. */
function exchange(port: number, data: Buffer): Promise<Buffer> {
  return new Promise((resolve, reject) => {
    const c = connect({ host: "127.0.0.1", port, allowHalfOpen: true });
    const parts: Buffer[] = [];
    c.on("data", (d: Buffer) => parts.push(d));
    c.on("end", () => resolve(Buffer.concat(parts)));
    c.on("error", reject);
    c.end(data);
  });
}

test("32 streams at once, 1 MiB each way apiece, come back intact and apart", async () => {
  const echo = await listen((s) => s.pipe(s));
  const l = await link(echo);
  const payloads = Array.from({ length: 32 }, () => randomBytes(1 << 20));
  const answers = await Promise.all(payloads.map((p) => exchange(l.port, p)));
  for (const [i, a] of answers.entries()) expect(a.equals(payloads[i] as Buffer)).toBe(true);
  expect(l.fails).toEqual([]);
  // Every stream ended in both directions: none is left on either end.
  for (let i = 0; i < 100 && (l.gw.size > 0 || l.agent.size > 0); i++) await Bun.sleep(10);
  expect([l.gw.size, l.agent.size]).toEqual([0, 0]);
});

test("a reader that stops reading holds its own stream at the window; another stream goes on", async () => {
  // The agent's side writes 8 MiB to whoever connects; the gateway's client reads nothing.
  const big = randomBytes(8 << 20);
  const source = await listen((s) => s.end(big));
  const l = await link(source);
  const stalled = connect({ host: "127.0.0.1", port: l.port });
  stalled.pause();
  await Bun.sleep(500);
  // What crossed is the window and the socket buffers, not the 8 MiB.
  const wire = l.wire();
  expect(wire).toBeLessThan(DIAL_STREAM_WINDOW * 2 + (4 << 20));
  // Another stream through the same link is not held behind it.
  const other = await exchange(l.port, Buffer.alloc(0));
  expect(other.length).toBe(big.length);
  expect(other.equals(big)).toBe(true);
  // Reading resumes the first.
  const parts: Buffer[] = [];
  stalled.on("data", (d: Buffer) => parts.push(d));
  await new Promise<void>((r) => {
    stalled.on("end", () => r());
    stalled.resume();
  });
  expect(Buffer.concat(parts).equals(big)).toBe(true);
  stalled.destroy();
  expect(l.fails).toEqual([]);
});

test("a hostile peer: data past the window, a stream opened twice, the agent opening one, an unknown frame", async () => {
  const echo = await listen((s) => s.pipe(s));
  const fails: string[] = [];
  const agent = new DialMux({
    send: () => {},
    fail: (why) => fails.push(why),
    accept: () => connect({ host: "127.0.0.1", port: echo, allowHalfOpen: true }),
  });
  agent.receive(encodeDialFrame(DialFrame.Open, 7));
  agent.receive(encodeDialFrame(DialFrame.Open, 7));
  expect(fails.pop()).toContain("opened twice");
  for (let i = 0; i < 4; i++) agent.receive(encodeDialFrame(DialFrame.Data, 7, Buffer.alloc(64 * 1024)));
  expect(fails).toEqual([]); // exactly the window
  agent.receive(encodeDialFrame(DialFrame.Data, 7, Buffer.alloc(1)));
  expect(fails.pop()).toContain("past its window");
  agent.receive(encodeDialFrame(DialFrame.Credit, 7, Buffer.from([0, 0x10, 0, 0])));
  expect(fails.pop()).toContain("credit past its window");
  agent.receive(Buffer.from([9, 0, 0, 0, 1]));
  expect(fails.pop()).toContain("unknown dial frame type 9");
  agent.receive(Buffer.from([1, 0]));
  expect(fails.pop()).toContain("shorter than its header");
  agent.closeAll();

  const gwFails: string[] = [];
  const gw = new DialMux({ send: () => {}, fail: (why) => gwFails.push(why) });
  gw.receive(encodeDialFrame(DialFrame.Open, 1));
  expect(gwFails).toEqual(["only the gateway opens dial streams"]);
});

test("a sealed message altered, replayed, skipped or sealed with another key does not open", () => {
  const key = randomBytes(32);
  const an = dialNonce();
  const gn = dialNonce();
  const sender = new DialCipher(key, an, gn, "agent");
  const m1 = sender.seal(Buffer.from("first"));
  const m2 = sender.seal(Buffer.from("second"));

  const altered = Buffer.from(m1);
  altered[0] = (altered[0] as number) ^ 1;
  expect(() => new DialCipher(key, an, gn, "gateway").open(altered)).toThrow("failed authentication");
  // Skipped (the second first) and replayed (the first twice).
  expect(() => new DialCipher(key, an, gn, "gateway").open(m2)).toThrow("failed authentication");
  const r = new DialCipher(key, an, gn, "gateway");
  expect(r.open(m1).toString()).toBe("first");
  expect(() => r.open(m1)).toThrow("failed authentication");
  // Another key (a gateway that does not hold this agent's), another session's nonces, or the
  // sender's own direction.
  expect(() => new DialCipher(randomBytes(32), an, gn, "gateway").open(m1)).toThrow("failed authentication");
  expect(() => new DialCipher(key, dialNonce(), gn, "gateway").open(m1)).toThrow("failed authentication");
  expect(() => new DialCipher(key, an, gn, "agent").open(m1)).toThrow("failed authentication");
});
