/**
 * envd's `filesystem.Filesystem` service over the sandbox's files (docs/e2b.md "Filesystem"):
 * Stat, MakeDir, Move, ListDir and Remove are the agent's filesystem ops (contracts/agent/fs-ops.ts,
 * GNU tools run in the guest with a fixed argv as the call's user); WatchDir and the polling
 * watchers compare listings taken one after the other (no inotify: see the doc for what that
 * misses). Stat, ListDir and Move answers carry each entry's metadata (xattrs `user.e2b.*`, one
 * more guest command per call). The user is the one `Authorization: Basic base64(user:)` names, else the image's.
 */
import { create } from "@bufbuild/protobuf";
import { timestampFromMs } from "@bufbuild/protobuf/wkt";
import { Code, ConnectError, type HandlerContext, type ServiceImpl } from "@connectrpc/connect";
import type { FsEntry, FsOp, FsOpAnswer } from "../../../contracts/agent/fs-ops.ts";
import { MAX_FS_DEPTH } from "../../../contracts/agent/fs-ops.ts";
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
import { agentOf, inTermsOf } from "../../core/sandboxes.ts";
import type { Deps } from "../../deps.ts";
import { type EnvdTarget, endOfAbortedStream, targetOf, toConnectError } from "./target.ts";

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

/**
 * An error of a filesystem call in Connect's terms: what only files mean (a path in the way is
 * AlreadyExists, a refused permission PermissionDenied, which the SDK maps to its own errors),
 * then the data plane's one mapping (target.ts).
 */
export function connectErrorOf(err: unknown): ConnectError {
  if (err instanceof SandboxdError) {
    if (err.code === "conflict") return new ConnectError(err.message, Code.AlreadyExists);
    if (err.code === "invalid_file" && /Permission denied/.test(err.message))
      return new ConnectError(err.message, Code.PermissionDenied);
  }
  return toConnectError(err);
}

/**
 * Runs a filesystem op of the agent on the target's sandbox, errors restated in the sandbox's
 * terms. The data plane's middleware (index.ts) already woke the sandbox and counts the call in
 * flight until its answer ends.
 */
export function fsOpOn(deps: Deps, target: EnvdTarget, op: FsOp): Promise<FsOpAnswer> {
  return inTermsOf(target.row, agentOf(deps, target.row).fsOp(target.row.vmId!, op));
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
    ...(e.metadata !== undefined ? { metadata: e.metadata } : {}),
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
export function filesystemService(deps: Deps): Partial<ServiceImpl<typeof Filesystem>> {
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
      return await fn(targetOf(ctx), targetOf(ctx).user);
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
        entry: entryInfoOf(
          only(await fsOpOn(deps, t, { op: "stat", path: req.path, user, depth: 0, metadata: true })),
        ),
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
          only(
            await fsOpOn(deps, t, {
              op: "move",
              path: req.source,
              to: req.destination,
              user,
              metadata: true,
            }),
          ),
        ),
      })),

    listDir: (req, ctx) =>
      call(ctx, async (t, user) => {
        // envd: depth 0 means 1; deeper than MAX_FS_DEPTH is cut there.
        const depth = Math.min(Math.max(req.depth, 1), MAX_FS_DEPTH);
        const a = await fsOpOn(deps, t, { op: "stat", path: req.path, user, depth, metadata: true });
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
        user = t.user;
        last = await snapshot(deps, t, req.path, user, req.recursive);
      } catch (err) {
        throw connectErrorOf(err);
      }
      yield create(WatchDirResponseSchema, { event: { case: "start", value: {} } });
      let quietSinceMs = deps.clock();
      for (;;) {
        await sleep(WATCH_POLL_MS, ctx.signal);
        if (ctx.signal.aborted) {
          endOfAbortedStream(ctx);
          return;
        }
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
