import { afterAll, expect, test } from "bun:test";
import { mkdtempSync, readdirSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { createServer, type Server } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { connectSocketAt } from "./socket-path.ts";

const root = mkdtempSync(join(tmpdir(), "socket-path-"));
afterAll(() => rmSync(root, { recursive: true, force: true }));

/** A server at `path` that greets each connection with `name` and counts them. */
async function greeter(path: string, name: string): Promise<{ server: Server; accepted: () => number }> {
  let n = 0;
  const server = createServer((s) => {
    n++;
    s.end(name);
  });
  await new Promise<void>((r) => server.listen(path, r));
  return { server, accepted: () => n };
}

const openFds = () => readdirSync("/proc/self/fd").length;

test("only a socket itself is connected to: a symlink to one, a file or nothing is named, never followed", async () => {
  const real = await greeter(join(root, "real.sock"), "real");
  // What a planted symlink would lead a root connect to: another process's socket.
  const other = await greeter(join(root, "other.sock"), "other");
  try {
    symlinkSync(join(root, "other.sock"), join(root, "link.sock"));
    writeFileSync(join(root, "file.sock"), "");
    const fdsBefore = openFds();

    const c = await connectSocketAt(join(root, "real.sock"));
    if (!("socket" in c)) throw new Error(`not connected: ${JSON.stringify(c)}`);
    const got = await new Promise<string>((r) => {
      let text = "";
      c.socket.on("data", (d) => {
        text += String(d);
      });
      c.socket.on("end", () => r(text));
    });
    expect(got).toBe("real");
    c.socket.destroy();

    expect(await connectSocketAt(join(root, "link.sock"))).toEqual({ found: "a symlink" });
    expect(await connectSocketAt(join(root, "file.sock"))).toEqual({ found: "not a socket" });
    expect(await connectSocketAt(join(root, "none.sock"))).toEqual({ found: "missing" });
    expect(other.accepted()).toBe(0);
    expect(real.accepted()).toBe(1);
    // Every handle on a name is closed once its connect settled.
    await Bun.sleep(10);
    expect(openFds()).toBeLessThanOrEqual(fdsBefore);
  } finally {
    real.server.close();
    other.server.close();
  }
});
