/**
 * Progress of long work (uploads, downloads, bakes) on one status line of stderr, redrawn in
 * place. Only on a terminal: piped or redirected, a progress line would be noise in a log, so
 * `Progress` then writes nothing at all and the command's output stays what a script expects.
 */
import { bytes } from "./output.ts";

/** Redraws at most this often: faster is flicker, and a transfer calls `update` per chunk. */
const REDRAW_MS = 100;

export interface ProgressSink {
  write(s: string): void;
  isTTY?: boolean;
}

export class Progress {
  private last = 0;
  private shown = false;
  private readonly started = performance.now();

  constructor(
    private readonly sink: ProgressSink,
    private readonly label: string,
    /** Whether to draw at all: a terminal on stderr (callers pass `stderr.isTTY`). */
    readonly enabled: boolean = sink.isTTY === true,
  ) {}

  /** A byte count, with the total when it is known. */
  bytes(done: number, total?: number): void {
    const pct = total ? ` ${Math.floor((done / total) * 100)}%` : "";
    const of = total !== undefined ? ` / ${bytes(total)}` : "";
    this.draw(`${bytes(done)}${of}${pct}`);
  }

  /** A named step (a bake's phase), with the time since the start. */
  phase(name: string): void {
    this.draw(`${name} (${this.elapsed()})`, true);
  }

  /** Clears the line, leaving `final` in its place when given. */
  done(final?: string): void {
    if (!this.enabled) return;
    if (this.shown) this.sink.write("\r\x1b[K");
    if (final) this.sink.write(`${this.label}: ${final} (${this.elapsed()})\n`);
    this.shown = false;
  }

  private elapsed(): string {
    return `${((performance.now() - this.started) / 1000).toFixed(1)} s`;
  }

  private draw(text: string, force = false): void {
    if (!this.enabled) return;
    const now = performance.now();
    if (!force && now - this.last < REDRAW_MS) return;
    this.last = now;
    this.shown = true;
    this.sink.write(`\r\x1b[K${this.label}: ${text}`);
  }
}

/**
 * Counts the bytes of `source` as they pass, for a `Progress`; the stream itself is unchanged (a
 * transfer stays streamed: nothing is buffered here).
 */
export function counted(
  source: ReadableStream<Uint8Array>,
  onBytes: (total: number) => void,
): ReadableStream<Uint8Array> {
  let total = 0;
  return source.pipeThrough(
    new TransformStream<Uint8Array, Uint8Array>({
      transform(chunk, ctl) {
        total += chunk.byteLength;
        onBytes(total);
        ctl.enqueue(chunk);
      },
    }),
  );
}
