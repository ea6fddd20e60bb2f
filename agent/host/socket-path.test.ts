import { afterAll, expect, test } from "bun:test";
import { mkdtempSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { socketAt } from "./socket-path.ts";

const root = mkdtempSync(join(tmpdir(), "socket-path-"));
afterAll(() => rmSync(root, { recursive: true, force: true }));

test("only a socket itself is a socket: a symlink to one, a file or nothing is not", async () => {
  const sock = join(root, "real.sock");
  const server = createServer();
  await new Promise<void>((r) => server.listen(sock, r));
  try {
    symlinkSync(sock, join(root, "link.sock"));
    writeFileSync(join(root, "file.sock"), "");
    expect(socketAt(sock)).toBe("socket");
    expect(socketAt(join(root, "link.sock"))).toBe("a symlink");
    expect(socketAt(join(root, "file.sock"))).toBe("not a socket");
    expect(socketAt(join(root, "none.sock"))).toBe("missing");
  } finally {
    server.close();
  }
});
