/**
 * Splits a QEMU migration stream, as it arrives, into a fork point: the guest's RAM written into a
 * RAM file at its own offsets, and the rest (device state, the small ROM/firmware blocks) into a
 * state file that a QEMU with `x-ignore-shared` loads over a private mapping of that RAM file.
 *
 * Why: a fork's children share the parent's memory copy-on-write through one RAM file on tmpfs.
 * That file used to be made by a QEMU of its own (restore the whole stream into a shared mapping,
 * then save its device state with x-ignore-shared): a second full copy of the RAM and a QEMU start,
 * ~550 ms of an 8-child fork of a 256 MiB guest under TCG on 2 cores, all before any child could
 * start. Written here while the stream arrives, the file is ready when the stream ends.
 *
 * The source saves with `x-ignore-shared` on (fork/copy.ts). Its RAM blocks are private mappings,
 * so none is ignored and every page is sent, but the stream has the ignore-shared header form
 * (each block's address after its length), which is what the children's load expects. Dropping
 * the RAM file's block's page records leaves exactly the stream such a save of a shared mapping
 * would have made: a child finds no page for that block and keeps what its mapping shows.
 *
 * The format (QEMU 7.2, migration/savevm.c and migration/ram.c; QEMU 10 adds flags we refuse):
 * - `QEVM` magic and version 3; a CONFIGURATION section (machine name, then subsections);
 * - SECTION_START / PART / END sections of the iterative "ram" handler: records of a be64
 *   (page offset | flags), MEM_SIZE (the block list), ZERO (1 byte), PAGE (4096 bytes), each
 *   naming its block unless CONTINUE, up to EOS; each section followed by a footer;
 * - then SECTION_FULL device sections, which carry no length and are copied through to the end.
 *
 * The stream comes from a QEMU that a guest may have taken over, so every field is bounded: a
 * page must lie inside its block, the RAM file's block must have the size the children map, an
 * unknown flag, section or subsection fails the split (the fork fails; nothing is guessed).
 */
import { constants } from "node:fs";
import { type FileHandle, open, rm } from "node:fs/promises";
import { settled } from "../../contracts/best-effort.ts";
import { SnapshotError } from "./errors.ts";

const QEVM_MAGIC = 0x5145564d;
const QEVM_VERSION = 3;
/** Section types (migration/savevm.c). */
const SEC = {
  EOF: 0x00,
  START: 0x01,
  PART: 0x02,
  END: 0x03,
  FULL: 0x04,
  SUBSECTION: 0x05,
  CONFIGURATION: 0x07,
  FOOTER: 0x7e,
} as const;
/** RAM record flags (migration/ram.c), in the low bits of each record's be64. */
const FLAG = { ZERO: 0x02, MEM_SIZE: 0x04, PAGE: 0x08, EOS: 0x10, CONTINUE: 0x20 } as const;
/** x86's target page: every record's offset is a multiple of it, every PAGE carries one. */
export const PAGE_BYTES = 4096;
const FLAG_BITS = PAGE_BYTES - 1;
/** A configuration subsection's capability list: QEMU has ~25 capabilities; more is not QEMU. */
const MAX_CAPABILITIES = 64;
/** Blocks in a MEM_SIZE list: our microvm has 5 (RAM, BIOS, three ACPI ROMs). */
const MAX_BLOCKS = 64;
/** Pages gathered before one write: contiguous runs go out as one writev of up to 1 MiB. */
const RUN_PAGES = 256;
/** Bytes of state output gathered before one write. */
const STATE_FLUSH_BYTES = 1024 * 1024;

/** What a split makes of the RAM file's block (the guest RAM): see `SplitTarget`. */
export interface SplitBase {
  /** The RAM block whose pages are taken out (the memory backend's id). */
  ramBlock: string;
  /** Its size: the size its QEMU maps; a stream declaring another size is refused. */
  ramBytes: number;
  /** The state file (created here, must not exist): the stream less what was taken out. */
  statePath: string;
}

/**
 * `ramPath`: every page of the block goes into that RAM file (created here, must not exist,
 * sparse, `ramBytes` long) at its offset; the state is the x-ignore-shared form a QEMU mapping the
 * file private loads (a fork point). `keep`: a delta over the RAM file the VM maps (a suspend):
 * the block's records of the pages marked 1 (one byte per page) stay in the state, the others
 * are dropped, as the VM's mapping already shows them; no RAM file is made.
 */
export type SplitTarget = SplitBase &
  ({ ramPath: string; keep?: undefined } | { keep: Uint8Array; ramPath?: undefined });

export interface SplitResult {
  /** Bytes of the state file. */
  stateBytes: number;
  /** Pages written into the RAM file (zero pages stay holes). */
  ramPages: number;
}

function bad(message: string): SnapshotError {
  return new SnapshotError("migration_failed", `migration stream: ${message}`);
}

/**
 * Takes the stream chunk by chunk (`write`, with back-pressure: it resolves once the chunk is
 * parsed and its pages written) and `end`s with the files complete. `abort` removes both files.
 */
export class RamSplitter {
  private chunks: Buffer[] = [];
  private head = 0;
  private buffered = 0;
  private eof = false;
  private wake: (() => void) | undefined;
  /** Waiting for the parse to use up what it was given (drained). */
  private idle: (() => void)[] = [];
  private readonly done: Promise<SplitResult>;
  private failure: unknown;
  private stateOut: Buffer[] = [];
  private stateOutBytes = 0;
  private stateBytes = 0;
  private ramPages = 0;
  /** Pages of the RAM file written so far: a later ZERO record for one must clear it (a live precopy resends). */
  private readonly written: Uint8Array;
  private run: { offset: number; pages: Buffer[] } | undefined;
  /** The block of the last page record: CONTINUE means this one, across sections too (as QEMU's loader keeps it). */
  private block: string | undefined;
  /** The block of the last page record kept: what CONTINUE means to the loader of the state. */
  private loaderBlock: string | undefined;

  private constructor(
    private readonly t: SplitTarget,
    private readonly ram: FileHandle | undefined,
    private readonly state: FileHandle,
  ) {
    this.written = new Uint8Array(Math.ceil(t.ramBytes / PAGE_BYTES));
    this.done = this.parse().catch((err) => {
      this.failure = err;
      throw err;
    });
    // Seen by write/end; a failure before anyone waits is not an unhandled rejection.
    this.done.catch(() => {});
  }

  static async open(t: SplitTarget): Promise<RamSplitter> {
    if (!Number.isSafeInteger(t.ramBytes) || t.ramBytes <= 0 || t.ramBytes % PAGE_BYTES !== 0)
      throw new SnapshotError("bad_request", `RAM size ${t.ramBytes} is not whole pages`);
    if (t.keep && t.keep.length !== t.ramBytes / PAGE_BYTES)
      throw new SnapshotError("bad_request", `a keep map of ${t.keep.length} pages for ${t.ramBytes} bytes`);
    const flags = constants.O_WRONLY | constants.O_CREAT | constants.O_EXCL;
    const ram = t.ramPath === undefined ? undefined : await open(t.ramPath, flags, 0o600);
    let state: FileHandle | undefined;
    try {
      await ram?.truncate(t.ramBytes);
      state = await open(t.statePath, flags, 0o600);
    } catch (err) {
      await ram?.close();
      if (t.ramPath !== undefined) await rm(t.ramPath, { force: true });
      throw err;
    }
    return new RamSplitter(t, ram, state);
  }

  /** Parses `chunk`; resolves once all of it is consumed (or rejects with the stream's fault). */
  async write(chunk: Buffer): Promise<void> {
    if (this.failure) throw this.failure;
    this.push(chunk);
    await this.drained();
    if (this.failure) throw this.failure;
  }

  /**
   * Takes `chunk` without waiting: the parse goes on as it can. The caller bounds what waits
   * (`backlog`, `drained`); stream.ts pauses the socket past a bound. Ignored once failed.
   */
  push(chunk: Buffer): void {
    if (this.failure || chunk.length === 0) return;
    this.chunks.push(chunk);
    this.buffered += chunk.length;
    this.wake?.();
  }

  /** Bytes taken and not parsed yet. */
  get backlog(): number {
    return this.buffered;
  }

  /** The parse's failure, once it failed (the rest of the stream is then ignored). */
  get failed(): unknown {
    return this.failure;
  }

  /** Resolves once everything taken so far is parsed (or the parse ended). */
  drained(): Promise<void> {
    if (this.buffered === 0) return Promise.resolve();
    const consumed = new Promise<void>((resolve) => {
      this.idle.push(resolve);
    });
    return Promise.race([
      consumed,
      this.done.then(
        () => {},
        () => {},
      ),
    ]);
  }

  /** The stream ended: the files are complete once this resolves; closes both. */
  async end(): Promise<SplitResult> {
    this.eof = true;
    this.wake?.();
    try {
      return await this.done;
    } finally {
      await this.close();
    }
  }

  /** Stops and removes both files (idempotent). */
  async abort(): Promise<void> {
    this.failure ??= bad("aborted");
    this.eof = true;
    this.wake?.();
    // The parse's own failure is moot: the split is being thrown away.
    await settled(this.done);
    await this.close();
    if (this.t.ramPath !== undefined) await rm(this.t.ramPath, { force: true });
    await rm(this.t.statePath, { force: true });
  }

  private closed = false;
  private async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    // Handles of files that are complete (end) or about to be removed (abort): a close error changes neither.
    await settled(this.ram?.close());
    await settled(this.state.close());
  }

  // --- reading

  /** Waits until `n` bytes are buffered (callers skip it when they are: no await per record). */
  private async fill(n: number): Promise<void> {
    while (this.buffered < n) {
      if (this.failure) throw this.failure;
      if (this.eof) throw bad(`ended in the middle of a record (${this.buffered} of ${n} bytes)`);
      await new Promise<void>((resolve) => {
        this.wake = resolve;
        const idle = this.idle;
        this.idle = [];
        for (const f of idle) f();
      });
      this.wake = undefined;
    }
  }

  /** The next `n` bytes (buffered: fill(n) first), as one buffer (a view where it can be). */
  private take(n: number): Buffer {
    const first = this.chunks[0] as Buffer;
    if (first.length - this.head >= n) {
      const out = first.subarray(this.head, this.head + n);
      this.head += n;
      this.buffered -= n;
      if (this.head === first.length) {
        this.chunks.shift();
        this.head = 0;
      }
      return out;
    }
    const out = Buffer.allocUnsafe(n);
    let got = 0;
    while (got < n) {
      const c = this.chunks[0] as Buffer;
      const k = Math.min(n - got, c.length - this.head);
      c.copy(out, got, this.head, this.head + k);
      got += k;
      this.head += k;
      if (this.head === c.length) {
        this.chunks.shift();
        this.head = 0;
      }
    }
    this.buffered -= n;
    return out;
  }

  private peekU8(): number {
    return (this.chunks[0] as Buffer)[this.head] as number;
  }

  private async u8(keep: boolean): Promise<number> {
    await this.fill(1);
    const b = this.take(1);
    if (keep) this.keep(b);
    return b[0] as number;
  }

  private async be32(keep: boolean): Promise<number> {
    await this.fill(4);
    const b = this.take(4);
    if (keep) this.keep(b);
    return b.readUInt32BE(0);
  }

  private async be64(keep: boolean): Promise<bigint> {
    await this.fill(8);
    const b = this.take(8);
    if (keep) this.keep(b);
    return b.readBigUInt64BE(0);
  }

  private async str(lenBytes: 1 | 4, keep: boolean, max: number): Promise<string> {
    const n = lenBytes === 1 ? await this.u8(keep) : await this.be32(keep);
    if (n > max) throw bad(`a ${n}-byte name (at most ${max})`);
    await this.fill(n);
    const b = this.take(n);
    if (keep) this.keep(b);
    return b.toString("latin1");
  }

  // --- writing

  /** Bytes that go to the state file as they are. */
  private keep(b: Buffer): void {
    this.stateOut.push(b);
    this.stateOutBytes += b.length;
  }

  private async flushState(): Promise<void> {
    if (this.stateOutBytes === 0) return;
    const bufs = this.stateOut;
    const n = this.stateOutBytes;
    this.stateOut = [];
    this.stateOutBytes = 0;
    // Views into the socket's chunks: copied into one buffer, so that nothing holds them longer.
    const data = Buffer.concat(bufs, n);
    let off = 0;
    while (off < n) off += (await this.state.write(data, off, n - off, this.stateBytes + off)).bytesWritten;
    this.stateBytes += n;
  }

  private async maybeFlushState(): Promise<void> {
    if (this.stateOutBytes >= STATE_FLUSH_BYTES) await this.flushState();
  }

  /** A page of the RAM file's block at `offset`: the next of the run being gathered, or a new run. */
  private async page(offset: number, data: Buffer): Promise<void> {
    // The usual case, without an await.
    if (this.append(offset, data)) return;
    await this.flushRun();
    this.run = { offset, pages: [data] };
    this.written[offset / PAGE_BYTES] = 1;
  }

  /** Adds the page to the run being gathered when it is the run's next. */
  private append(offset: number, data: Buffer): boolean {
    const r = this.run;
    if (!r || r.offset + r.pages.length * PAGE_BYTES !== offset || r.pages.length >= RUN_PAGES) return false;
    r.pages.push(data);
    this.written[offset / PAGE_BYTES] = 1;
    return true;
  }

  private async flushRun(): Promise<void> {
    const r = this.run;
    if (!r) return;
    this.run = undefined;
    // The pages as they are (views into the socket's chunks), in one positioned writev: no copy.
    const bytes = r.pages.length * PAGE_BYTES;
    const ram = this.ram as FileHandle; // runs are gathered only with a RAM file
    const { bytesWritten } = await ram.writev(r.pages, r.offset);
    // A short write (tmpfs or disk full midway) leaves the rest: written from where it stopped.
    if (bytesWritten < bytes) {
      const rest = Buffer.concat(r.pages).subarray(bytesWritten);
      let off = 0;
      while (off < rest.length)
        off += (await ram.write(rest, off, rest.length - off, r.offset + bytesWritten + off)).bytesWritten;
    }
    this.ramPages += r.pages.length;
  }

  // --- the stream

  private async parse(): Promise<SplitResult> {
    if ((await this.be32(true)) !== QEVM_MAGIC) throw bad("not a QEMU migration stream");
    const version = await this.be32(true);
    if (version !== QEVM_VERSION) throw bad(`version ${version}, expected ${QEVM_VERSION}`);
    let ignoreShared = false;
    let ramSection: number | undefined;
    const blocks = new Map<string, number>();
    for (;;) {
      const type = await this.u8(true);
      if (type === SEC.CONFIGURATION) {
        ignoreShared = await this.configuration();
        continue;
      }
      if (type === SEC.START || type === SEC.FULL) {
        const id = await this.be32(true);
        const name = await this.str(1, true, 255);
        await this.be32(true); // instance id
        await this.be32(true); // version id
        if (type === SEC.FULL) {
          // The first device section: everything from here is device state, copied through.
          await this.rest();
          break;
        }
        if (name !== "ram") throw bad(`an iterative section "${name}" (only "ram" is expected)`);
        if (ramSection !== undefined) throw bad("a second ram section");
        ramSection = id;
        await this.ramRecords(blocks, ignoreShared);
        await this.footer(id);
        continue;
      }
      if (type === SEC.PART || type === SEC.END) {
        const id = await this.be32(true);
        if (id !== ramSection) throw bad(`a part of section ${id}, which is not ram's`);
        await this.ramRecords(blocks, ignoreShared);
        await this.footer(id);
        continue;
      }
      if (type === SEC.EOF) break;
      throw bad(`section type 0x${type.toString(16)}`);
    }
    if (!blocks.has(this.t.ramBlock)) throw bad(`no RAM block "${this.t.ramBlock}"`);
    // A fork point is loaded with x-ignore-shared: its header must have that form. A delta is
    // loaded with the capabilities it was saved with.
    if (this.t.ramPath !== undefined && !ignoreShared)
      throw bad("saved without x-ignore-shared: its header form is not the children's");
    await this.flushRun();
    await this.flushState();
    return { stateBytes: this.stateBytes, ramPages: this.ramPages };
  }

  /** The configuration section: machine name, then subsections. Returns whether x-ignore-shared was on. */
  private async configuration(): Promise<boolean> {
    await this.str(4, true, 256); // machine type
    let ignoreShared = false;
    for (;;) {
      await this.fill(1);
      if (this.peekU8() !== SEC.SUBSECTION) return ignoreShared;
      await this.u8(true);
      const name = await this.str(1, true, 255);
      await this.be32(true); // version
      if (name === "configuration/capabilities") {
        const count = await this.be32(true);
        if (count > MAX_CAPABILITIES) throw bad(`${count} capabilities`);
        for (let i = 0; i < count; i++)
          if ((await this.str(1, true, 255)) === "x-ignore-shared") ignoreShared = true;
      } else if (name === "configuration/target-page-bits") {
        await this.be32(true);
      } else if (name === "configuration/uuid") {
        await this.fill(16);
        this.keep(this.take(16));
      } else {
        throw bad(`configuration subsection "${name}"`);
      }
    }
  }

  /** A section's footer, when the stream has them (QEMU's default for every current machine). */
  private async footer(id: number): Promise<void> {
    await this.fill(1);
    if (this.peekU8() !== SEC.FOOTER) return;
    await this.u8(true);
    if ((await this.be32(true)) !== id) throw bad(`a footer of another section than ${id}`);
  }

  /** Everything left, as it is. */
  private async rest(): Promise<void> {
    for (;;) {
      if (this.buffered > 0) {
        this.keep(this.take(this.buffered));
        await this.maybeFlushState();
      }
      if (this.eof) return;
      try {
        await this.fill(1);
      } catch (err) {
        if (this.eof && this.buffered === 0 && !this.failure) return;
        throw err;
      }
    }
  }

  /** RAM records up to EOS: the RAM file's block's pages written there, the rest kept. */
  private async ramRecords(blocks: Map<string, number>, ignoreShared: boolean): Promise<void> {
    const target = this.t.ramBlock;
    for (;;) {
      if (this.buffered < 8) await this.fill(8);
      const header = this.take(8);
      // Two 32-bit halves, not a BigInt per record: offsets stay far below 2^53 (a block's size bounds them).
      const high = header.readUInt32BE(0);
      const low = header.readUInt32BE(4);
      const flags = low & FLAG_BITS;
      const offset = high * 2 ** 32 + (low - flags);
      if (flags & FLAG.MEM_SIZE) {
        this.keep(header);
        await this.blockList(header.readBigUInt64BE(0) & ~BigInt(FLAG_BITS), blocks, ignoreShared);
        continue;
      }
      if (flags & FLAG.EOS) {
        if (flags !== FLAG.EOS) throw bad(`record flags 0x${flags.toString(16)}`);
        this.keep(header);
        await this.maybeFlushState();
        return;
      }
      const kind = flags & ~FLAG.CONTINUE;
      if (kind !== FLAG.ZERO && kind !== FLAG.PAGE) throw bad(`record flags 0x${flags.toString(16)}`);
      let nameBytes: Buffer | undefined;
      if (!(flags & FLAG.CONTINUE)) {
        if (this.buffered < 1) await this.fill(1);
        const n = (this.chunks[0] as Buffer)[this.head] as number;
        if (this.buffered < 1 + n) await this.fill(1 + n);
        nameBytes = this.take(1 + n);
        this.block = nameBytes.subarray(1).toString("latin1");
      }
      const block = this.block;
      if (block === undefined) throw bad("a page record that names no block");
      const size = blocks.get(block);
      if (size === undefined) throw bad(`a page of unknown block "${block}"`);
      if (offset + PAGE_BYTES > size) throw bad(`a page past the end of block "${block}"`);
      const payload = kind === FLAG.PAGE ? PAGE_BYTES : 1;
      if (this.buffered < payload) await this.fill(payload);
      const data = this.take(payload);
      if (block !== target || (this.t.keep && this.t.keep[offset / PAGE_BYTES] === 1)) {
        this.keepRecord(header, block, nameBytes, data);
        continue;
      }
      // Dropped from a delta: the VM's mapping shows this page already.
      if (this.t.keep) continue;
      if (kind === FLAG.PAGE) {
        await this.page(offset, data);
      } else if ((data[0] as number) !== 0 || this.written[offset / PAGE_BYTES]) {
        // A page that is not (or no longer) what the file holds: filled with its byte.
        await this.page(offset, Buffer.alloc(PAGE_BYTES, data[0] as number));
      }
    }
  }

  /**
   * A page record that stays in the state. Its CONTINUE ("the block of the record before") must
   * mean the same block to the loader, which sees only the records kept: where a dropped record
   * named the block last, the kept one names it itself.
   */
  private keepRecord(header: Buffer, block: string, nameBytes: Buffer | undefined, data: Buffer): void {
    if (nameBytes) {
      this.keep(header);
      this.keep(nameBytes);
    } else if (this.loaderBlock === block) {
      this.keep(header);
    } else {
      const named = Buffer.from(header);
      named.writeUInt32BE((header.readUInt32BE(4) & ~FLAG.CONTINUE) >>> 0, 4);
      this.keep(named);
      this.keep(Buffer.concat([Buffer.from([block.length]), Buffer.from(block, "latin1")]));
    }
    this.loaderBlock = block;
    this.keep(data);
  }

  /** MEM_SIZE's block list: name, length, and (ignore-shared form) the block's address. */
  private async blockList(total: bigint, blocks: Map<string, number>, ignoreShared: boolean): Promise<void> {
    let left = total;
    for (let i = 0; left > 0n; i++) {
      if (i >= MAX_BLOCKS) throw bad(`more than ${MAX_BLOCKS} RAM blocks`);
      const name = await this.str(1, true, 255);
      const length = await this.be64(true);
      if (ignoreShared) await this.be64(true);
      if (length > left || length % BigInt(PAGE_BYTES) !== 0n)
        throw bad(`block "${name}" of ${length} bytes`);
      left -= length;
      if (name === this.t.ramBlock && Number(length) !== this.t.ramBytes)
        throw bad(`block "${name}" has ${length} bytes, the children map ${this.t.ramBytes}`);
      blocks.set(name, Number(length));
    }
  }
}
