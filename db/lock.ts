/**
 * One process at a time on a PGlite directory. PGlite is Postgres compiled to WASM inside the
 * process that opens it, with no lock of its own: two processes opening one directory are two
 * writers on the same files, and the second one's writes are lost or corrupt the first's. The
 * opener therefore holds `<dir>.lock`, a pid file checked for liveness (the gateway also runs
 * under Node and Deno, which have no flock(2); a pid file needs only node:fs). A holder that died
 * without releasing (SIGKILL, power loss) is detected by its pid being gone, or reused by another
 * process (the start time in /proc differs), and its lock is taken over.
 */

import { randomBytes } from "node:crypto";
import { linkSync, readFileSync, renameSync, unlinkSync, writeFileSync } from "node:fs";
import { SandboxdError } from "../contracts/errors.ts";

interface Holder {
  pid: number;
  /** Field 22 of /proc/<pid>/stat (clock ticks after boot): tells a reused pid apart. */
  start: string;
  /** Makes every lock file unique, so a takeover can tell which one it moved. */
  nonce: string;
  /** The holder's command line, for the message a second opener gets. */
  cmd: string;
}

function startTime(pid: number): string {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
    // The command name (field 2) is in parentheses and may hold spaces: split after the last ')'.
    return stat.slice(stat.lastIndexOf(")") + 2).split(" ")[19] ?? "";
  } catch {
    return "";
  }
}

function alive(h: Holder): boolean {
  try {
    process.kill(h.pid, 0);
  } catch (err) {
    // EPERM: the pid exists under another user; anything else (ESRCH): gone.
    if ((err as NodeJS.ErrnoException).code !== "EPERM") return false;
  }
  const start = startTime(h.pid);
  return start === "" || h.start === "" || start === h.start;
}

function readHolder(path: string): Holder | undefined {
  try {
    const h = JSON.parse(readFileSync(path, "utf8")) as Partial<Holder>;
    if (typeof h.pid !== "number" || typeof h.nonce !== "string") return undefined;
    return { pid: h.pid, start: String(h.start ?? ""), nonce: h.nonce, cmd: String(h.cmd ?? "") };
  } catch {
    return undefined;
  }
}

export interface DirLock {
  /** Removes the lock file if it is still ours. Idempotent. */
  release(): void;
}

/** Thrown when another live process holds the directory; `details.pid` names it. */
export function lockedError(dir: string, h: Holder): SandboxdError {
  return new SandboxdError(
    "conflict",
    `the PGlite database ${dir} is in use by process ${h.pid} (${h.cmd || "unknown command"}): ` +
      "only one process may open it. Stop that process first, give this one another --data-dir, " +
      "or put both on PostgreSQL (DATABASE_URL). `sandboxd key` and `sandboxd agent-token` reach " +
      "a running service through its operator socket instead",
    { details: { pid: h.pid } },
  );
}

/**
 * Takes `<dir>.lock` for this process or throws `conflict` naming the live holder. A stale lock
 * (holder gone) is moved aside under a unique name and checked to be the one judged stale before
 * it is removed, so two openers racing for one stale lock cannot both win.
 */
export function lockDir(dir: string): DirLock {
  const path = `${dir}.lock`;
  const me: Holder = {
    pid: process.pid,
    start: startTime(process.pid),
    nonce: randomBytes(8).toString("hex"),
    cmd: process.argv.slice(1).join(" ").slice(0, 200),
  };
  // Three tries: each lost race against another opener restarts the check; more than that is a
  // live contender, reported as such.
  for (let attempt = 0; attempt < 3; attempt++) {
    // The holder is written to a file of our own first and linked into place, so the lock file
    // is never seen empty: an empty one would read as stale to a racing opener, which would move
    // it aside and take the directory too (two writers on one PGlite directory corrupt it).
    const mine = `${path}.new.${me.nonce}`;
    writeFileSync(mine, JSON.stringify(me), { mode: 0o600 });
    try {
      linkSync(mine, path);
      unlinkSync(mine);
      let released = false;
      return {
        release() {
          if (released) return;
          released = true;
          if (readHolder(path)?.nonce === me.nonce) unlinkSync(path);
        },
      };
    } catch (err) {
      unlinkSync(mine);
      if ((err as NodeJS.ErrnoException).code !== "EEXIST") throw err;
    }
    const holder = readHolder(path);
    if (holder && alive(holder)) throw lockedError(dir, holder);
    // Stale (or unreadable: a holder killed while writing it). Move it aside, then make sure what
    // was moved is the file judged stale; if another opener's fresh lock was moved instead, put it
    // back (link fails if yet another lock appeared meanwhile, which then stands).
    const aside = `${path}.stale.${me.nonce}`;
    try {
      renameSync(path, aside);
    } catch {
      continue; // someone else moved it first
    }
    const moved = readHolder(aside);
    if (holder && moved && moved.nonce !== holder.nonce) {
      try {
        linkSync(aside, path);
      } catch {
        // a newer lock is in place
      }
    }
    unlinkSync(aside);
  }
  const holder = readHolder(path);
  if (holder) throw lockedError(dir, holder);
  throw new SandboxdError("conflict", `cannot take the lock ${path}: other processes keep racing for it`);
}
