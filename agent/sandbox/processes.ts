/**
 * Background processes of one sandbox (docs/processes-and-pty.md "Background processes: choices"): guest commands
 * that run beside the foreground exec, not tied to any request. Each is one guest EXEC with
 * streamed output and streamed stdin and no timeout (agent/guest/client.ts); its output goes to a
 * bounded log per stream that `logs` reads and `follow` tails, and it ends by itself, by `kill`
 * (CANCEL: the guest kills its whole process group), or with its VM (destroy, suspend, failure).
 *
 * Output is never back-pressured to the guest: the guest channel is shared by every exec and
 * tunnel of the VM, and a process nobody reads must not stall them. The log keeps the newest
 * bytes and drops the oldest (`truncated`); a follower that reads slower than the process writes
 * skips what was dropped before it got there.
 */
import type { z } from "zod";
import type { ProcessInfo, ProcessStartBody } from "../../contracts/agent/processes.ts";
import { SandboxdError } from "../../contracts/errors.ts";
import type { GuestClient } from "../guest/client.ts";
import type { DriverVm } from "./drivers/driver.ts";
import { type ExecRequest, exitCodeOf, planExec } from "./exec.ts";
import { cwdError, resolveExecUser } from "./exec-run.ts";

/**
 * Background processes kept per sandbox, running or ended. 32: an agent loop runs a handful of
 * servers and watchers; each costs a guest exec slot (the guest allows 256 at once for every
 * caller) and up to 2 x PROCESS_LOG_BYTES of host memory, so 32 bound one sandbox to 64 MiB.
 * Past it, the oldest ended process is forgotten; 32 running is `conflict` (409).
 */
export const MAX_PROCESSES = 32;
/**
 * Output kept per stream of a process. 1 MiB: the last few thousand lines of a server's log,
 * the same bound as a foreground exec's captured output; older output is dropped.
 */
export const PROCESS_LOG_BYTES = 1024 * 1024;
/**
 * Stdin accepted for a process but not yet sent to the guest. 4 MiB: a few requests' worth; past
 * it the process is not reading its stdin and more is `busy` (409) instead of host memory.
 */
export const MAX_PENDING_STDIN_BYTES = 4 * 1024 * 1024;

export type StreamName = "stdout" | "stderr";
interface Chunk {
  seq: number;
  stream: StreamName;
  data: Buffer;
}

/**
 * What one kept chunk costs beyond its bytes (the object, its Buffer view), counted against the
 * bound so that a process writing one byte at a time cannot make the log hold far more than
 * `PROCESS_LOG_BYTES` of host memory.
 */
const CHUNK_OVERHEAD_BYTES = 128;

/**
 * One stream's newest output, at most `max` bytes (with CHUNK_OVERHEAD_BYTES per chunk); the
 * chunks carry a sequence number across both streams, in increasing order. Dropping from the front
 * moves `head` (compacted now and then) rather than shifting the array each time.
 */
class LogRing {
  private chunks: Chunk[] = [];
  private head = 0;
  private bytes = 0;
  dropped = false;

  constructor(private readonly max: number) {}

  push(c: Chunk): void {
    const room = this.max - CHUNK_OVERHEAD_BYTES;
    const data = c.data.length > room ? c.data.subarray(c.data.length - room) : c.data;
    if (data !== c.data) this.dropped = true;
    this.chunks.push({ ...c, data });
    this.bytes += data.length + CHUNK_OVERHEAD_BYTES;
    while (this.bytes > this.max) {
      const first = this.chunks[this.head++]!;
      this.bytes -= first.data.length + CHUNK_OVERHEAD_BYTES;
      this.dropped = true;
    }
    if (this.head > 1024 && this.head * 2 > this.chunks.length) {
      this.chunks = this.chunks.slice(this.head);
      this.head = 0;
    }
  }

  /** The first kept chunk with a sequence number above `seq` (binary search), if any. */
  after(seq: number): Chunk | undefined {
    let lo = this.head;
    let hi = this.chunks.length;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if (this.chunks[mid]!.seq > seq) hi = mid;
      else lo = mid + 1;
    }
    return this.chunks[lo];
  }

  text(): Buffer {
    return Buffer.concat(this.chunks.slice(this.head).map((c) => c.data));
  }
}

/** Stdin chunks waiting for the guest, as the async source the guest client pumps. */
class StdinQueue {
  private readonly queue: Buffer[] = [];
  private pending = 0;
  private ended = false;
  private wake: (() => void) | undefined;

  push(data: Buffer, eof: boolean): void {
    if (this.ended) throw new SandboxdError("conflict", "the process's stdin is closed");
    if (this.pending + data.length > MAX_PENDING_STDIN_BYTES) {
      throw new SandboxdError(
        "busy",
        `the process has ${this.pending} bytes of stdin it has not read yet (at most ${MAX_PENDING_STDIN_BYTES})`,
      );
    }
    if (data.length > 0) {
      this.queue.push(data);
      this.pending += data.length;
    }
    if (eof) this.ended = true;
    this.wake?.();
  }

  end(): void {
    this.ended = true;
    this.wake?.();
  }

  async *source(): AsyncGenerator<Uint8Array> {
    for (;;) {
      const next = this.queue.shift();
      if (next) {
        this.pending -= next.length;
        yield next;
        continue;
      }
      if (this.ended) return;
      await new Promise<void>((resolve) => {
        this.wake = resolve;
      });
      this.wake = undefined;
    }
  }
}

export interface ProcessCommand {
  argv: string[];
  /** What `list` shows: the shell line, or the argv joined. */
  command: string;
  env: string[];
  cwd: string;
  uid: number;
  gid: number;
  keepAwake: boolean;
}

export class BackgroundProcess {
  readonly out = new LogRing(PROCESS_LOG_BYTES);
  readonly err = new LogRing(PROCESS_LOG_BYTES);
  readonly stdin = new StdinQueue();
  readonly abort = new AbortController();
  running = true;
  exitCode: number | null = null;
  /** Its pid in the guest, from the guest's STARTED frame; undefined from an older guest agent. */
  guestPid: number | undefined;
  readonly startedAtMs = Date.now();
  /** Settles when the process has ended (never rejects). */
  done!: Promise<void>;
  private seq = 0;
  private waiters: Array<() => void> = [];

  constructor(
    readonly pid: number,
    readonly cmd: ProcessCommand,
  ) {}

  output(stream: StreamName, data: Buffer): void {
    (stream === "stdout" ? this.out : this.err).push({ seq: ++this.seq, stream, data });
    this.notify();
  }

  ended(exitCode: number | null): void {
    this.running = false;
    this.exitCode = exitCode;
    this.stdin.end();
    this.notify();
  }

  info(): ProcessInfo {
    return {
      pid: this.pid,
      ...(this.guestPid !== undefined ? { guestPid: this.guestPid } : {}),
      command: this.cmd.command,
      running: this.running,
      exitCode: this.exitCode,
      keepAwake: this.cmd.keepAwake,
      startedAtMs: this.startedAtMs,
    };
  }

  /**
   * The output kept so far, then new output as it comes, in the order it was written, until the
   * process has ended and everything was handed out (or `signal` aborts).
   */
  async *follow(signal: AbortSignal): AsyncGenerator<Chunk> {
    const aborted = new Promise<void>((r) => signal.addEventListener("abort", () => r(), { once: true }));
    let after = 0;
    while (!signal.aborted) {
      const wait = this.running ? this.changed() : undefined;
      // One chunk at a time, the older of the two streams' next: a slow reader holds no copy.
      for (;;) {
        const o = this.out.after(after);
        const e = this.err.after(after);
        const c = o && (!e || o.seq < e.seq) ? o : e;
        if (!c || signal.aborted) break;
        after = c.seq;
        yield c;
      }
      if (!wait || signal.aborted) return;
      await Promise.race([wait, aborted]);
    }
  }

  private changed(): Promise<void> {
    return new Promise((resolve) => this.waiters.push(resolve));
  }

  private notify(): void {
    for (const w of this.waiters.splice(0)) w();
  }
}

/** A sandbox's background processes; the manager holds one per sandbox (manager.ts). */
export class ProcessTable {
  private readonly procs = new Map<number, BackgroundProcess>();
  private nextPid = 1;

  /** `onChange`: a process started or ended (the manager re-checks its idle pause). */
  constructor(private readonly onChange: () => void) {}

  /**
   * Starts the command in the guest; resolves once the guest has started it (its STARTED frame).
   * One the guest refuses (a missing cwd: 400) is forgotten and rejects, so a start is answered
   * only for a process that runs.
   */
  async start(guest: GuestClient, cmd: ProcessCommand): Promise<BackgroundProcess> {
    const running = [...this.procs.values()].filter((p) => p.running).length;
    if (running >= MAX_PROCESSES) {
      throw new SandboxdError(
        "conflict",
        `${running} background processes are running in this sandbox, the most it may have; kill one first`,
        { details: { max: MAX_PROCESSES } },
      );
    }
    // Forget the oldest ended processes past the bound.
    for (const p of this.procs.values()) {
      if (this.procs.size < MAX_PROCESSES) break;
      if (!p.running) this.procs.delete(p.pid);
    }
    const proc = new BackgroundProcess(this.nextPid++, cmd);
    let started!: () => void;
    let refused!: (err: unknown) => void;
    const begun = new Promise<void>((resolve, reject) => {
      started = resolve;
      refused = reject;
    });
    proc.done = guest
      .exec({
        argv: cmd.argv,
        env: cmd.env,
        cwd: cmd.cwd,
        uid: cmd.uid,
        gid: cmd.gid,
        stdin: proc.stdin.source(),
        onStdout: (b) => proc.output("stdout", b),
        onStderr: (b) => proc.output("stderr", b),
        collect: false,
        signal: proc.abort.signal,
        onStarted: (guestPid) => {
          proc.guestPid = guestPid;
          started();
        },
      })
      .then(
        (r) => proc.ended(exitCodeOf(r)),
        (e: unknown) => {
          // Before STARTED: the guest refused it (a bad cwd) and the start fails with that. After
          // it (once `begun` settled, `refused` does nothing): the VM went away, the exit
          // status is unknown.
          refused(e);
          proc.ended(null);
        },
      )
      .finally(() => this.onChange());
    // Counted from now on: a start racing this one sees the slot taken.
    this.procs.set(proc.pid, proc);
    this.onChange();
    try {
      await begun;
    } catch (err) {
      this.procs.delete(proc.pid);
      throw cwdError(err, cmd.cwd) ?? err;
    }
    return proc;
  }

  get(pid: number): BackgroundProcess {
    const p = this.procs.get(pid);
    if (!p) throw new SandboxdError("not_found", `no background process ${pid} in this sandbox`);
    return p;
  }

  list(): ProcessInfo[] {
    return [...this.procs.values()].map((p) => p.info());
  }

  /** Whether a running process asked to keep the VM awake. */
  keepsAwake(): boolean {
    for (const p of this.procs.values()) if (p.running && p.cmd.keepAwake) return true;
    return false;
  }

  /** CANCELs every running process (their VM is going away) and waits for them to end. */
  async killAll(): Promise<void> {
    const running = [...this.procs.values()].filter((p) => p.running);
    for (const p of running) p.abort.abort();
    await Promise.all(running.map((p) => p.done));
  }
}

/** What a start asks for: the agent wire body (contracts/agent/processes.ts). */
export type ProcessStartRequest = z.infer<typeof ProcessStartBody>;

/**
 * Starts a background process in a running VM: planned as a foreground exec's command is (the
 * image's env, working directory and user unless the request names its own, exec.ts `planExec`).
 */
export async function startProcess(
  table: ProcessTable,
  vm: Pick<DriverVm, "guest" | "image">,
  req: ProcessStartRequest,
): Promise<ProcessInfo> {
  const user = req.user === undefined ? undefined : await resolveExecUser(vm.guest, req.user);
  const exec: ExecRequest = { files: [], run: req.run };
  if (req.env !== undefined) exec.env = req.env;
  if (req.cwd !== undefined) exec.cwd = req.cwd;
  const plan = planExec(exec, vm.image, user);
  const argv = plan.commands[0]?.argv ?? [];
  const command = req.run.kind === "shell" ? req.run.command : argv.join(" ");
  const proc = await table.start(vm.guest, {
    argv,
    command,
    env: plan.env,
    cwd: plan.cwd,
    uid: plan.uid,
    gid: plan.gid,
    keepAwake: req.keepAwake,
  });
  return proc.info();
}
