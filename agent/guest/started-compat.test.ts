/**
 * A guest agent frozen in an older template sends STARTED empty (docs/guest-protocol.md
 * "Streams"): the host still treats it as started, with the pid unknown until the RESPONSE.
 * The older agent is played here over a real unix socket by a peer that speaks the wire format
 * with our codec: HELLO, then for an EXEC an empty STARTED and the RESPONSE.
 */
import { afterAll, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { connect, createServer, type Socket } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { FrameType, Tag } from "../../contracts/guest-protocol.ts";
import { GuestClient } from "./client.ts";
import { encodeFrame, FrameDecoder, TlvWriter } from "./codec.ts";

const dir = mkdtempSync(join(tmpdir(), "sbx-started-compat-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** The older guest agent's side: answers HELLO, and an EXEC with an empty STARTED then its RESPONSE. */
function olderGuest(s: Socket, pid: number): void {
  const decoder = new FrameDecoder();
  s.on("data", (chunk: Buffer) => {
    for (const ev of decoder.push(chunk)) {
      if (ev.kind !== "frame") continue;
      const { type, stream } = ev.frame;
      if (type === FrameType.HELLO) {
        s.write(encodeFrame(FrameType.HELLO, 0, new TlvWriter().u32(Tag.PROTO_VERSION, 1).finish()));
      } else if (type === FrameType.REQUEST) {
        s.write(encodeFrame(FrameType.STARTED, stream));
        const answer = new TlvWriter().u32(Tag.STATUS, 0).u32(Tag.EXIT_CODE, 0).u32(Tag.PID, pid);
        s.write(encodeFrame(FrameType.RESPONSE, stream, answer.finish()));
      }
    }
  });
}

test("an empty STARTED (an older guest agent) calls onStarted with no pid; the RESPONSE still names it", async () => {
  const sock = join(dir, "guest.sock");
  const server = createServer((s) => olderGuest(s, 4242));
  await new Promise<void>((resolve) => server.listen(sock, resolve));
  const socket = await new Promise<Socket>((resolve, reject) => {
    const c = connect(sock, () => resolve(c));
    c.once("error", reject);
  });
  const client = await GuestClient.fromSocket(socket);
  try {
    const started: Array<number | undefined> = [];
    const r = await client.exec({ argv: ["true"], onStarted: (pid) => started.push(pid) });
    expect(started).toEqual([undefined]);
    expect(r.pid).toBe(4242);
    expect(r.exitCode).toBe(0);
  } finally {
    client.close();
    await new Promise<void>((resolve) => server.close(() => resolve()));
  }
});
