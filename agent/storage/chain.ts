/**
 * Reference counting of every file a snapshot family shares: qcow2 overlays (a frozen overlay is
 * the backing file of every child's overlay), migration state files and guest RAM files on tmpfs.
 *
 * Model: each registered file has `holders` (VMs and templates using it directly: "vm:<id>",
 * "template:<id>") and `deps` (the registered files it needs: an overlay's backing file, a
 * state file's RAM file). A file is freed when no holder is left AND no live file depends on it;
 * freeing cascades down the chain. Files we do not own (an image's base disk) are never
 * registered, so they are never deleted here.
 *
 * The table is persisted to `<dataDir>/storage/chain.json` (temp file + rename, so a crash
 * leaves the old or the new table, never half of one) after every change: an agent restarting
 * after a crash loads it, releases the holders that no longer exist (`releaseWhere`) and frees
 * what they held. One ChainStore per data dir per process (`openChainStore` caches it); its
 * changes are serialised by a promise chain, so concurrent forks cannot lose an update.
 */
import { mkdir, readFile, rename, rm, rmdir, writeFile } from "node:fs/promises";
import { dirname, join } from "node:path";
import { SandboxdError } from "../../contracts/errors.ts";

export type StoredFileKind = "overlay" | "state" | "ram";

export interface StoredFile {
  path: string;
  kind: StoredFileKind;
  /** Registered files this one needs (backing overlay, RAM file of a state file). */
  deps: string[];
  /** Users of this file: "vm:<id>", "template:<id>". */
  holders: string[];
  /**
   * For an overlay: the length of its qcow2 chain counting itself and every overlay below it, but
   * not the image base. 1 = an overlay directly on the image base.
   */
  depth?: number;
}

interface Table {
  version: 1;
  files: Record<string, StoredFile>;
}

export class StorageError extends SandboxdError {
  constructor(message: string, opts?: { cause?: unknown; details?: Record<string, unknown> }) {
    super("storage_error", message, opts);
    this.name = "StorageError";
  }
}

/** A change to the table and its caller's promise, waiting for the next write. */
interface PendingChange {
  change: () => string[];
  resolve: (freed: string[]) => void;
  reject: (e: unknown) => void;
}

export class ChainStore {
  /** Changes waiting for the next write of the table (see mutate). */
  private pending: PendingChange[] = [];
  private writing: Promise<void> | undefined;

  private constructor(
    readonly file: string,
    private table: Table,
  ) {}

  static async load(dataDir: string): Promise<ChainStore> {
    const file = join(dataDir, "storage", "chain.json");
    let table: Table = { version: 1, files: {} };
    try {
      const parsed = JSON.parse(await readFile(file, "utf8")) as Table;
      if (parsed && parsed.version === 1 && typeof parsed.files === "object") table = parsed;
    } catch (err) {
      if ((err as NodeJS.ErrnoException).code !== "ENOENT")
        throw new StorageError(`cannot read ${file}`, { cause: err });
    }
    return new ChainStore(file, table);
  }

  /** A snapshot of one entry (undefined when not registered). */
  get(path: string): StoredFile | undefined {
    const f = this.table.files[path];
    return f ? { ...f, deps: [...f.deps], holders: [...f.holders] } : undefined;
  }

  list(): StoredFile[] {
    return Object.keys(this.table.files).map((p) => this.get(p) as StoredFile);
  }

  /** Overlay chain depth of `path` (0 for an unregistered file such as an image base). */
  depth(path: string): number {
    return this.table.files[path]?.depth ?? 0;
  }

  /**
   * Registers a new file, held by `holder` (optional), depending on `deps` (registered files;
   * unregistered ones, like an image base, are dropped from the list).
   */
  add(
    path: string,
    opts: { kind: StoredFileKind; deps?: string[]; holder?: string; depth?: number },
  ): Promise<void> {
    return this.mutateVoid(() => {
      const deps = (opts.deps ?? []).filter((d) => this.table.files[d] !== undefined);
      const existing = this.table.files[path];
      const holders = new Set(existing?.holders ?? []);
      if (opts.holder) holders.add(opts.holder);
      const entry: StoredFile = { path, kind: opts.kind, deps, holders: [...holders] };
      if (opts.kind === "overlay")
        entry.depth = opts.depth ?? 1 + Math.max(0, ...deps.map((d) => this.depth(d)));
      this.table.files[path] = entry;
      return [];
    });
  }

  /** Adds `holder` to each of `paths` (all must be registered). */
  hold(holder: string, paths: string[]): Promise<void> {
    return this.mutateVoid(() => {
      for (const p of paths) {
        const f = this.table.files[p];
        if (!f) throw new StorageError(`hold: ${p} is not a registered file`);
        if (!f.holders.includes(holder)) f.holders.push(holder);
      }
      return [];
    });
  }

  /** Replaces the deps of `path` (e.g. after a chain was flattened) and frees what became unused. */
  setDeps(path: string, deps: string[], depth?: number): Promise<string[]> {
    return this.mutate(() => {
      const f = this.table.files[path];
      if (!f) throw new StorageError(`setDeps: ${path} is not a registered file`);
      f.deps = deps.filter((d) => this.table.files[d] !== undefined);
      if (f.kind === "overlay") f.depth = depth ?? 1 + Math.max(0, ...f.deps.map((d) => this.depth(d)));
      return this.collect();
    });
  }

  /** Drops `holder` from every file (and `paths` only, when given); frees what became unused. */
  release(holder: string, paths?: string[]): Promise<string[]> {
    return this.releaseWhere((h) => h === holder, paths);
  }

  /** Drops every holder matching `pred` (a restart: holders whose VM is gone); frees the rest. */
  releaseWhere(pred: (holder: string) => boolean, paths?: string[]): Promise<string[]> {
    return this.mutate(() => {
      for (const f of Object.values(this.table.files)) {
        if (paths && !paths.includes(f.path)) continue;
        f.holders = f.holders.filter((h) => !pred(h));
      }
      return this.collect();
    });
  }

  /** Frees every file nobody holds or needs (after a load, say). */
  sweep(): Promise<string[]> {
    return this.mutate(() => this.collect());
  }

  /** Unused files, removed from the table; the caller (mutate) deletes them from disk. */
  private collect(): string[] {
    const freed: string[] = [];
    for (;;) {
      const needed = new Set<string>();
      for (const f of Object.values(this.table.files)) for (const d of f.deps) needed.add(d);
      const dead = Object.values(this.table.files).filter(
        (f) => f.holders.length === 0 && !needed.has(f.path),
      );
      if (dead.length === 0) return freed;
      for (const f of dead) {
        delete this.table.files[f.path];
        freed.push(f.path);
      }
    }
  }

  private async mutateVoid(change: () => string[]): Promise<void> {
    await this.mutate(change);
  }

  /**
   * Applies `change` to the table, persists the table, then deletes the freed files; one change
   * at a time, in call order. Changes that arrive while the table is being written wait, and go
   * out together in the next write (group commit): a fork of N children makes ~3N changes at
   * once, and one write each (mkdir, write, rename of a table that grows with them) made the
   * agent's bookkeeping grow as N squared. A change that throws fails its own caller only.
   */
  private mutate(change: () => string[]): Promise<string[]> {
    return new Promise<string[]>((resolve, reject) => {
      this.pending.push({ change, resolve, reject });
      this.writing ??= this.writeBatches();
    });
  }

  private async writeBatches(): Promise<void> {
    while (this.pending.length > 0) {
      const batch = this.pending.splice(0);
      const applied: { p: PendingChange; freed: string[] }[] = [];
      for (const p of batch) {
        try {
          applied.push({ p, freed: p.change() });
        } catch (err) {
          p.reject(err);
        }
      }
      if (applied.length === 0) continue;
      try {
        await this.persist();
      } catch (err) {
        for (const a of applied) a.p.reject(err);
        continue;
      }
      for (const a of applied) {
        try {
          await removeFreed(a.freed);
          a.p.resolve(a.freed);
        } catch (err) {
          a.p.reject(err);
        }
      }
    }
    this.writing = undefined;
  }

  private async persist(): Promise<void> {
    await mkdir(dirname(this.file), { recursive: true, mode: 0o700 });
    const tmp = `${this.file}.${process.pid}.tmp`;
    await writeFile(tmp, JSON.stringify(this.table, null, 1));
    await rename(tmp, this.file);
  }
}

/** Deletes freed files; the directory of a family's files (a template's dir) goes with its last file. */
async function removeFreed(freed: string[]): Promise<void> {
  for (const p of freed) {
    await rm(p, { force: true });
    await rmdir(dirname(p)).catch((err: NodeJS.ErrnoException) => {
      // Other files of the family are still there, or the directory went already.
      if (err.code !== "ENOTEMPTY" && err.code !== "ENOENT") throw err;
    });
  }
}

const stores = new Map<string, Promise<ChainStore>>();

/** The process-wide ChainStore of `dataDir` (loaded once). */
export function openChainStore(dataDir: string): Promise<ChainStore> {
  let s = stores.get(dataDir);
  if (!s) {
    s = ChainStore.load(dataDir);
    stores.set(dataDir, s);
    s.catch(() => stores.delete(dataDir));
  }
  return s;
}

/** Forgets the cached store of `dataDir` (tests simulating a restart). */
export function forgetChainStore(dataDir: string): void {
  stores.delete(dataDir);
}
