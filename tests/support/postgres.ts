/**
 * Starts a throwaway PostgreSQL for tests: initdb into a temp dir, a free port, trust auth on
 * localhost, stopped and removed by `stop()`. The port is probed free and then bound by the
 * server, and another process (test files run several at once) may take it in between: a start
 * that fails for an address in use is tried again on a fresh port, a few times. As root it runs the server as the `postgres` user
 * (or `nobody`; PostgreSQL refuses to run as root). Returns null when the binaries are absent.
 */
import { spawnSync } from "node:child_process";
import { chmodSync, chownSync, existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";

const BIN_DIRS = ["/usr/lib/postgresql/17/bin", "/usr/lib/postgresql/16/bin", "/usr/lib/postgresql/15/bin"];

export function findPgBin(): string | null {
  return BIN_DIRS.find((d) => existsSync(join(d, "initdb")) && existsSync(join(d, "pg_ctl"))) ?? null;
}

/** A TCP port free on loopback now (a server started next may take it; a race we accept in tests). */
export async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.once("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const addr = s.address();
      const port = typeof addr === "object" && addr ? addr.port : 0;
      s.close(() => resolve(port));
    });
  });
}

/** Starts tried on fresh ports before a port taken between probe and bind fails the suite. */
const START_TRIES = 5;
/** What the server logs when its port was taken (`could not bind IPv4 address ...: Address already in use`). */
const ADDR_IN_USE = /could not bind|could not create any TCP\/IP sockets|Address already in use/;

export interface TestPostgres {
  url: string;
  /** Stops the server and removes its files. */
  stop(): void;
  /** Stops the server (as a crash would: `-m immediate`), keeping its data for `start`. */
  halt(): void;
  /** Starts a halted server again on the same port and data. */
  start(): void;
}

export async function startPostgres(): Promise<TestPostgres | null> {
  const bin = findPgBin();
  if (!bin) return null;
  const dir = mkdtempSync(join(tmpdir(), "sandboxd-pg-"));
  const data = join(dir, "data");
  const asRoot = process.getuid?.() === 0;
  let user = "";
  if (asRoot) {
    // PostgreSQL refuses to run as root: use the `postgres` user, else `nobody`.
    for (const candidate of ["postgres", "nobody"]) {
      const id = spawnSync("id", ["-u", candidate], { encoding: "utf8" });
      const g = spawnSync("id", ["-g", candidate], { encoding: "utf8" });
      if (id.status === 0 && g.status === 0) {
        user = candidate;
        chownSync(dir, Number(id.stdout.trim()), Number(g.stdout.trim()));
        chmodSync(dir, 0o700);
        break;
      }
    }
    if (user === "") {
      rmSync(dir, { recursive: true, force: true });
      throw new Error("running as root needs a `postgres` or `nobody` user");
    }
  }
  const run = (args: string[]) => {
    const cmd = asRoot ? ["runuser", "-u", user, "--", ...args] : args;
    const r = spawnSync(cmd[0]!, cmd.slice(1), { encoding: "utf8", timeout: 60_000 });
    if (r.status !== 0) throw new Error(`${args.join(" ")} failed: ${r.stderr || r.stdout}`);
  };
  const logFile = join(dir, "log");
  const logLength = () => (existsSync(logFile) ? readFileSync(logFile, "utf8").length : 0);
  /** Whether the server's log since `from` says its port was taken. */
  const portTaken = (from: number) =>
    existsSync(logFile) && ADDR_IN_USE.test(readFileSync(logFile, "utf8").slice(from));
  const startOn = (p: number) =>
    run([
      join(bin, "pg_ctl"),
      "-D",
      data,
      "-l",
      logFile,
      "-w",
      "-o",
      `-p ${p} -k ${dir} -c listen_addresses=127.0.0.1 -c fsync=off`,
      "start",
    ]);
  const halt = () => run([join(bin, "pg_ctl"), "-D", data, "-m", "immediate", "-w", "stop"]);
  let port = 0;
  try {
    run([join(bin, "initdb"), "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"]);
    for (let attempt = 1; ; attempt++) {
      port = await freePort();
      const from = logLength();
      try {
        startOn(port);
        break;
      } catch (err) {
        if (attempt >= START_TRIES || !portTaken(from)) throw err;
      }
    }
  } catch (err) {
    rmSync(dir, { recursive: true, force: true });
    throw err;
  }
  /**
   * A halted server's restart, on the port its url names. The port cannot change, so a restart
   * that finds it taken (briefly, by another process's probe) is tried again for up to 5 s.
   */
  const start = () => {
    const deadline = performance.now() + 5_000;
    for (;;) {
      const from = logLength();
      try {
        startOn(port);
        return;
      } catch (err) {
        if (performance.now() > deadline || !portTaken(from)) throw err;
        Bun.sleepSync(200);
      }
    }
  };
  return {
    url: `postgres://postgres@127.0.0.1:${port}/postgres`,
    halt,
    start,
    stop: () => {
      try {
        halt();
      } catch {
        // already halted
      } finally {
        rmSync(dir, { recursive: true, force: true });
      }
    },
  };
}
