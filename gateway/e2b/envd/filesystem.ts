/**
 * envd's `filesystem.Filesystem` service over the sandbox's files (docs/e2b.md "Filesystem"):
 * Stat, MakeDir, Move, ListDir and Remove are the agent's filesystem ops (contracts/agent/fs-ops.ts,
 * GNU tools run in the guest with a fixed argv as the call's user); WatchDir and the polling
 * watchers compare listings taken one after the other (no inotify: see the doc for what that
 * misses). The user is the one `Authorization: Basic base64(user:)` names, else the image's.
 */
import { create } from "@bufbuild/protobuf";
import { timestampFromMs } from "@bufbuild/protobuf/wkt";
import { Code, ConnectError, type HandlerContext, type ServiceImpl } from "@connectrpc/connect";
import type { FsEntry, FsOp, FsOpAnswer } from "../../../contracts/agent/fs-ops.ts";
import { MAX_FS_DEPTH } from "../../../contracts/agent/fs-ops.ts";
import { MAX_EXEC_USER_CHARS } from "../../../contracts/api/limits.ts";
import {
  type EntryInfo,
  EntryInfoSchema,
  EventType,
  type Filesystem,
  type FilesystemEvent,
  FilesystemEventSchema,
  FileType,
  type WatchDirResponse,
  WatchDirResponseSchema,
} from "../../../contracts/e2b/envd/filesystem_pb.ts";
import { SandboxdError } from "../../../contracts/errors.ts";
import type { Principal } from "../../auth/keys.ts";
import { wakeIfIdle } from "../../core/idle.ts";
import { beginUse, inTermsOf } from "../../core/sandboxes.ts";
import type { Deps } from "../../deps.ts";

/**
 * The sandbox and caller of a data-plane call (index.ts `EnvdTarget`, structurally: this module is
 * imported by index.ts and imports nothing of it).
 */
export interface EnvdTarget {
  principal: Principal;
  sandboxId: string;
}

/**
 * How often WatchDir lists the directory again. 500 ms: changes reach the client within about
 * half a second, and a watch costs two guest commands a second, not a busy loop.
 */
export const WATCH_POLL_MS = 500;
/**
 * A WatchDir stream with nothing to say sends a keepalive this often. 30 s: well inside the idle
 * timeouts of proxies between the SDK and the gateway.
 */
const WATCH_KEEPALIVE_MS = 30_000;
/**
 * Polling watchers (CreateWatcher) held per sandbox by one gateway. 16: a client watches a few
 * directories; each costs a listing per GetWatcherEvents and a copy of the listing in memory.
 */
export const MAX_WATCHERS_PER_SANDBOX = 16;
/**
 * A polling watcher nobody asked for events in this long is dropped (its listing freed). 10 min:
 * a client polls every few seconds; one that stopped without RemoveWatcher leaks nothing for long.
 */
export const WATCHER_IDLE_MS = 10 * 60_000;

/** The user an envd call names: `Authorization: Basic base64(user:)`; none is the image's user. */
export function envdUserOf(headers: Headers): string | undefined {
  const h = headers.get("authorization");
  if (!h) return undefined;
  const m = /^Basic\s+([A-Za-z0-9+/=]+)\s*$/i.exec(h);
  if (!m) throw new ConnectError("Authorization must be Basic base64(user:)", Code.InvalidArgument);
  const decoded = Buffer.from(m[1]!, "base64").toString("utf8");
  const user = decoded.split(":", 1)[0] ?? "";
  if (user.length > MAX_EXEC_USER_CHARS)
    throw new ConnectError("the user name is too long", Code.InvalidArgument);
  return user.length > 0 ? user : undefined;
}

/** A SandboxdError in Connect's terms (the SDK maps NotFound to its FileNotFoundError). */
export function connectErrorOf(err: unknown): unknown {
  if (!(err instanceof SandboxdError)) return err;
  const code =
    {
      not_found: Code.NotFound,
      conflict: Code.AlreadyExists,
      bad_request: Code.InvalidArgument,
      invalid_file: /Permission denied/.test(err.message) ? Code.PermissionDenied : Code.InvalidArgument,
      unauthorized: Code.Unauthenticated,
      forbidden: Code.PermissionDenied,
      payload_too_large: Code.ResourceExhausted,
      rate_limited: Code.ResourceExhausted,
      busy: Code.Unavailable,
    }[err.code as string] ?? Code.Internal;
  return new ConnectError(err.message, code, undefined, undefined, err);
}

/**
 * Runs a filesystem op of the agent on the target's sandbox: woken if idle, counted in flight like
 * a file transfer, errors restated in the sandbox's terms.
 */
export async function fsOpOn(deps: Deps, target: EnvdTarget, op: FsOp): Promise<FsOpAnswer> {
  await wakeIfIdle(deps, target.principal, target.sandboxId);
  const use = await beginUse(deps, target.principal, target.sandboxId);
  try {
    return await inTermsOf(use.row, use.agent.fsOp(use.row.vmId!, op));
  } finally {
    await use.end();
  }
}

const TYPE: Record<FsEntry["type"], FileType> = {
  file: FileType.FILE,
  dir: FileType.DIRECTORY,
  symlink: FileType.SYMLINK,
  other: FileType.UNSPECIFIED,
};

export function entryInfoOf(e: FsEntry): EntryInfo {
  return create(EntryInfoSchema, {
    name: e.name,
    type: TYPE[e.type],
    path: e.path,
    size: BigInt(e.size),
    mode: e.mode,
    permissions: e.permissions,
    owner: e.owner,
    group: e.group,
    modifiedTime: timestampFromMs(e.mtimeMs),
    ...(e.symlinkTarget !== undefined ? { symlinkTarget: e.symlinkTarget } : {}),
  });
}

function only(a: FsOpAnswer): FsEntry {
  const e = a.entries?.[0];
  if (!e) throw new ConnectError("the sandbox answered without the entry", Code.Internal);
  return e;
}

/** The watched directory's listing: relative name -> what a change is seen by. */
type Snapshot = Map<
  string,
  { type: FsEntry["type"]; size: number; mtimeMs: number; mode: number; e: FsEntry }
>;

async function snapshot(
  deps: Deps,
  target: EnvdTarget,
  path: string,
  user: string | undefined,
  recursive: boolean,
) {
  const a = await fsOpOn(deps, target, { op: "stat", path, user, depth: recursive ? MAX_FS_DEPTH : 1 });
  const root = a.entries?.[0];
  if (!root) throw new SandboxdError("not_found", `${path}: no such directory`);
  if (root.type !== "dir") throw new SandboxdError("bad_request", `path ${path} is not a directory`);
  const s: Snapshot = new Map();
  const prefix = root.path.endsWith("/") ? root.path : `${root.path}/`;
  for (const e of a.entries!.slice(1)) {
    s.set(e.path.slice(prefix.length), { type: e.type, size: e.size, mtimeMs: e.mtimeMs, mode: e.mode, e });
  }
  return s;
}

/**
 * What changed from `before` to `after`, in inotify's terms: a new name is CREATE (and WRITE for a
 * non-empty file), a gone one REMOVE, new bytes or mtime WRITE, new permission bits CHMOD. A rename
 * is a REMOVE and a CREATE; changes undone between two listings are not seen.
 */
export function diffSnapshots(before: Snapshot, after: Snapshot, includeEntry: boolean): FilesystemEvent[] {
  const out: FilesystemEvent[] = [];
  const ev = (name: string, type: EventType, e?: FsEntry) =>
    out.push(
      create(FilesystemEventSchema, { name, type, ...(includeEntry && e ? { entry: entryInfoOf(e) } : {}) }),
    );
  for (const [name, a] of after) {
    const b = before.get(name);
    if (!b || b.type !== a.type) {
      if (b) ev(name, EventType.REMOVE);
      ev(name, EventType.CREATE, a.e);
      if (a.type === "file" && a.size > 0) ev(name, EventType.WRITE, a.e);
      continue;
    }
    if (a.type !== "dir" && (a.size !== b.size || a.mtimeMs !== b.mtimeMs)) ev(name, EventType.WRITE, a.e);
    if (a.mode !== b.mode) ev(name, EventType.CHMOD, a.e);
  }
  for (const name of before.keys()) if (!after.has(name)) ev(name, EventType.REMOVE);
  return out;
}

interface Watcher {
  sandboxId: string;
  keyId: string;
  path: string;
  user: string | undefined;
  recursive: boolean;
  includeEntry: boolean;
  last: Snapshot;
  usedAtMs: number;
}

/** The service; one per gateway, holding its polling watchers. */
export function filesystemService(
  deps: Deps,
  /** index.ts `targetOf`: the call's sandbox and caller. */
  targetOf: (ctx: HandlerContext) => EnvdTarget,
): Partial<ServiceImpl<typeof Filesystem>> {
  const watchers = new Map<string, Watcher>();
  const sweep = () => {
    const now = deps.clock();
    for (const [id, w] of watchers) if (now - w.usedAtMs > WATCHER_IDLE_MS) watchers.delete(id);
  };
  const call = async <T>(
    ctx: HandlerContext,
    fn: (t: EnvdTarget, user: string | undefined) => Promise<T>,
  ) => {
    try {
      return await fn(targetOf(ctx), envdUserOf(ctx.requestHeader));
    } catch (err) {
      throw connectErrorOf(err);
    }
  };
  const watcherOf = (t: EnvdTarget, id: string) => {
    sweep();
    const w = watchers.get(id);
    if (!w || w.sandboxId !== t.sandboxId || w.keyId !== t.principal.keyId) {
      throw new ConnectError(`watcher ${id} not found`, Code.NotFound);
    }
    return w;
  };

  return {
    stat: (req, ctx) =>
      call(ctx, async (t, user) => ({
        entry: entryInfoOf(only(await fsOpOn(deps, t, { op: "stat", path: req.path, user, depth: 0 }))),
      })),

    makeDir: (req, ctx) =>
      call(ctx, async (t, user) => {
        const a = await fsOpOn(deps, t, { op: "mkdir", path: req.path, user });
        if (a.created === false)
          throw new ConnectError(`directory ${req.path} already exists`, Code.AlreadyExists);
        return { entry: entryInfoOf(only(a)) };
      }),

    move: (req, ctx) =>
      call(ctx, async (t, user) => ({
        entry: entryInfoOf(
          only(await fsOpOn(deps, t, { op: "move", path: req.source, to: req.destination, user })),
        ),
      })),

    listDir: (req, ctx) =>
      call(ctx, async (t, user) => {
        // envd: depth 0 means 1; deeper than MAX_FS_DEPTH is cut there.
        const depth = Math.min(Math.max(req.depth, 1), MAX_FS_DEPTH);
        const a = await fsOpOn(deps, t, { op: "stat", path: req.path, user, depth });
        const [root, ...rest] = a.entries ?? [];
        if (!root) throw new ConnectError(`${req.path}: no such directory`, Code.NotFound);
        if (root.type !== "dir")
          throw new ConnectError(`path ${root.path} is not a directory`, Code.InvalidArgument);
        rest.sort((x, y) => (x.path < y.path ? -1 : x.path > y.path ? 1 : 0));
        return { entries: rest.map(entryInfoOf) };
      }),

    remove: (req, ctx) =>
      call(ctx, async (t, user) => {
        await fsOpOn(deps, t, { op: "remove", path: req.path, user });
        return {};
      }),

    async *watchDir(req, ctx): AsyncIterable<WatchDirResponse> {
      const t = targetOf(ctx);
      let user: string | undefined;
      let last: Snapshot;
      try {
        user = envdUserOf(ctx.requestHeader);
        last = await snapshot(deps, t, req.path, user, req.recursive);
      } catch (err) {
        throw connectErrorOf(err);
      }
      yield create(WatchDirResponseSchema, { event: { case: "start", value: {} } });
      let quietSinceMs = deps.clock();
      while (!ctx.signal.aborted) {
        await sleep(WATCH_POLL_MS, ctx.signal);
        if (ctx.signal.aborted) return;
        let next: Snapshot;
        try {
          next = await snapshot(deps, t, req.path, user, req.recursive);
        } catch (err) {
          throw connectErrorOf(err);
        }
        const events = diffSnapshots(last, next, req.includeEntry);
        last = next;
        for (const e of events)
          yield create(WatchDirResponseSchema, { event: { case: "filesystem", value: e } });
        if (events.length > 0) quietSinceMs = deps.clock();
        else if (deps.clock() - quietSinceMs >= WATCH_KEEPALIVE_MS) {
          quietSinceMs = deps.clock();
          yield create(WatchDirResponseSchema, { event: { case: "keepalive", value: {} } });
        }
      }
    },

    createWatcher: (req, ctx) =>
      call(ctx, async (t, user) => {
        sweep();
        const mine = [...watchers.values()].filter((w) => w.sandboxId === t.sandboxId).length;
        if (mine >= MAX_WATCHERS_PER_SANDBOX) {
          throw new ConnectError(
            `at most ${MAX_WATCHERS_PER_SANDBOX} watchers per sandbox; remove one first`,
            Code.ResourceExhausted,
          );
        }
        const last = await snapshot(deps, t, req.path, user, req.recursive);
        const id = crypto.randomUUID();
        watchers.set(id, {
          sandboxId: t.sandboxId,
          keyId: t.principal.keyId,
          path: req.path,
          user,
          recursive: req.recursive,
          includeEntry: req.includeEntry,
          last,
          usedAtMs: deps.clock(),
        });
        return { watcherId: id };
      }),

    getWatcherEvents: (req, ctx) =>
      call(ctx, async (t) => {
        const w = watcherOf(t, req.watcherId);
        w.usedAtMs = deps.clock();
        const next = await snapshot(deps, t, w.path, w.user, w.recursive);
        const events = diffSnapshots(w.last, next, w.includeEntry);
        w.last = next;
        return { events };
      }),

    removeWatcher: (req, ctx) =>
      call(ctx, async (t) => {
        watcherOf(t, req.watcherId);
        watchers.delete(req.watcherId);
        return {};
      }),
  };
}

function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const timer = setTimeout(done, ms);
    function done() {
      clearTimeout(timer);
      signal.removeEventListener("abort", done);
      resolve();
    }
    signal.addEventListener("abort", done, { once: true });
  });
}
