import { afterEach, beforeEach, describe, expect, test } from "bun:test";
import { existsSync, mkdtempSync, rmSync } from "node:fs";
import { createServer, type Server, type Socket } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { QmpClient } from "./client.ts";
import { QmpCommandError, QmpDisconnectedError, QmpProtocolError, QmpTimeoutError } from "./errors.ts";

/**
 * A fake QMP server on a real unix socket: QEMU's side of the socket is a boundary we do not own,
 * so a scripted peer is the honest way to drive the error paths (timeouts, bad JSON, hang-ups)
 * that a real QEMU produces only rarely. `handler` decides each answer.
 */
type Handler = (cmd: { execute: string; id?: unknown; arguments?: unknown }, sock: Socket) => void;

const GREETING =
  '{"QMP":{"version":{"qemu":{"major":7,"minor":2,"micro":0},"package":"fake"},"capabilities":[]}}\r\n';

let dir: string;
let server: Server | undefined;
let path: string;
let handler: Handler;
let received: string[];

function send(sock: Socket, obj: unknown): void {
  sock.write(`${JSON.stringify(obj)}\r\n`);
}

function startServer(opts: { greeting?: string | null } = {}): Promise<void> {
  server = createServer((sock) => {
    if (opts.greeting !== null) sock.write(opts.greeting ?? GREETING);
    let buf = "";
    sock.on("data", (d) => {
      buf += d.toString();
      let nl = buf.indexOf("\n");
      while (nl >= 0) {
        const line = buf.slice(0, nl);
        buf = buf.slice(nl + 1);
        nl = buf.indexOf("\n");
        const cmd = JSON.parse(line) as { execute: string; id?: unknown };
        received.push(cmd.execute);
        if (cmd.execute === "qmp_capabilities") send(sock, { return: {}, id: cmd.id });
        else handler(cmd, sock);
      }
    });
    sock.on("error", () => {});
  });
  return new Promise((r) => server?.listen(path, () => r()));
}

beforeEach(() => {
  dir = mkdtempSync(join(tmpdir(), "qmp-test-"));
  path = join(dir, "qmp.sock");
  received = [];
  handler = (cmd, sock) => send(sock, { return: {}, id: cmd.id });
});

afterEach(async () => {
  await new Promise<void>((r) => (server ? server.close(() => r()) : r()));
  server = undefined;
  rmSync(dir, { recursive: true, force: true });
});

describe("QmpClient against a fake server", () => {
  test("greeting, capabilities, then commands matched by id", async () => {
    handler = (cmd, sock) => {
      // Answer out of order: the second command first, to prove matching is by id.
      if (cmd.execute === "slow") setTimeout(() => send(sock, { return: { which: "slow" }, id: cmd.id }), 30);
      else send(sock, { return: { which: cmd.execute }, id: cmd.id });
    };
    await startServer();
    const c = await QmpClient.connect(path, { timeoutMs: 2000 });
    expect(c.greeting.version.qemu.major).toBe(7);
    const [a, b] = await Promise.all([c.execute("slow"), c.execute("fast")]);
    expect(a).toEqual({ which: "slow" });
    expect(b).toEqual({ which: "fast" });
    expect(received).toEqual(["qmp_capabilities", "slow", "fast"]);
    c.close();
  });

  test("connect retries until the socket appears", async () => {
    // The socket is not there when connect starts; it comes 100 ms later. (The timeout only
    // catches a connect that never retries, on a loaded host.)
    expect(existsSync(path)).toBe(false);
    const c = QmpClient.connect(path, { timeoutMs: 30_000 });
    await new Promise((r) => setTimeout(r, 100));
    await startServer();
    const client = await c;
    expect(received).toEqual(["qmp_capabilities"]); // the handshake went through
    client.close();
  });

  test("connect times out without a greeting, and when nothing listens", async () => {
    await startServer({ greeting: null });
    const err = await QmpClient.connect(path, { timeoutMs: 100 }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(QmpTimeoutError);
    const err2 = await QmpClient.connect(join(dir, "absent.sock"), { timeoutMs: 50 }).catch(
      (e: unknown) => e,
    );
    expect(err2).toBeInstanceOf(QmpTimeoutError);
  });

  test("connect gives up at once when aborted", async () => {
    const ac = new AbortController();
    setTimeout(() => ac.abort(new Error("qemu exited")), 30);
    const t0 = Date.now();
    const err = await QmpClient.connect(join(dir, "absent.sock"), {
      timeoutMs: 60_000,
      signal: ac.signal,
    }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(QmpDisconnectedError);
    // Only catches waiting out the 60 s timeout instead of the abort (on a loaded host).
    expect(Date.now() - t0).toBeLessThan(15_000);
  });

  test("a greeting that is not QMP is a protocol error", async () => {
    await startServer({ greeting: "SSH-2.0-nope\r\n" });
    const err = await QmpClient.connect(path, { timeoutMs: 1000 }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(QmpProtocolError);
    expect((err as QmpProtocolError).code).toBe("qmp_protocol");
  });

  test("an error reply becomes QmpCommandError with class and desc", async () => {
    handler = (cmd, sock) =>
      send(sock, { error: { class: "DeviceNotFound", desc: "Device 'x' not found" }, id: cmd.id });
    await startServer();
    const c = await QmpClient.connect(path, { timeoutMs: 2000 });
    const err = await c.execute("device_del", { id: "x" }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(QmpCommandError);
    const e = err as QmpCommandError;
    expect(e.code).toBe("qmp_error");
    expect(e.errorClass).toBe("DeviceNotFound");
    expect(e.desc).toBe("Device 'x' not found");
    expect(e.command).toBe("device_del");
    c.close();
  });

  test("a command with no answer times out; its late answer is dropped", async () => {
    let lateId: unknown;
    handler = (cmd, sock) => {
      if (cmd.execute === "hang") lateId = cmd.id;
      else {
        // Send the late answer for "hang" first: it must be dropped, not confused with this one.
        send(sock, { return: { late: true }, id: lateId });
        send(sock, { return: { mine: true }, id: "someone-elses-id" });
        send(sock, { return: { ok: true }, id: cmd.id });
      }
    };
    await startServer();
    const logs: string[] = [];
    const c = await QmpClient.connect(path, { timeoutMs: 2000, log: (m) => logs.push(m) });
    const err = await c.execute("hang", undefined, { timeoutMs: 50 }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(QmpTimeoutError);
    expect((err as QmpTimeoutError).code).toBe("qmp_timeout");
    expect(await c.execute("next")).toEqual({ ok: true });
    expect(logs.filter((l) => l.includes("unknown id")).length).toBe(2);
    c.close();
  });

  test("server hang-up rejects every pending command and event waiter", async () => {
    handler = (cmd, sock) => {
      if (cmd.execute === "quit") setTimeout(() => sock.destroy(), 20);
    };
    await startServer();
    const c = await QmpClient.connect(path, { timeoutMs: 2000 });
    const w = c.waitEvent("SHUTDOWN", { timeoutMs: 5000 });
    const p1 = c.execute("never");
    const p2 = c.execute("quit");
    for (const p of [p1, p2, w]) {
      const err = await p.catch((e: unknown) => e);
      expect(err).toBeInstanceOf(QmpDisconnectedError);
      expect((err as QmpDisconnectedError).code).toBe("qmp_disconnected");
    }
    expect((await c.closed).code).toBe("qmp_disconnected");
    expect(c.isClosed).toBe(true);
    expect(await c.execute("after").catch((e: unknown) => e)).toBeInstanceOf(QmpDisconnectedError);
  });

  test("close() by us rejects pending commands", async () => {
    handler = () => {};
    await startServer();
    const c = await QmpClient.connect(path, { timeoutMs: 2000 });
    const p = c.execute("never");
    c.close();
    expect(await p.catch((e: unknown) => e)).toBeInstanceOf(QmpDisconnectedError);
  });

  test("events reach listeners registered before the command; waitEvent filters", async () => {
    handler = (cmd, sock) => {
      // QEMU emits the event before the command's answer: the listener must already exist.
      send(sock, {
        event: "BLOCK_JOB_READY",
        data: { device: "other" },
        timestamp: { seconds: 1, microseconds: 0 },
      });
      send(sock, {
        event: "BLOCK_JOB_READY",
        data: { device: "disk0" },
        timestamp: { seconds: 2, microseconds: 0 },
      });
      send(sock, { return: {}, id: cmd.id });
    };
    await startServer();
    const c = await QmpClient.connect(path, { timeoutMs: 2000 });
    const seen: string[] = [];
    const offAll = c.on("*", (ev) => seen.push(`${ev.event}:${String(ev.data.device)}`));
    const ready = c.waitEvent("BLOCK_JOB_READY", {
      timeoutMs: 1000,
      filter: (ev) => ev.data.device === "disk0",
    });
    await c.execute("block-job-go");
    const ev = await ready;
    expect(ev.timestamp.seconds).toBe(2);
    expect(seen).toEqual(["BLOCK_JOB_READY:other", "BLOCK_JOB_READY:disk0"]);
    offAll();
    await c.execute("again");
    expect(seen.length).toBe(2);
    const err = await c.waitEvent("NEVER", { timeoutMs: 30 }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(QmpTimeoutError);
    c.close();
  });

  test("a non-JSON line after the handshake fails the connection with a protocol error", async () => {
    handler = (_cmd, sock) => sock.write("garbage\r\n");
    await startServer();
    const c = await QmpClient.connect(path, { timeoutMs: 2000 });
    const err = await c.execute("x").catch((e: unknown) => e);
    expect(err).toBeInstanceOf(QmpProtocolError);
    expect(c.isClosed).toBe(true);
  });
});
