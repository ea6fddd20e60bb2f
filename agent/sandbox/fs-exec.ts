/**
 * The filesystem ops of contracts/agent/fs-ops.ts (docs/agent-api.md "Filesystem ops"), each one
 * guest command run with a fixed argv as the call's user, never a shell line: GNU `find -printf`
 * for stat and listings (one NUL-separated record per entry, names of any bytes), `mkdir -p`,
 * `mv -T`, `rm -rf`. Like the file API they run beside any exec (a guest EXEC of their own, not
 * the foreground slot: never `busy`) with the VM held awake. The image needs GNU coreutils and
 * findutils (any Debian, Ubuntu or Fedora base; not busybox): without them the op fails with
 * `invalid_file` naming the missing command.
 */
import { posix } from "node:path";
import type { FsEntry, FsOp, FsOpAnswer } from "../../contracts/agent/fs-ops.ts";
import { MAX_LIST_ENTRIES } from "../../contracts/api/limits.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import type { GuestClient } from "../guest/client.ts";
import type { ExecUser } from "./exec.ts";
import { resolveExecUser } from "./exec-run.ts";
import type { SandboxManager } from "./manager.ts";

/**
 * One op's command in the guest. 90 s: a listing or removal of a large tree on a loaded host
 * takes seconds; past this the guest kills it and the op fails rather than holding the VM awake.
 * Below the gateway's 120 s deadline for a VM op, so the gateway hears why.
 */
export const FS_OP_TIMEOUT_MS = 90_000;
/**
 * A listing's output kept. 16 MiB: MAX_LIST_ENTRIES records of long paths (~1.6 KiB each); past
 * it the listing is `truncated`.
 */
const FS_OP_MAX_OUTPUT = 16 * 1024 * 1024;
/** Every field of a record, NUL-terminated: names may hold any other byte, newlines included. */
const FIELDS = ["%d", "%y", "%s", "%m", "%M", "%u", "%g", "%T@", "%l", "%p"];
const FORMAT = FIELDS.map((f) => `${f}\\0`).join("");
const PATH_ENV = { PATH: "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", LC_ALL: "C" };

const TYPES: Record<string, FsEntry["type"]> = { f: "file", d: "dir", l: "symlink" };

export async function fsOp(
  manager: Pick<SandboxManager, "holdGuest">,
  vmId: string,
  op: FsOp,
): Promise<FsOpAnswer> {
  const held = await manager.holdGuest(vmId);
  try {
    const user = await resolveExecUser(held.guest, op.user ?? String(held.image.user.uid));
    if (op.op === "home") return { home: user.home };
    const abs = (p: string) => posix.resolve(user.home, p);
    const run = (argv: string[], maxOutput = 64 * 1024) => runIn(held.guest, user, argv, maxOutput);
    const path = abs(op.path);
    switch (op.op) {
      case "stat":
        return await stat(run, path, op.depth);
      case "mkdir": {
        const before = await stat(run, path, 0).catch((err) => {
          if (err instanceof SandboxdError && err.code === "not_found") return undefined;
          throw err;
        });
        if (before) {
          if (before.entries?.[0]?.type !== "dir") {
            throw new SandboxdError("conflict", `${path} exists and is not a directory`, {
              details: { path },
            });
          }
          return { created: false, entries: before.entries };
        }
        await run(["mkdir", "-p", "--", path]);
        return { created: true, entries: (await stat(run, path, 0)).entries };
      }
      case "move": {
        const to = abs(op.to);
        await run(["mv", "-T", "--", path, to]);
        return { entries: (await stat(run, to, 0)).entries };
      }
      case "remove":
        await run(["rm", "-rf", "--", path]);
        return {};
    }
  } finally {
    held.release();
  }
}

type Run = (argv: string[], maxOutput?: number) => Promise<{ stdout: Buffer; truncated: boolean }>;

async function stat(run: Run, path: string, depth: number): Promise<FsOpAnswer> {
  const r = await run(["find", path, "-maxdepth", String(depth), "-printf", FORMAT], FS_OP_MAX_OUTPUT);
  const { entries, complete } = parseFindRecords(r.stdout);
  const truncated = r.truncated || !complete || entries.length > MAX_LIST_ENTRIES + 1;
  return { entries: entries.slice(0, MAX_LIST_ENTRIES + 1), ...(truncated ? { truncated: true } : {}) };
}

/**
 * `find -printf FORMAT` output as entries; a record cut short (output capped) is dropped and
 * `complete` is false. Exported for its tests.
 */
export function parseFindRecords(out: Buffer): { entries: FsEntry[]; complete: boolean } {
  const entries: FsEntry[] = [];
  let at = 0;
  for (;;) {
    const fields: string[] = [];
    let p = at;
    while (fields.length < FIELDS.length) {
      const nul = out.indexOf(0, p);
      if (nul < 0) break;
      fields.push(out.subarray(p, nul).toString("utf8"));
      p = nul + 1;
    }
    if (fields.length < FIELDS.length) return { entries, complete: at === out.length };
    at = p;
    const [d, y, s, m, perms, owner, group, t, link, path] = fields as [
      string,
      string,
      string,
      string,
      string,
      string,
      string,
      string,
      string,
      string,
    ];
    const type = TYPES[y] ?? "other";
    const entry: FsEntry = {
      name: posix.basename(path) || path,
      path,
      type,
      size: Number(s) || 0,
      mode: Number.parseInt(m, 8) || 0,
      permissions: perms,
      owner,
      group,
      mtimeMs: Math.round(Number(t) * 1000) || 0,
      depth: Number(d) || 0,
    };
    if (type === "symlink") entry.symlinkTarget = posix.resolve(posix.dirname(path), link);
    entries.push(entry);
  }
}

/** Runs `argv` as `user`; a failure is the API's error for the command's complaint. */
async function runIn(
  guest: GuestClient,
  user: ExecUser,
  argv: string[],
  maxOutput: number,
): Promise<{ stdout: Buffer; truncated: boolean }> {
  const r = await guest.exec({
    argv,
    env: { ...PATH_ENV, HOME: user.home, USER: user.name },
    cwd: "/",
    uid: user.uid,
    gid: user.gid,
    timeoutMs: FS_OP_TIMEOUT_MS,
    maxOutput,
    // Streamed so the cap is the host's (a frame would bound captured output to ~1 MiB).
    onStdout: () => {},
  });
  if (r.exitCode === 0) return { stdout: r.stdout, truncated: r.stdoutTruncated };
  // find lists what it could and exits 1 when a subdirectory is unreadable: keep the listing.
  if (argv[0] === "find" && r.exitCode === 1 && r.stdout.length > 0) {
    return { stdout: r.stdout, truncated: r.stdoutTruncated };
  }
  throw commandError(argv, r.stderr.toString("utf8").trim(), r.timedOut);
}

function commandError(argv: string[], stderr: string, timedOut: boolean): SandboxdError {
  const target = argv.at(-1) ?? "";
  const reason = stderr.split("\n")[0]?.slice(0, 500) ?? "";
  const details = { path: target, command: argv[0] };
  if (timedOut) {
    return new SandboxdError("invalid_file", `${argv[0]} did not finish within ${FS_OP_TIMEOUT_MS} ms`, {
      details,
    });
  }
  if (
    /No such file or directory/.test(reason) &&
    !/^(find|mv|mkdir|rm): (cannot execute|not found)/.test(reason)
  ) {
    return new SandboxdError("not_found", `${reason || target}: no such file or directory in the sandbox`, {
      details,
    });
  }
  if (/File exists|Not a directory/.test(reason)) return new SandboxdError("conflict", reason, { details });
  return new SandboxdError(
    "invalid_file",
    `${argv[0]} was refused by the sandbox: ${reason || "no reason given"}`,
    {
      details,
    },
  );
}
