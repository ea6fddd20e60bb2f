/**
 * Starts a throwaway PostgreSQL for tests: initdb into a temp dir, a free port, trust auth on
 * localhost, stopped and removed by `stop()`. As root it runs the server as the `postgres` user
 * (or `nobody`; PostgreSQL refuses to run as root). Returns null when the binaries are absent.
 */
import { spawnSync } from "node:child_process";
import { chmodSync, chownSync, existsSync, mkdtempSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";

const BIN_DIRS = ["/usr/lib/postgresql/17/bin", "/usr/lib/postgresql/16/bin", "/usr/lib/postgresql/15/bin"];

export function findPgBin(): string | null {
  return BIN_DIRS.find((d) => existsSync(join(d, "initdb")) && existsSync(join(d, "pg_ctl"))) ?? null;
}

async function freePort(): Promise<number> {
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
  const port = await freePort();
  const start = () =>
    run([
      join(bin, "pg_ctl"),
      "-D",
      data,
      "-l",
      join(dir, "log"),
      "-w",
      "-o",
      `-p ${port} -k ${dir} -c listen_addresses=127.0.0.1 -c fsync=off`,
      "start",
    ]);
  const halt = () => run([join(bin, "pg_ctl"), "-D", data, "-m", "immediate", "-w", "stop"]);
  try {
    run([join(bin, "initdb"), "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"]);
    start();
  } catch (err) {
    rmSync(dir, { recursive: true, force: true });
    throw err;
  }
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
