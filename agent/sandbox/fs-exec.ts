/**
 * The filesystem ops of contracts/agent/fs-ops.ts (docs/agent-api.md "Filesystem ops"), each one
 * guest command run with a fixed argv as the call's user, never a shell line: GNU `find -printf`
 * for stat and listings (one NUL-separated record per entry, names of any bytes), `mkdir -p`,
 * `mv -T`, `rm -rf`. Like the file API they run beside any exec (a guest EXEC of their own, not
 * the foreground slot: never `busy`) with the VM held awake. The image needs GNU coreutils and
 * findutils (any Debian, Ubuntu or Fedora base; not busybox): without them the op fails with
 * `invalid_file` naming the missing command.
 *
 * File metadata (xattrs `user.e2b.<key>`, E2B's) is read and written by python3 running one
 * constant program (METADATA_PROGRAM) with its data on argv and stdin: `find -printf` cannot print
 * xattrs, and python3 is in every Debian catalog image. A listing asked with `metadata: true`
 * costs one more guest command, whatever its size. An image without python3: entries carry no
 * metadata, and setting some is `bad_request` saying so.
 */
import { posix } from "node:path";
import {
  type FsEntry,
  type FsOp,
  type FsOpAnswer,
  METADATA_XATTR_PREFIX,
} from "../../contracts/agent/fs-ops.ts";
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

/**
 * The metadata program, run as `python3 -c METADATA_PROGRAM MODE [PATH]`; never built from input.
 * `get`: stdin is NUL-separated paths; stdout one JSON line `[index, {key: value}]` per path with
 * `user.e2b.*` xattrs (symlinks not followed; a path it cannot read is skipped). `set PATH`: stdin
 * is a JSON `{key: value}` that replaces the file's `user.e2b.*` xattrs. `check`: nothing (python3
 * is there). A refusal is one line `PATH: REASON` on stderr, exit 1.
 */
export const METADATA_PROGRAM = `
import json, os, sys
P = ${JSON.stringify(METADATA_XATTR_PREFIX)}
mode = sys.argv[1]
if mode == "get":
    out = sys.stdout
    for i, p in enumerate(sys.stdin.buffer.read().split(b"\\0")):
        if not p:
            continue
        try:
            m = {}
            for n in os.listxattr(p, follow_symlinks=False):
                if n.startswith(P):
                    v = os.getxattr(p, n, follow_symlinks=False)
                    m[n[len(P):]] = v.decode("utf-8", "replace")
        except OSError:
            continue
        if m:
            out.write(json.dumps([i, m]) + "\\n")
elif mode == "set":
    p = sys.argv[2]
    want = json.load(sys.stdin)
    try:
        for n in os.listxattr(p):
            if n.startswith(P) and n[len(P):] not in want:
                os.removexattr(p, n)
        for k, v in want.items():
            os.setxattr(p, P + k, v.encode())
    except OSError as e:
        sys.stderr.write(p + ": " + (e.strerror or str(e)) + "\\n")
        sys.exit(1)
`;

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
    const withMetadata = async (a: FsOpAnswer, want: boolean | undefined) =>
      want ? await addMetadata(held.guest, user, a) : a;
    switch (op.op) {
      case "stat":
        return await withMetadata(await stat(run, path, op.depth), op.metadata);
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
        return await withMetadata({ entries: (await stat(run, to, 0)).entries }, op.metadata);
      }
      case "setMetadata": {
        const argv = op.check ? ["check"] : ["set", path];
        await runIn(held.guest, user, ["python3", "-c", METADATA_PROGRAM, ...argv], 64 * 1024, {
          stdin: JSON.stringify(op.metadata),
        }).catch((err) => {
          if (noPython(err)) {
            throw new SandboxdError(
              "bad_request",
              "file metadata needs python3 in the sandbox's image (it reads and writes the xattrs user.e2b.*), and this image has none",
            );
          }
          throw err;
        });
        return {};
      }
      case "remove":
        await run(["rm", "-rf", "--", path]);
        return {};
    }
  } finally {
    held.release();
  }
}

/** Whether `err` is the guest's "python3: command not found" (exit 127). */
function noPython(err: unknown): boolean {
  return (
    err instanceof SandboxdError &&
    (err.details as { command?: string } | undefined)?.command === "python3" &&
    /command not found/.test(err.message)
  );
}

/**
 * The entries of `a` with their metadata, read by one python3 run over all their paths. The
 * output is bounded like a listing's (FS_OP_MAX_OUTPUT); entries past a cut-short output, and all
 * of them in an image without python3, carry none.
 */
async function addMetadata(guest: GuestClient, user: ExecUser, a: FsOpAnswer): Promise<FsOpAnswer> {
  const entries = a.entries ?? [];
  if (entries.length === 0) return a;
  const paths = Buffer.concat(entries.flatMap((e) => [Buffer.from(e.path, "utf8"), Buffer.from([0])]));
  let out: Buffer;
  try {
    out = (
      await runIn(guest, user, ["python3", "-c", METADATA_PROGRAM, "get"], FS_OP_MAX_OUTPUT, { stdin: paths })
    ).stdout;
  } catch (err) {
    if (noPython(err)) return a;
    throw err;
  }
  for (const line of out.toString("utf8").split("\n")) {
    const rec = parseMetadataLine(line);
    const e = rec && entries[rec[0]];
    if (e) e.metadata = rec[1];
  }
  return a;
}

/**
 * One `[index, {key: value}]` line of the program's `get`, or undefined when it is not one.
 * Exported for its tests.
 */
export function parseMetadataLine(line: string): [number, Record<string, string>] | undefined {
  if (!line) return undefined;
  try {
    const v = JSON.parse(line) as unknown;
    if (!Array.isArray(v) || !Number.isInteger(v[0]) || typeof v[1] !== "object" || v[1] === null)
      return undefined;
    const m: Record<string, string> = {};
    for (const [k, x] of Object.entries(v[1] as object)) if (typeof x === "string") m[k] = x;
    return [v[0] as number, m];
  } catch {
    return undefined;
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
  opts: { stdin?: string | Buffer } = {},
): Promise<{ stdout: Buffer; truncated: boolean }> {
  const stdin = opts.stdin;
  const r = await guest.exec({
    // Streamed (cut into frames): a listing's paths can be megabytes.
    ...(stdin !== undefined
      ? {
          stdin: (async function* () {
            yield typeof stdin === "string" ? Buffer.from(stdin, "utf8") : stdin;
          })(),
        }
      : {}),
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
  // The metadata program's last argument is its mode or path, never the program itself.
  const target = argv[0] === "python3" ? (argv[4] ?? "") : (argv.at(-1) ?? "");
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
