/**
 * The console drain without QEMU: a unix socket server plays QEMU's `server=on` console chardev
 * (one client at a time, bytes written as the guest produces them).
 */
import { afterAll, expect, test } from "bun:test";
import { existsSync, mkdirSync, mkdtempSync, rmSync, statSync, writeFileSync } from "node:fs";
import { createServer, type Server, type Socket } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import {
  CONSOLE_DISK_BYTES,
  CONSOLE_FILE_BYTES,
  consoleArgs,
  consoleTail,
  startConsoleDrain,
} from "./console.ts";

const root = mkdtempSync(join(tmpdir(), "console-test-"));
afterAll(() => rmSync(root, { recursive: true, force: true }));

let n = 0;
/** Whether the log's tail ends with `end` within 15 s (a bound for a loaded host). */
async function tailReaches(log: string, end: string): Promise<boolean> {
  for (const stop = performance.now() + 15_000; performance.now() < stop; await Bun.sleep(20)) {
    if ((await consoleTail(log, end.length)) === end) return true;
  }
  return (await consoleTail(log, end.length)) === end;
}

function dirFor(): { sock: string; log: string } {
  const d = join(root, String(n++));
  mkdirSync(d);
  return { sock: join(d, "console.sock"), log: join(d, "console.log") };
}

/** A fake QEMU console: resolves each accepted client in turn. */
function fakeQemu(sock: string): { server: Server; next: () => Promise<Socket> } {
  const waiting: ((s: Socket) => void)[] = [];
  const accepted: Socket[] = [];
  const server = createServer((s) => {
    const w = waiting.shift();
    if (w) w(s);
    else accepted.push(s);
  });
  server.listen(sock);
  return {
    server,
    next: () => {
      const s = accepted.shift();
      return s ? Promise.resolve(s) : new Promise((r) => waiting.push(r));
    },
  };
}

/** Bytes on disk now; a file the drain is rotating away between the look and the stat is 0. */
const diskBytes = (log: string) =>
  [log, `${log}.1`].reduce((sum, p) => sum + (statSync(p, { throwIfNoEntry: false })?.size ?? 0), 0);

async function writeAll(s: Socket, total: number, byte: string): Promise<void> {
  const chunk = Buffer.alloc(64 * 1024, byte);
  for (let sent = 0; sent < total; sent += chunk.length) {
    if (!s.write(chunk.subarray(0, Math.min(chunk.length, total - sent)))) {
      await new Promise((r) => s.once("drain", r));
    }
  }
}

test("the QEMU options put the serial port on the socket, waiting for a reader only when asked", () => {
  expect(consoleArgs("/d/console.sock", true)).toEqual([
    "-chardev",
    "socket,id=console0,path=/d/console.sock,server=on,wait=on",
    "-serial",
    "chardev:console0",
  ]);
  expect(consoleArgs("/d/console.sock", false)[1]).toEndWith("wait=off");
});

test("20 MiB through the console keep at most CONSOLE_DISK_BYTES on disk, the newest bytes last", async () => {
  const { sock, log } = dirFor();
  const q = fakeQemu(sock);
  const drain = startConsoleDrain(sock, log);
  expect(await drain.ready).toBe(true);
  const client = await q.next();
  let peak = 0;
  const watch = setInterval(() => {
    peak = Math.max(peak, diskBytes(log));
  }, 5);
  await writeAll(client, 20 << 20, "x");
  client.end("THE END\n");
  expect(await tailReaches(log, "xxxxTHE END\n")).toBe(true);
  await drain.close();
  clearInterval(watch);
  peak = Math.max(peak, diskBytes(log));
  expect(peak).toBeLessThanOrEqual(CONSOLE_DISK_BYTES);
  expect(statSync(log).size).toBeLessThanOrEqual(CONSOLE_FILE_BYTES);
  expect(existsSync(`${log}.1`)).toBe(true);
  const tail = await consoleTail(log, 4096);
  expect(tail.length).toBe(4096);
  expect(tail.endsWith("xxxxTHE END\n")).toBe(true);
  q.server.close();
});

test("the tail spans the rotation: the end of console.log.1, then console.log", async () => {
  const { log } = dirFor();
  writeFileSync(`${log}.1`, "older-part-");
  writeFileSync(log, "newer");
  expect(await consoleTail(log, 8)).toBe("rt-newer");
  expect(await consoleTail(log, 100)).toBe("older-part-newer");
  expect(await consoleTail(join(root, "missing.log"), 100)).toBe("");
});

test("appends to an existing log and reconnects when QEMU drops the connection", async () => {
  const { sock, log } = dirFor();
  writeFileSync(log, "from the last agent\n");
  const q = fakeQemu(sock);
  const drain = startConsoleDrain(sock, log);
  await drain.ready;
  const first = await q.next();
  first.end("one\n");
  const second = await q.next();
  second.write("two\n");
  expect(await tailReaches(log, "one\ntwo\n")).toBe(true);
  await drain.close();
  expect(await consoleTail(log, 1000)).toBe("from the last agent\none\ntwo\n");
  q.server.close();
});

test("the drain ends by itself when QEMU is gone (its socket refuses), writing nothing", async () => {
  const { sock, log } = dirFor();
  const q = fakeQemu(sock);
  const drain = startConsoleDrain(sock, log);
  expect(await drain.ready).toBe(true);
  const c = await q.next();
  // QEMU exits: its listening socket goes away and the client is closed.
  q.server.close();
  c.destroy();
  await Bun.sleep(600);
  await drain.close();
  expect(existsSync(log)).toBe(false);
});

test("a symlink the jailed QEMU plants as console.log is replaced, never written through", async () => {
  const { sock, log } = dirFor();
  // A host file root can write, and the VM's console.log pointing at it (the directory is QEMU's).
  const victim = join(root, `victim-${n}`);
  writeFileSync(victim, "precious\n");
  const { symlinkSync, lstatSync, readFileSync } = await import("node:fs");
  symlinkSync(victim, log);
  const qemu = fakeQemu(sock);
  const drain = startConsoleDrain(sock, log);
  const s = await qemu.next();
  s.write("guest bytes\n");
  for (
    let i = 0;
    i < 100 && !(existsSync(log) && statSync(log).size > 0 && !lstatSync(log).isSymbolicLink());
    i++
  )
    await Bun.sleep(20);
  s.end();
  await drain.close();
  qemu.server.close();
  expect(readFileSync(victim, "utf8")).toBe("precious\n");
  expect(lstatSync(log).isSymbolicLink()).toBe(false);
  expect(readFileSync(log, "utf8")).toContain("guest bytes");
  // The tail never reads through a link either.
  symlinkSync(victim, `${log}.1`);
  expect(await consoleTail(log, 1 << 20)).not.toContain("precious");
});

test("a FIFO the jailed QEMU plants as console.log never blocks the drain: it is replaced by a file", async () => {
  const { sock, log } = dirFor();
  // A FIFO nobody reads: a blocking open for writing would wait for a reader for ever.
  expect(Bun.spawnSync(["mkfifo", log]).exitCode).toBe(0);
  const { lstatSync, readFileSync } = await import("node:fs");
  const qemu = fakeQemu(sock);
  const drain = startConsoleDrain(sock, log);
  const s = await qemu.next();
  s.write("guest bytes\n");
  for (let i = 0; i < 100 && !(lstatSync(log).isFile() && statSync(log).size > 0); i++) await Bun.sleep(20);
  s.end();
  await drain.close();
  qemu.server.close();
  expect(lstatSync(log).isFile()).toBe(true);
  expect(readFileSync(log, "utf8")).toContain("guest bytes");
});
