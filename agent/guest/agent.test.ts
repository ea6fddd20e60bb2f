/**
 * The guest agent in host test mode (`sandboxd-agent --port SOCK`): it connects to our
 * GuestListener and runs commands directly on this machine, so exec/process semantics are
 * tested in milliseconds without a VM. Boot duties (mounts, modules, switch root) only run as
 * PID 1 in a VM and are covered by the VM tests.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import {
  chmodSync,
  existsSync,
  mkdirSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  rmSync,
  statSync,
  writeFileSync,
} from "node:fs";
import { createServer, type Server, type Socket } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { type Subprocess, spawn, spawnSync } from "bun";
import { HEADER_LEN, MAX_PAYLOAD } from "../../contracts/guest-protocol.ts";
import { ProcessTable } from "../sandbox/processes.ts";
import { type GuestClient, GuestError } from "./client.ts";
import { listDir, readFileStream, removePath } from "./fs-ops.ts";
import { GuestListener } from "./listener.ts";

/** Every C file of the agent (one per concern; agent.h and protocol.h are included by them). */
const SRC_DIR = join(import.meta.dir, "..", "..", "guest");
const SRCS = readdirSync(SRC_DIR)
  .filter((f) => f.endsWith(".c"))
  .sort()
  .map((f) => join(SRC_DIR, f));
const ENV = { PATH: "/usr/local/bin:/usr/bin:/bin", LANG: "C" };
/** Setting an exec's uid and gid and a file's owner needs root: those tests skip otherwise. */
const NOT_ROOT = process.getuid?.() !== 0;
/**
 * A bound that only catches a hang, for the waits below: each is met in milliseconds, but this
 * runs beside other test files on a loaded 2-core host.
 */
const HANG_MS = 15_000;

let dir: string;
let sock: string;
let bin: string;
let agent: Subprocess<"ignore", "ignore", "pipe">;
let agentStderr = "";
let listener: GuestListener;
let client: GuestClient;
const logs: string[] = [];
const backgroundPids: number[] = [];

function alive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

/** Zombies answer kill -0 until reaped (the agent reaps them at once): poll briefly. */
async function waitDead(pid: number, ms = HANG_MS): Promise<boolean> {
  const until = Date.now() + ms;
  while (Date.now() < until) {
    if (!alive(pid)) return true;
    await Bun.sleep(20);
  }
  return !alive(pid);
}

async function waitFor(cond: () => boolean, ms = HANG_MS): Promise<boolean> {
  const until = Date.now() + ms;
  while (Date.now() < until) {
    if (cond()) return true;
    await Bun.sleep(20);
  }
  return cond();
}

async function accept(): Promise<GuestClient> {
  return listener.accept({ onLog: (l) => logs.push(l) });
}

function compile(out: string): { ok: boolean; warnings: string } {
  // musl-gcc is what ships the agent; plain cc is enough for host mode where musl is missing.
  for (const cc of [["musl-gcc", "-static"], ["cc"]]) {
    const r = spawnSync([...cc, "-Os", "-Wall", "-Wextra", "-std=gnu11", "-o", out, ...SRCS], {
      stderr: "pipe",
    });
    if (r.exitCode === 0) return { ok: true, warnings: r.stderr.toString() };
  }
  return { ok: false, warnings: "" };
}

beforeAll(async () => {
  dir = mkdtempSync(join(tmpdir(), "sbx-agent-"));
  sock = join(dir, "agent.sock");
  bin = join(dir, "sandboxd-agent");
  const c = compile(bin);
  if (!c.ok) throw new Error(`cannot compile the agent (${SRC_DIR}/*.c)`);
  expect(c.warnings).toBe("");
  listener = await GuestListener.listen(sock);
  agent = spawn([bin, "--port", sock], { stdin: "ignore", stdout: "ignore", stderr: "pipe" });
  void (async () => {
    for await (const chunk of agent.stderr) agentStderr += Buffer.from(chunk).toString();
  })();
  client = await accept();
});

afterAll(async () => {
  client?.close();
  agent?.kill("SIGKILL");
  await agent?.exited;
  for (const pid of backgroundPids) {
    try {
      process.kill(pid, "SIGKILL");
    } catch {}
  }
  await listener?.close();
  if (dir) rmSync(dir, { recursive: true, force: true });
  if (process.env.SBX_AGENT_DEBUG) process.stderr.write(agentStderr);
});

describe("exec", () => {
  test("argv, env, cwd, stdout, stderr, exit code", async () => {
    const r = await client.exec({
      argv: ["sh", "-c", 'echo "$FOO"; pwd; echo oops >&2; exit 3'],
      env: { ...ENV, FOO: "bar baz" },
      cwd: dir,
    });
    expect(r.stdout.toString()).toBe(`bar baz\n${dir}\n`);
    expect(r.stderr.toString()).toBe("oops\n");
    expect(r.exitCode).toBe(3);
    expect(r.signal).toBeNull();
    expect(r.timedOut).toBe(false);
    expect(r.pid).toBeGreaterThan(1);
    expect(r.durationUs).toBeGreaterThan(0);
    expect(r.stdoutTruncated || r.stderrTruncated).toBe(false);
  });

  test("the environment is exactly ENV", async () => {
    const r = await client.exec({ argv: ["env"], env: ["A=1", "PATH=/usr/bin:/bin"] });
    expect(r.stdout.toString().trim().split("\n").sort()).toEqual(["A=1", "PATH=/usr/bin:/bin"]);
  });

  test("argv[0] is searched in the PATH of ENV", async () => {
    const binDir = join(dir, "mybin");
    mkdirSync(binDir, { recursive: true });
    writeFileSync(join(binDir, "mytool"), '#!/bin/sh\necho mytool ran "$@"\n');
    chmodSync(join(binDir, "mytool"), 0o755);
    const found = await client.exec({ argv: ["mytool", "x"], env: { PATH: `${binDir}:/usr/bin:/bin` } });
    expect(found.stdout.toString()).toBe("mytool ran x\n");
    expect(found.exitCode).toBe(0);
    const missing = await client.exec({ argv: ["mytool"], env: ENV });
    expect(missing.exitCode).toBe(127);
  });

  test("not found is 127, not executable is 126, with the reason on stderr", async () => {
    const nf = await client.exec({ argv: ["no-such-command-xyz"], env: ENV });
    expect(nf.exitCode).toBe(127);
    expect(nf.stderr.toString()).toContain("no-such-command-xyz: command not found");
    const plain = join(dir, "not-exec.sh");
    writeFileSync(plain, "echo hi\n");
    chmodSync(plain, 0o644);
    const ne = await client.exec({ argv: [plain], env: ENV });
    expect(ne.exitCode).toBe(126);
    expect(ne.stderr.toString()).toContain("Permission denied");
  });

  test("a bad cwd is a guest_error, nothing runs", async () => {
    const err = await client.exec({ argv: ["true"], env: ENV, cwd: join(dir, "nope") }).catch((e) => e);
    expect(err).toBeInstanceOf(GuestError);
    expect(err.code).toBe("guest_error");
    expect(err.errno).toBe(2);
  });

  test("STARTED comes once the command is forked, with its pid, before its output; never for a refused exec", async () => {
    // The command waits (10 s at most) for a file that only the host's STARTED handler makes:
    // it prints its pid only if STARTED came while it ran.
    const go = join(dir, "started-go");
    const seen: string[] = [];
    const r = await client.exec({
      argv: [
        "sh",
        "-c",
        `i=0; while [ ! -e ${go} ]; do i=$((i+1)); [ $i -gt 500 ] && exit 1; sleep 0.02; done; echo $$`,
      ],
      env: ENV,
      onStdout: (b) => seen.push(`out:${b}`),
      onStarted: (pid) => {
        seen.push(`started:${pid}`);
        writeFileSync(go, "");
      },
    });
    expect(r.exitCode).toBe(0);
    // The pid STARTED names is the one the command's shell knows as $$, and the RESPONSE's.
    expect(r.pid).toBeGreaterThan(1);
    expect(seen).toEqual([`started:${r.pid}`, `out:${r.pid}\n`]);
    let refusedStarted = false;
    const err = await client
      .exec({ argv: ["true"], env: ENV, cwd: join(dir, "nope"), onStarted: () => (refusedStarted = true) })
      .catch((e) => e);
    expect(err).toBeInstanceOf(GuestError);
    expect(refusedStarted).toBe(false);
  });

  test("a background process records the guest pid STARTED names: the one its shell knows as $$", async () => {
    const table = new ProcessTable(() => {});
    const proc = await table.start(client, {
      argv: ["sh", "-c", "echo $$; exec sleep 30"],
      command: "sleep",
      env: Object.entries(ENV).map(([k, v]) => `${k}=${v}`),
      cwd: dir,
      uid: process.getuid?.() ?? 0,
      gid: process.getgid?.() ?? 0,
      keepAwake: false,
    });
    expect(proc.guestPid).toBeGreaterThan(1);
    expect(table.list()[0]?.guestPid).toBe(proc.guestPid);
    // In host test mode the guest's pids are this machine's: the process is alive under it.
    expect(alive(proc.guestPid!)).toBe(true);
    await waitFor(() => proc.out.text().length > 0, HANG_MS);
    expect(proc.out.text().toString()).toBe(`${proc.guestPid}\n`);
    await table.killAll();
    expect(alive(proc.guestPid!)).toBe(false);
    expect(table.list()[0]?.guestPid).toBe(proc.guestPid);
  });

  test("killed by a signal reports the signal", async () => {
    const r = await client.exec({ argv: ["sh", "-c", "kill -TERM $$"], env: ENV });
    expect(r.exitCode).toBeNull();
    expect(r.signal).toBe(15);
  });

  test("stdin inline, empty and large", async () => {
    const r = await client.exec({ argv: ["cat"], env: ENV, stdin: "hello\nworld" });
    expect(r.stdout.toString()).toBe("hello\nworld");
    const empty = await client.exec({ argv: ["cat"], env: ENV, stdin: "" });
    expect(empty.stdout.length).toBe(0);
    const none = await client.exec({ argv: ["cat"], env: ENV }); // /dev/null
    expect(none.exitCode).toBe(0);
    const big = Buffer.alloc(700_000, 0x61);
    const wc = await client.exec({ argv: ["wc", "-c"], env: ENV, stdin: big });
    expect(wc.stdout.toString().trim()).toBe("700000");
  });

  test("stdin streamed as STDIN frames, then EOF", async () => {
    async function* chunks() {
      yield "first ";
      await Bun.sleep(50);
      yield Buffer.alloc(200_000, 0x62);
      yield " last";
    }
    const r = await client.exec({ argv: ["sh", "-c", "cat | wc -c"], env: ENV, stdin: chunks() });
    expect(r.stdout.toString().trim()).toBe(String(6 + 200_000 + 5));
  });

  test("output over maxOutput is truncated with the flag", async () => {
    const r = await client.exec({ argv: ["head", "-c", "5000", "/dev/zero"], env: ENV, maxOutput: 1000 });
    expect(r.stdout.length).toBe(1000);
    expect(r.stdoutTruncated).toBe(true);
    expect(r.exitCode).toBe(0); // the writer was not killed: the rest was read and discarded
    const d = await client.exec({ argv: ["head", "-c", "3000000", "/dev/zero"], env: ENV });
    // Default cap 1 MiB, less the few KiB the RESPONSE's other fields need to fit one frame.
    expect(d.stdout.length).toBeLessThanOrEqual(1 << 20);
    expect(d.stdout.length).toBeGreaterThan((1 << 20) - 8192);
    expect(d.stdoutTruncated).toBe(true);
    const both = await client.exec({
      argv: ["sh", "-c", "head -c 1000000 /dev/zero; head -c 1000000 /dev/zero >&2"],
      env: ENV,
    });
    // Both captures together are clamped to fit one RESPONSE frame.
    expect(both.stdout.length + both.stderr.length).toBeLessThanOrEqual(MAX_PAYLOAD - HEADER_LEN);
    expect(both.stdoutTruncated && both.stderrTruncated).toBe(true);
  });

  test("streamed output arrives as frames before the answer", async () => {
    // The command prints "a", then waits for a file that only the host's handler of that "a"
    // frame makes: it can end (with "b") only if "a" came while it ran. Bounded: after 10 s of
    // waiting it prints "no-frame" instead.
    const go = join(dir, "streamed-go");
    const seen: Array<[string, string]> = [];
    const r = await client.exec({
      argv: [
        "sh",
        "-c",
        `echo a; i=0; while [ ! -e ${go} ]; do i=$((i+1)); [ $i -gt 500 ] && { echo no-frame; exit 1; }; sleep 0.02; done; echo b; echo c >&2`,
      ],
      env: ENV,
      onStdout: (b) => {
        seen.push(["out", b.toString()]);
        if (b.toString().includes("a")) writeFileSync(go, "");
      },
      onStderr: (b) => seen.push(["err", b.toString()]),
    });
    expect(r.stdout.toString()).toBe("a\nb\n");
    expect(r.stderr.toString()).toBe("c\n");
    expect(r.exitCode).toBe(0);
    expect(seen[0]).toEqual(["out", "a\n"]);
  });

  test("streamed output is capped by maxOutput on the client", async () => {
    let total = 0;
    const r = await client.exec({
      argv: ["head", "-c", "300000", "/dev/zero"],
      env: ENV,
      maxOutput: 1000,
      onStdout: (b) => {
        total += b.length;
      },
    });
    expect(total).toBe(300000);
    expect(r.stdout.length).toBe(1000);
    expect(r.stdoutTruncated).toBe(true);
  });

  test("timeout kills the whole process group, grandchildren too", async () => {
    const t0 = Date.now();
    const r = await client.exec({
      // A child and a grandchild, each printing its pid, all waiting far past the timeout.
      argv: ["sh", "-c", 'sleep 30 & echo $!; sh -c "sleep 31 & echo \\$!; wait" & wait'],
      env: ENV,
      timeoutMs: 300,
    });
    // Only catches a hang: without the timeout the answer waits the 30 s of its sleeps.
    expect(Date.now() - t0).toBeLessThan(HANG_MS);
    expect(r.timedOut).toBe(true);
    expect(r.signal).toBe(9);
    const pids = r.stdout.toString().trim().split("\n").map(Number);
    backgroundPids.push(...pids);
    expect(pids.length).toBe(2);
    for (const pid of pids) {
      expect(pid).toBeGreaterThan(1);
      expect(await waitDead(pid)).toBe(true);
    }
  });

  test("a background process survives and does not hold the answer", async () => {
    const t0 = Date.now();
    const r = await client.exec({ argv: ["sh", "-c", "sleep 30 & echo $!; echo started"], env: ENV });
    // Only catches a hang: an answer held by the background sleep would come after its 30 s.
    expect(Date.now() - t0).toBeLessThan(HANG_MS);
    const [pidLine, started] = r.stdout.toString().trim().split("\n");
    expect(started).toBe("started");
    const pid = Number(pidLine);
    backgroundPids.push(pid);
    expect(r.exitCode).toBe(0);
    await Bun.sleep(100);
    expect(alive(pid)).toBe(true);
  });

  test("a background writer on the inherited stdout never gets SIGPIPE", async () => {
    const marker = join(dir, "late-writer-done");
    const r = await client.exec({
      argv: ["sh", "-c", `(sleep 0.3; echo late; echo late2 >&2; sleep 0.1; touch ${marker}) & echo started`],
      env: ENV,
    });
    expect(r.stdout.toString()).toBe("started\n");
    expect(await waitFor(() => existsSync(marker), 3000)).toBe(true);
  });

  test("abort sends CANCEL: the group is killed and the answer comes with signal 9", async () => {
    const ac = new AbortController();
    const t0 = Date.now();
    setTimeout(() => ac.abort(), 200);
    const r = await client.exec({ argv: ["sh", "-c", "sleep 30 & sleep 30"], env: ENV, signal: ac.signal });
    // Only catches a hang: without the CANCEL the answer comes after the 30 s sleep.
    expect(Date.now() - t0).toBeLessThan(HANG_MS);
    expect(r.signal).toBe(9);
    expect(r.timedOut).toBe(false);
  });

  test("many execs run concurrently on their own streams", async () => {
    // A barrier: each exec marks its start, then waits until all 12 have started before it
    // prints its number. Run one after another, the first would wait alone: after 10 s it
    // prints "alone" instead, and the check below fails.
    const barrier = mkdtempSync(join(dir, "barrier-"));
    const N = 12;
    const wait = `touch ${barrier}/$N; i=0; while [ "$(ls ${barrier} | wc -l)" -lt ${N} ]; do i=$((i+1)); [ $i -gt 500 ] && { echo alone; exit 1; }; sleep 0.02; done; echo "$N"`;
    const results = await Promise.all(
      Array.from({ length: N }, (_, i) =>
        client.exec({ argv: ["sh", "-c", wait], env: { ...ENV, N: String(i) } }),
      ),
    );
    expect(results.map((r) => r.stdout.toString())).toEqual(results.map((_, i) => `${i}\n`));
  });

  test.skipIf(NOT_ROOT)("uid and gid are applied (as root)", async () => {
    const r = await client.exec({
      argv: ["sh", "-c", "id -u; id -g; id -G"],
      env: ENV,
      uid: 65534,
      gid: 65534,
    });
    expect(r.stdout.toString()).toBe("65534\n65534\n65534\n");
  });
});

describe("files and small ops", () => {
  test("writeFile makes parents, relative to cwd, atomically, with mode", async () => {
    await client.writeFile("sub/dir/f.txt", "data!", { cwd: dir, mode: 0o600 });
    const p = join(dir, "sub/dir/f.txt");
    expect(readFileSync(p, "utf8")).toBe("data!");
    expect(statSync(p).mode & 0o777).toBe(0o600);
    expect(statSync(join(dir, "sub/dir")).mode & 0o777).toBe(0o755);
    await client.writeFile(p, Buffer.from([0, 1, 2])); // absolute, replaces
    expect([...readFileSync(p)]).toEqual([0, 1, 2]);
    expect(statSync(p).mode & 0o777).toBe(0o644);
    expect(readdirSync(join(dir, "sub/dir"))).toEqual(["f.txt"]); // no temp files left
  });

  test.skipIf(NOT_ROOT)("writeFile with uid and gid makes a file of that owner (as root)", async () => {
    await client.writeFile("owned", "x", { cwd: dir, uid: 65534, gid: 65534 });
    expect(statSync(join(dir, "owned")).uid).toBe(65534);
    expect(statSync(join(dir, "owned")).gid).toBe(65534);
  });

  test("a file larger than a frame is streamed in chunks and arrives byte-exact", async () => {
    const big = Buffer.from(crypto.getRandomValues(new Uint8Array(5 * 1024 * 1024 + 17)));
    await client.writeFile("streamed/big.bin", big, { cwd: dir, mode: 0o640 });
    const p = join(dir, "streamed/big.bin");
    expect(readFileSync(p).equals(big)).toBe(true);
    expect(statSync(p).mode & 0o777).toBe(0o640);
    expect(readdirSync(join(dir, "streamed"))).toEqual(["big.bin"]); // no temp files left
    // A second streamed write replaces it whole.
    const other = Buffer.alloc(MAX_PAYLOAD + 1, 7);
    await client.writeFile(p, other);
    expect(readFileSync(p).equals(other)).toBe(true);
    expect(readdirSync(join(dir, "streamed"))).toEqual(["big.bin"]);
  });

  test("a refused write is a guest_error with the reason and leaves nothing behind", async () => {
    writeFileSync(join(dir, "plain"), "keep");
    const big = Buffer.alloc(2 * MAX_PAYLOAD, 1);
    // Through a regular file: refused before any content is written (ENOTDIR).
    for (const data of [Buffer.from("small"), big]) {
      const e = await client.writeFile("plain/x", data, { cwd: dir }).catch((err) => err);
      expect(e).toBeInstanceOf(GuestError);
      expect(e.code).toBe("guest_error");
      expect(e.errno).toBe(20);
      expect(e.message).toContain("Not a directory");
    }
    // Onto a directory: refused at the rename, after every chunk was written (EISDIR); the temp
    // file goes with it.
    mkdirSync(join(dir, "adir"), { recursive: true });
    writeFileSync(join(dir, "adir/inside"), "x");
    const e = await client.writeFile("adir", big, { cwd: dir }).catch((err) => err);
    expect(e.code).toBe("guest_error");
    expect(e.errno).toBe(21);
    expect(readdirSync(dir).filter((f) => f.includes("sbx-tmp"))).toEqual([]);
    expect(readdirSync(join(dir, "adir"))).toEqual(["inside"]);
    expect(readFileSync(join(dir, "plain"), "utf8")).toBe("keep");
    await client.ping(); // the channel is fine: late chunks of the refused write were dropped
  });

  test("readFile with size, truncation and errors", async () => {
    writeFileSync(join(dir, "r.txt"), "0123456789");
    const all = await client.readFile("r.txt", { cwd: dir });
    expect(all.data.toString()).toBe("0123456789");
    expect(all.size).toBe(10);
    expect(all.truncated).toBe(false);
    const part = await client.readFile(join(dir, "r.txt"), { maxBytes: 4 });
    expect(part.data.toString()).toBe("0123");
    expect(part.size).toBe(10);
    expect(part.truncated).toBe(true);
    const proc = await client.readFile("/proc/self/status", { maxBytes: 5 });
    expect(proc.truncated).toBe(true);
    const missing = await client.readFile("nope", { cwd: dir }).catch((e) => e);
    expect(missing).toBeInstanceOf(GuestError);
    expect(missing.code).toBe("guest_error");
    expect(missing.errno).toBe(2);
    const isDir = await client.readFile(dir).catch((e) => e);
    expect(isDir.errno).toBe(21);
  });

  test("file ops: reads at an offset and as a stream, LIST_DIR (bounded), REMOVE, FS_UID", async () => {
    const big = crypto.getRandomValues(new Uint8Array(2.5 * 1024 * 1024));
    writeFileSync(join(dir, "big.bin"), big);
    const mid = await client.readFile(join(dir, "big.bin"), { offset: 1024 * 1024, maxBytes: 10 });
    expect([...mid.data]).toEqual([...big.subarray(1024 * 1024, 1024 * 1024 + 10)]);
    expect(mid.truncated).toBe(true);
    const tail = await client.readFile(join(dir, "big.bin"), { offset: big.length - 3 });
    expect(tail.data.length).toBe(3);
    expect(tail.truncated).toBe(false);
    const { stream, size } = await readFileStream(client, join(dir, "big.bin"), { maxBytes: 1 << 30 });
    expect(size).toBe(big.length);
    const got = Buffer.from(await new Response(stream).arrayBuffer());
    expect(got.equals(Buffer.from(big))).toBe(true);
    // Past maxBytes a stream errors (a file that never ends, such as /dev/zero).
    const zero = await readFileStream(client, "/dev/zero", { maxBytes: 3 * 1024 * 1024 });
    expect(await new Response(zero.stream).arrayBuffer().catch((e) => e)).toBeInstanceOf(GuestError);

    const d = join(dir, "ls");
    mkdirSync(join(d, "sub"), { recursive: true });
    for (let i = 0; i < 5; i++) writeFileSync(join(d, `f${i}`), "x".repeat(i));
    const all = await listDir(client, d);
    expect(all.truncated).toBe(false);
    expect(all.entries.map((e) => e.name).sort()).toEqual(["f0", "f1", "f2", "f3", "f4", "sub"]);
    expect(all.entries.find((e) => e.name === "f3")).toMatchObject({ type: "file", size: 3 });
    expect(all.entries.find((e) => e.name === "sub")?.type).toBe("dir");
    const some = await listDir(client, d, { max: 2 });
    expect(some.entries.length).toBe(2);
    expect(some.truncated).toBe(true);

    expect((await removePath(client, d).catch((e) => e)).errno).toBe(39); // ENOTEMPTY
    await removePath(client, join(d, "f0"));
    await removePath(client, join(d, "sub"));
    expect(existsSync(join(d, "f0")) || existsSync(join(d, "sub"))).toBe(false);

    // As uid/gid 65534 a root-only directory refuses reads and writes; root's call passes.
    const locked = join(dir, "locked");
    mkdirSync(locked, { mode: 0o700 });
    writeFileSync(join(locked, "s"), "secret");
    chmodSync(dir, 0o755);
    const as = { fsUid: 65534, fsGid: 65534 };
    expect((await client.readFile(join(locked, "s"), as).catch((e) => e)).errno).toBe(13);
    expect((await client.writeFile(join(locked, "w"), "x", as).catch((e) => e)).errno).toBe(13);
    expect((await listDir(client, locked, as).catch((e) => e)).errno).toBe(13);
    expect((await removePath(client, join(locked, "s"), as).catch((e) => e)).errno).toBe(13);
    expect((await client.readFile(join(locked, "s"))).data.toString()).toBe("secret");
    // A file written as the user is the user's; afterwards the agent is root again.
    const open = join(dir, "open");
    mkdirSync(open);
    chmodSync(open, 0o1777);
    await client.writeFile(join(open, "mine"), "x", as);
    expect(statSync(join(open, "mine")).uid).toBe(65534);
    await client.writeFile(join(locked, "root"), "x");
    expect(statSync(join(locked, "root")).uid).toBe(0);
  });

  test("hello, ping, entropy, seed, clock, hostname, sync", async () => {
    const h = await client.hello();
    expect(h.protoVersion).toBe(1);
    expect(h.agentVersion).toContain("sandboxd-agent");
    expect(h.bootId).toBe(readFileSync("/proc/sys/kernel/random/boot_id", "utf8").trim());
    expect(h.uptimeMs).toBeGreaterThan(0);
    await client.ping();
    await client.entropy(crypto.getRandomValues(new Uint8Array(64)));
    const r = await client.exec({
      argv: ["true"],
      env: ENV,
      seed: crypto.getRandomValues(new Uint8Array(32)),
    });
    expect(r.seedAck).toBe(true);
    const noSeed = await client.exec({ argv: ["true"], env: ENV });
    expect(noSeed.seedAck).toBe(false);
    await client.setClock(new Date()); // host mode: answered, the host clock is left alone
    await client.setHostname("sbx-test"); // host mode: answered, the host name is left alone
    await client.sync();
  });
});

describe("connection", () => {
  test("disconnect: pending requests reject at once; agent, execs and background processes live on", async () => {
    const marker = join(dir, "survived-disconnect");
    const bg = await client.exec({ argv: ["sh", "-c", "sleep 30 & echo $!"], env: ENV });
    const bgPid = Number(bg.stdout.toString().trim());
    backgroundPids.push(bgPid);
    const started = join(dir, "started-before-disconnect");
    const running = client.exec({
      argv: ["sh", "-c", `touch ${started}; sleep 2; touch ${marker}`],
      env: ENV,
    });
    expect(await waitFor(() => existsSync(started))).toBe(true); // the exec runs in the agent
    client.close();
    const err = await running.catch((e) => e);
    // At once: rejected while the exec still runs (it ends 2 s after it started).
    expect(existsSync(marker)).toBe(false);
    expect(err).toBeInstanceOf(GuestError);
    expect(err.code).toBe("guest_disconnected");
    const after = await client.ping().catch((e) => e);
    expect(after.code).toBe("guest_disconnected");

    client = await accept(); // the agent reconnects within ~50 ms
    await client.ping();
    expect(agent.exitCode).toBeNull();
    expect(await waitFor(() => existsSync(marker))).toBe(true); // the exec kept running
    expect(alive(bgPid)).toBe(true);
    const r = await client.exec({ argv: ["echo", "again"], env: ENV });
    expect(r.stdout.toString()).toBe("again\n");
  });

  test("the agent dying rejects everything pending with guest_disconnected", async () => {
    // A second, throwaway agent on its own socket, so the shared one stays up.
    const sock2 = join(dir, "agent2.sock");
    const l2 = await GuestListener.listen(sock2);
    const a2 = spawn([bin, "--port", sock2], { stdin: "ignore", stdout: "ignore", stderr: "ignore" });
    try {
      const c2 = await l2.accept();
      // Each marks its start, then outlives the killed agent (short, so no orphan lingers).
      const pending = [1, 2].map((i) =>
        c2.exec({ argv: ["sh", "-c", `touch ${dir}/dying-${i}; sleep 3`], env: ENV }).catch((e) => e),
      );
      expect(await waitFor(() => existsSync(`${dir}/dying-1`) && existsSync(`${dir}/dying-2`))).toBe(true);
      a2.kill("SIGKILL");
      const errs = await Promise.all(pending);
      for (const e of errs) expect(e.code).toBe("guest_disconnected");
      expect(c2.closed).toBe(true);
    } finally {
      a2.kill("SIGKILL");
      await a2.exited;
      await l2.close();
    }
  });

  test("garbage bytes are survived: the agent resyncs on HELLO", async () => {
    // Swap the listener for a raw server so we can write bytes that are not frames.
    client.close();
    await listener.close();
    const raw: Server = createServer();
    const conn = new Promise<Socket>((resolve) => raw.once("connection", resolve));
    await new Promise<void>((resolve) => raw.listen(sock, resolve));
    try {
      const s = await conn;
      const badVersion = Buffer.from([0x42, 0x53, 9, 2, 1, 0, 0, 0, 0, 0, 0, 0]);
      const oversize = Buffer.from([0x42, 0x53, 1, 2, 1, 0, 0, 0, 0xff, 0xff, 0xff, 0x7f]);
      const junk = Buffer.from(Array.from({ length: 5000 }, (_, i) => (i * 7919 + 13) & 0xff));
      s.write(Buffer.concat([Buffer.from("GARBAGE!"), badVersion, oversize, junk]));
      const { GuestClient } = await import("./client.ts");
      const c = await GuestClient.fromSocket(s, { onLog: (l) => logs.push(l) });
      await c.ping();
      const r = await c.exec({ argv: ["echo", "still here"], env: ENV });
      expect(r.stdout.toString()).toBe("still here\n");
      expect(logs.some((l) => l.includes("malformed frame header"))).toBe(true);
      c.close();
    } finally {
      await new Promise<void>((resolve) => raw.close(() => resolve()));
      listener = await GuestListener.listen(sock);
      client = await accept();
    }
    await client.ping();
    expect(agent.exitCode).toBeNull();
  });
});

describe("tunnels (OP CONNECT)", () => {
  /** A loopback TCP server on this host standing in for a service inside the guest. */
  async function tcpServer(
    onConn: (s: Socket) => void,
  ): Promise<{ port: number; server: Server; conns: Socket[] }> {
    const conns: Socket[] = [];
    const server = createServer((s) => {
      conns.push(s);
      onConn(s);
    });
    await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
    return { port: (server.address() as { port: number }).port, server, conns };
  }

  async function stop(srv: { server: Server; conns: Socket[] }): Promise<void> {
    for (const c of srv.conns) c.destroy();
    await new Promise<void>((resolve) => srv.server.close(() => resolve()));
  }

  async function readAll(r: ReadableStream<Uint8Array>): Promise<Buffer> {
    const parts: Uint8Array[] = [];
    for await (const c of r) parts.push(c);
    return Buffer.concat(parts);
  }

  function agentMemKb(field: "VmRSS"): number {
    const m = new RegExp(`${field}:\\s+(\\d+) kB`).exec(readFileSync(`/proc/${agent.pid}/status`, "utf8"));
    return Number(m?.[1] ?? 0);
  }

  test("echo through a tunnel to a loopback TCP server", async () => {
    const srv = await tcpServer((s) => s.pipe(s));
    try {
      const t = await client.openTunnel(srv.port);
      const w = t.writable.getWriter();
      const r = t.readable.getReader();
      await w.write(Buffer.from("hello, tunnel"));
      let got = "";
      while (got.length < 13) {
        const { value, done } = await r.read();
        if (done) break;
        got += Buffer.from(value).toString();
      }
      expect(got).toBe("hello, tunnel");
      t.close();
      await t.closed;
      expect(t.error).toBeUndefined();
    } finally {
      await stop(srv);
    }
  });

  test("24 MB each way with checksums under slow readers: back-pressure, bounded memory", async () => {
    const { createHash } = await import("node:crypto");
    const SIZE = 24 * 1024 * 1024;
    const pattern = (seed: number) => {
      const b = Buffer.allocUnsafe(SIZE);
      let x = seed;
      for (let i = 0; i < SIZE; i += 4) {
        x = (Math.imul(x, 1103515245) + 12345) >>> 0;
        b.writeUInt32LE(x, i);
      }
      return b;
    };
    const down = pattern(1); // server -> host
    const up = pattern(2); // host -> server
    const serverGot = createHash("sha256");
    let serverBytes = 0;
    const serverDone = Promise.withResolvers<void>();
    const srv = await tcpServer((s) => {
      s.write(down, () => s.end());
      // A slow reader inside the "guest": pauses 5 ms after every 256 KiB.
      let sincePause = 0;
      s.on("data", (c: Buffer) => {
        serverGot.update(c);
        serverBytes += c.length;
        sincePause += c.length;
        if (sincePause >= 256 * 1024) {
          sincePause = 0;
          s.pause();
          setTimeout(() => s.resume(), 5);
        }
        if (serverBytes === SIZE) serverDone.resolve();
      });
    });
    try {
      const rssBefore = agentMemKb("VmRSS");
      let rssPeak = rssBefore;
      const sampler = setInterval(() => {
        rssPeak = Math.max(rssPeak, agentMemKb("VmRSS"));
      }, 10);
      const t = await client.openTunnel(srv.port);
      const writer = (async () => {
        const w = t.writable.getWriter();
        for (let off = 0; off < SIZE; off += 1 << 20) await w.write(up.subarray(off, off + (1 << 20)));
        w.releaseLock();
      })();
      // The host reader is slow too: 5 ms after every 512 KiB.
      const hostGot = createHash("sha256");
      let hostBytes = 0;
      let since = 0;
      const r = t.readable.getReader();
      for (;;) {
        const { value, done } = await r.read();
        if (done) break;
        hostGot.update(value);
        hostBytes += value.length;
        since += value.length;
        if (since >= 512 * 1024) {
          since = 0;
          await Bun.sleep(5);
        }
      }
      await writer.catch(() => {});
      await serverDone.promise;
      clearInterval(sampler);
      expect(hostBytes).toBe(SIZE);
      expect(hostGot.digest("hex")).toBe(createHash("sha256").update(down).digest("hex"));
      expect(serverBytes).toBe(SIZE);
      expect(serverGot.digest("hex")).toBe(createHash("sha256").update(up).digest("hex"));
      // Never more than one window waited on the host side...
      expect(t.peakBuffered).toBeLessThanOrEqual(256 * 1024);
      // ...and the agent (PID 1 in a VM) grew by far less than the 48 MB that went through it.
      expect(rssPeak - rssBefore).toBeLessThan(8 * 1024);
      await t.closed;
    } finally {
      await stop(srv);
    }
  });

  test("a refused port is a guest_error with ECONNREFUSED", async () => {
    const srv = await tcpServer(() => {});
    const port = srv.port;
    await stop(srv); // nothing listens there now
    const err = await client.openTunnel(port).catch((e) => e);
    expect(err).toBeInstanceOf(GuestError);
    expect(err.code).toBe("guest_error");
    expect(err.errno).toBe(111);
    expect(err.message).toContain("connect");
    const bad = await client.openTunnel(70000).catch((e) => e);
    expect(bad.code).toBe("guest_error");
    await client.ping(); // the agent is fine
  });

  test("the guest side closing ends the host side after its data, and the reverse", async () => {
    const srv = await tcpServer((s) => {
      s.once("data", (c: Buffer) => {
        if (c.toString() === "bye") s.end("later\n"); // server closes after answering
      });
    });
    try {
      const t = await client.openTunnel(srv.port);
      const w = t.writable.getWriter();
      await w.write(Buffer.from("bye"));
      expect((await readAll(t.readable)).toString()).toBe("later\n");
      await t.closed;
      expect(t.error).toBeUndefined();
      expect(await w.write(Buffer.from("more")).catch((e) => e)).toBeInstanceOf(Error);

      // The host closing: the server sees its socket end.
      const t2 = await client.openTunnel(srv.port);
      expect(await waitFor(() => srv.conns.length === 2)).toBe(true);
      const ended = new Promise<void>((resolve) => srv.conns[1]!.once("close", () => resolve()));
      await t2.writable.getWriter().close(); // ending our side closes the tunnel (no half-close)
      await ended;
      await t2.closed;
    } finally {
      await stop(srv);
    }
  });

  test("50 concurrent tunnels keep their bytes apart", async () => {
    const srv = await tcpServer((s) => s.pipe(s));
    try {
      const results = await Promise.all(
        Array.from({ length: 50 }, async (_, i) => {
          const t = await client.openTunnel(srv.port);
          const payload = Buffer.alloc(100_000 + i, i);
          const w = t.writable.getWriter();
          const r = t.readable.getReader();
          void w.write(payload);
          const parts: Uint8Array[] = [];
          let n = 0;
          while (n < payload.length) {
            const { value, done } = await r.read();
            if (done) break;
            parts.push(value);
            n += value.length;
          }
          t.close();
          await t.closed;
          return Buffer.concat(parts).equals(payload);
        }),
      );
      expect(results.every(Boolean)).toBe(true);
      await client.ping();
    } finally {
      await stop(srv);
    }
  });

  test("host disconnect and a new HELLO close every guest tunnel", async () => {
    const srv = await tcpServer(() => {});
    try {
      const t1 = await client.openTunnel(srv.port);
      const t2 = await client.openTunnel(srv.port);
      expect(await waitFor(() => srv.conns.length === 2)).toBe(true);
      const closedBoth = Promise.all(
        srv.conns.map((c) => new Promise((resolve) => c.once("close", resolve))),
      );
      client.close();
      await t1.closed;
      await t2.closed;
      expect(t1.error && (t1.error as GuestError).code).toBe("guest_disconnected");
      expect(
        await t2.readable
          .getReader()
          .read()
          .catch((e) => e),
      ).toBeInstanceOf(GuestError);
      await closedBoth; // the agent closed its sockets when the host went away
      client = await accept();

      // HELLO from the host (what a restored fork child's host sends first) ends old tunnels too.
      const t3 = await client.openTunnel(srv.port);
      expect(await waitFor(() => srv.conns.length === 3)).toBe(true);
      const closed3 = new Promise((resolve) => srv.conns[2]!.once("close", resolve));
      await client.hello();
      await closed3;
      expect(t3.isClosed).toBe(true);
      expect(logs.some((l) => l.includes("tunnel(s) closed: host said HELLO"))).toBe(true);
      await client.ping();
    } finally {
      await stop(srv);
    }
  });
});

describe("terminals (OP PTY)", () => {
  /** Reads the PTY tunnel's bytes into `text` as they come; `done` once it ends. */
  function collect(t: { readable: ReadableStream<Uint8Array> }) {
    const out = { text: "", ended: false, error: undefined as unknown };
    const done = (async () => {
      try {
        for await (const chunk of t.readable) out.text += Buffer.from(chunk).toString();
      } catch (err) {
        out.error = err;
      }
      out.ended = true;
    })();
    return { out, done };
  }

  /** Waits for `re` in what the shell wrote after `line` was typed (bash's bracketed-paste mode
   * ends a command's echo with `\r` rather than `\r\n`, hence `[\r\n]` before output lines). */
  async function typeAndWait(
    w: WritableStreamDefaultWriter<Uint8Array>,
    out: { text: string },
    line: string,
    re: RegExp,
  ): Promise<RegExpMatchArray | null> {
    const from = out.text.length;
    await w.write(Buffer.from(`${line}\r`));
    await waitFor(() => re.test(out.text.slice(from)), 3_000);
    const m = out.text.slice(from).match(re);
    if (!m) throw new Error(`no ${re} after typing ${line}: ${JSON.stringify(out.text)}`);
    return m;
  }

  test("the image's shell on a terminal: typed input, TERM, resize, and exit ends the tunnel cleanly", async () => {
    const t = await client.openPty({ cols: 80, rows: 24, env: [`PATH=${ENV.PATH}`] });
    const { out, done } = collect(t);
    const w = t.writable.getWriter();
    expect(await typeAndWait(w, out, "echo $((6*7))", /[\r\n]42\r\n/)).not.toBeNull();
    // The open answer names the shell by its guest pid.
    expect(t.pid).toBeGreaterThan(1);
    expect(await typeAndWait(w, out, "echo pid=$$", new RegExp(`[\r\n]pid=${t.pid}\r\n`))).not.toBeNull();
    expect(await typeAndWait(w, out, 'echo "term=$TERM"', /[\r\n]term=xterm-256color\r\n/)).not.toBeNull();
    expect(await typeAndWait(w, out, "stty size", /[\r\n]24 80\r\n/)).not.toBeNull();
    t.resize(132, 43);
    expect(await typeAndWait(w, out, "stty size", /[\r\n]43 132\r\n/)).not.toBeNull();
    // The terminal is the shell's controlling tty, in its own session.
    expect(
      await typeAndWait(w, out, "test $$ = $(ps -o sid= -p $$) && tty", /[\r\n]\/dev\/pts\/\d+\r\n/),
    ).not.toBeNull();
    await w.write(Buffer.from("exit\r"));
    await done;
    expect({ ended: out.ended, error: out.error }).toEqual({ ended: true, error: undefined });
  });

  test("closing the tunnel kills the shell's session, a job in its own group that ignores SIGHUP too", async () => {
    const t = await client.openPty({ cols: 80, rows: 24, env: [`PATH=${ENV.PATH}`] });
    const { out } = collect(t);
    const w = t.writable.getWriter();
    // The job ignores SIGHUP and has its own process group (job control): only the SIGKILL to
    // the whole session can end it.
    const m = await typeAndWait(
      w,
      out,
      '(trap "" HUP; exec sleep 4343) & echo pids=$$,$!',
      /pids=(\d+),(\d+)/,
    );
    expect(m).not.toBeNull();
    const [shell, job] = [Number(m![1]), Number(m![2])];
    backgroundPids.push(job);
    expect([alive(shell), alive(job)]).toEqual([true, true]);
    w.releaseLock();
    t.close();
    // SIGHUP at once, SIGKILL to the session 1 s later (pty.c PTY_KILL_GRACE_MS).
    expect([await waitDead(shell, 5000), await waitDead(job, 5000)]).toEqual([true, true]);
  });

  test("the shell's exit ends the terminal although a background job still holds it; the job is killed", async () => {
    const t = await client.openPty({ cols: 80, rows: 24, env: [`PATH=${ENV.PATH}`] });
    const { out, done } = collect(t);
    const w = t.writable.getWriter();
    const m = await typeAndWait(w, out, '(trap "" HUP; exec sleep 4545) & echo job=$!', /job=(\d+)/);
    const job = Number(m![1]);
    backgroundPids.push(job);
    await w.write(Buffer.from("exit\r"));
    await done;
    expect({ ended: out.ended, error: out.error }).toEqual({ ended: true, error: undefined });
    expect(await waitDead(job, 5000)).toBe(true);
  });

  test("a size out of range is refused with EINVAL; nothing is left open", async () => {
    const err = await client.openPty({ cols: 0, rows: 24 }).catch((e) => e);
    expect(err).toBeInstanceOf(GuestError);
    expect(err.errno).toBe(22);
    const big = await client.openPty({ cols: 80, rows: 70000 }).catch((e) => e);
    expect(big.errno).toBe(22);
  });
});
