/**
 * The agent's records on disk: one JSON file per sandbox (`<stateDir>/records/sandboxes/<id>.json`)
 * and per template (`<stateDir>/records/templates/<ref>.json`), each written atomically (temp file,
 * fsync, rename), so that after an agent restart (a crash, a kill -9, an upgrade) the agent knows
 * which VMs it owned, re-adopts those that still run and marks the others `lost` (manager.ts
 * `SandboxManager.open`). Records are parsed with zod when read: a torn or foreign file is
 * reported and skipped, never trusted. The file sits beside the manager and the template
 * registry, its only writers, and beside the states it records.
 */
import { randomBytes } from "node:crypto";
import { mkdir, open, readdir, readFile, rename, rm } from "node:fs/promises";
import { join } from "node:path";
import { z } from "zod";
import { settled } from "../../contracts/best-effort.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import { StoredImageConfig } from "../image/config.ts";
import { AgentSandboxState } from "./states.ts";

export const RECORD_VERSION = 1;

const Size = z.object({ vcpus: z.int().min(1), memMib: z.int().min(1) });

export const SandboxRecord = z.object({
  version: z.literal(RECORD_VERSION),
  id: z.string().regex(/^[a-z0-9][a-z0-9-]{0,62}$/),
  templateId: z.string().min(1),
  kind: z.enum(["session", "sandbox"]),
  /** The state when written; in-flight states are written as the state they return to. */
  state: z.enum(AgentSandboxState),
  /** Why the sandbox is failed or lost. */
  reason: z.string().optional(),
  size: Size,
  qemuPid: z.int().optional(),
  createdAtMs: z.number(),
  lastUsedAtMs: z.number(),
  execCount: z.int().min(0),
  endpoints: z.record(z.string(), z.string()),
  /** The egress allow-list in force; absent in records written before egress existed. */
  egressAllow: z.array(z.string()).optional(),
});
export type SandboxRecord = z.infer<typeof SandboxRecord>;

/** What a restart should assume of a sandbox caught in each state. */
export function persistedState(s: AgentSandboxState): AgentSandboxState {
  switch (s) {
    case "paused":
    case "busy":
    case "forking":
    case "suspending":
      return "running"; // the QEMU is (still) there: try to adopt it
    case "resuming":
      return "suspended"; // the snapshot is intact until the restore succeeds
    default:
      return s;
  }
}

export const TemplateRecord = z.object({
  version: z.literal(RECORD_VERSION),
  id: z.string().min(1),
  status: z.enum(["building", "ready", "failed"]),
  error: z.string().optional(),
  readyAtMs: z.number().optional(),
  size: Size.partial().optional(),
  /**
   * The template's other size classes (docs/templates.md "Size classes"), each frozen as a driver
   * template of its own (`sizedTemplateId`) with the same image and ports as `prepared`.
   */
  extraSizes: z.array(Size).optional(),
  /** What the driver made of it (ImageConfig + ports), opaque here beyond being an object. */
  prepared: z
    .object({
      image: StoredImageConfig,
      exposedPorts: z.array(z.int()),
    })
    .optional(),
  /** Readiness telemetry measured by the build (contracts TemplateTelemetry), kept across restarts. */
  telemetry: z.record(z.string(), z.unknown()).optional(),
  /**
   * Deleted while VMs still ran on it (docs/templates.md "Rules of templates"): it spawns nothing more and is removed when the
   * last of them ends, also by an agent that restarted in between.
   */
  deleting: z.boolean().optional(),
});
export type TemplateRecord = z.infer<typeof TemplateRecord>;

/** A file that could not be read as a record: reported by `list`, left for an operator. */
export interface BadRecord {
  file: string;
  error: string;
}

/** File names are ids; anything that could leave the directory is refused before it is used. */
const SAFE_NAME = /^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/;

export class RecordStore<T extends { id: string }> {
  /** Per-id write chain: a later write never lands before an earlier one (rename order). */
  private readonly chains = new Map<string, Promise<void>>();

  constructor(
    readonly dir: string,
    private readonly schema: z.ZodType<T>,
  ) {}

  private path(id: string): string {
    if (!SAFE_NAME.test(id) || id.includes(".."))
      throw new SandboxdError("bad_request", `unsafe record id ${JSON.stringify(id)}`);
    return join(this.dir, `${id}.json`);
  }

  /** Writes the record atomically; concurrent writes of one id land in call order. */
  write(record: T): Promise<void> {
    const run = async () => {
      const final = this.path(record.id);
      await mkdir(this.dir, { recursive: true, mode: 0o700 });
      const tmp = `${final}.${randomBytes(4).toString("hex")}.tmp`;
      const fh = await open(tmp, "w", 0o600);
      try {
        await fh.writeFile(JSON.stringify(record));
        // fsync before rename: after a host crash the record is the old or the new one, never empty.
        await fh.sync();
      } finally {
        await fh.close();
      }
      await rename(tmp, final);
    };
    return this.chain(record.id, run);
  }

  remove(id: string): Promise<void> {
    return this.chain(id, () => rm(this.path(id), { force: true }));
  }

  async read(id: string): Promise<T | undefined> {
    try {
      return this.schema.parse(JSON.parse(await readFile(this.path(id), "utf8")));
    } catch {
      return undefined;
    }
  }

  /** Every readable record, plus the files that are not records (torn, foreign, old versions). */
  async list(): Promise<{ records: T[]; bad: BadRecord[] }> {
    let names: string[];
    try {
      names = await readdir(this.dir);
    } catch {
      return { records: [], bad: [] };
    }
    const records: T[] = [];
    const bad: BadRecord[] = [];
    for (const name of names.sort()) {
      const file = join(this.dir, name);
      if (name.endsWith(".tmp")) {
        // A write interrupted before its rename: the previous version (if any) is the record.
        await rm(file, { force: true });
        continue;
      }
      if (!name.endsWith(".json")) continue;
      try {
        const r = this.schema.safeParse(JSON.parse(await readFile(file, "utf8")));
        if (r.success) records.push(r.data);
        else bad.push({ file, error: z.prettifyError(r.error) });
      } catch (err) {
        bad.push({ file, error: err instanceof Error ? err.message : String(err) });
      }
    }
    return { records, bad };
  }

  /** Resolves once every write issued so far has landed. */
  async flush(): Promise<void> {
    await Promise.all([...this.chains.values()]);
  }

  private chain(id: string, op: () => Promise<void>): Promise<void> {
    const prev = this.chains.get(id) ?? Promise.resolve();
    const next = settled(prev).then(op);
    const tail = settled(next);
    this.chains.set(id, tail);
    void tail.then(() => {
      if (this.chains.get(id) === tail) this.chains.delete(id);
    });
    return next;
  }
}

export function sandboxRecords(stateDir: string): RecordStore<SandboxRecord> {
  return new RecordStore(join(stateDir, "records", "sandboxes"), SandboxRecord);
}

export function templateRecords(stateDir: string): RecordStore<TemplateRecord> {
  return new RecordStore(join(stateDir, "records", "templates"), TemplateRecord);
}
