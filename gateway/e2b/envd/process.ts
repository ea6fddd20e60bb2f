/**
 * envd's `process.Process` service over sandboxd's background processes and terminals
 * (docs/e2b.md "Processes").
 *
 * - A command (`Start` without `pty`) is a background process of the sandbox's agent
 *   (agent/sandbox/processes.ts): its `pid` is its pid in the guest (the agent's `guestPid`),
 *   its output the agent's followed log, its stdin the agent's queue. `stdin: false` closes its
 *   stdin at once (E2B's default: a command reads end of file). Every call that names a pid maps
 *   it back to the agent's number through the agent's list of the sandbox's processes, so it
 *   works from any gateway. A guest agent frozen in an older template reports no guest pid: its
 *   processes are then named by the agent's number (1, 2, ...), which means nothing in the guest.
 * - A terminal (`Start` with `pty`) is the agent's PTY tunnel (`openPty`), held by this gateway
 *   process for as long as it runs: its pid is the shell's guest pid when the agent tells it
 *   (`PtyTunnel.pid`), else a number of this process (from PTY_PID_BASE up); its output goes to
 *   the streams attached to it (none attached: dropped, as a terminal nobody watches), its input
 *   and size go through the tunnel.
 *
 * Every stream sends a KeepAlive at the interval the client asks (`Keepalive-Ping-Interval`).
 */
import { Code, ConnectError, type HandlerContext, type ServiceImpl } from "@connectrpc/connect";
import type { AgentVmApi, PtyTunnel } from "../../../contracts/agent/api.ts";
import type { ProcessInfo as AgentProcessInfo, ProcessStart } from "../../../contracts/agent/processes.ts";
import type { PtyOpen } from "../../../contracts/agent/pty.ts";
import {
  type ConnectRequest,
  type Process,
  type ProcessSelector,
  Signal,
  type StartRequest,
} from "../../../contracts/e2b/envd/process_pb.ts";
import { SandboxdError } from "../../../contracts/errors.ts";
import { agentOf, beginUseOf, inTermsOf } from "../../core/sandboxes.ts";
import type { Deps } from "../../deps.ts";
import type { SandboxEnvs } from "../sandbox-envs.ts";
import { type EnvdTarget, endOfAbortedStream, targetOf, toConnectError } from "./target.ts";

/**
 * Terminal pids, when the agent does not tell the shell's guest pid, start here: above Linux's
 * largest pid (2^22, pid_max's ceiling) and far above the agent's process numbers, so such a pid
 * is never a process's.
 */
export const PTY_PID_BASE = 1 << 24;
/** The keepalive interval a client may ask for, seconds: at least 1 (a flood otherwise), at most 600. */
const KEEPALIVE_MIN_S = 1;
const KEEPALIVE_MAX_S = 600;
/**
 * Start configs and tags remembered per gateway process for `List` and `Connect` by tag: at most
 * this many (the oldest forgotten first); a process started through another gateway lists with
 * its command line only.
 */
const MAX_REMEMBERED = 4096;
/** Streams attached to one terminal at once: a few viewers; more is `resource_exhausted`. */
const MAX_PTY_VIEWERS = 8;

interface Config {
  cmd: string;
  args: string[];
  envs: Record<string, string>;
  cwd?: string;
  tag?: string;
}

type Out = { kind: "stdout" | "stderr" | "pty"; data: Uint8Array };
type End = { exitCode: number; status: string; exited: boolean };

/**
 * A hand-off of one item at a time between a producer and the stream that yields it: `put`
 * resolves once the item was taken (the producer's back-pressure: nothing is queued here), or at
 * once when the stream is gone.
 */
class Handoff {
  private item: { out: Out; taken: () => void } | undefined;
  private wake: (() => void) | undefined;
  private end: End | undefined;
  private error: unknown;
  private closed = false;

  put(out: Out): Promise<void> {
    if (this.closed || this.end || this.error) return Promise.resolve();
    return new Promise((taken) => {
      this.item = { out, taken };
      this.wake?.();
    });
  }
  finish(end: End): void {
    this.end = end;
    this.wake?.();
  }
  fail(err: unknown): void {
    this.error = err;
    this.wake?.();
  }
  /** The stream is gone: producers are released. */
  close(): void {
    this.closed = true;
    this.item?.taken();
    this.item = undefined;
    this.wake?.();
  }
  /** The next item, the end, or "tick" after `tickMs` with nothing (undefined: wait for ever). */
  async next(tickMs: number | undefined): Promise<Out | End | "tick" | "closed"> {
    for (;;) {
      if (this.item) {
        const { out, taken } = this.item;
        this.item = undefined;
        taken();
        return out;
      }
      if (this.error) throw this.error;
      if (this.end) return this.end;
      if (this.closed) return "closed";
      let timer: ReturnType<typeof setTimeout> | undefined;
      const ticked = await new Promise<boolean>((resolve) => {
        this.wake = () => resolve(false);
        if (tickMs !== undefined) timer = setTimeout(() => resolve(true), tickMs);
      });
      clearTimeout(timer);
      this.wake = undefined;
      if (ticked) return "tick";
    }
  }
}

interface PtyEntry {
  pid: number;
  tunnel: PtyTunnel;
  writer: WritableStreamDefaultWriter<Uint8Array>;
  viewers: Set<Handoff>;
  config: Config;
  killed: boolean;
  end?: End;
}

function keepaliveMs(ctx: HandlerContext): number | undefined {
  const raw = ctx.requestHeader.get("keepalive-ping-interval");
  if (raw === null || !/^[0-9]{1,6}$/.test(raw)) return undefined;
  return Math.min(KEEPALIVE_MAX_S, Math.max(KEEPALIVE_MIN_S, Number(raw))) * 1000;
}

/**
 * The pid the SDK sees for an agent process: its guest pid, or the agent's number when an older
 * guest agent did not report one.
 */
const sdkPid = (p: AgentProcessInfo): number => p.guestPid ?? p.pid;

/**
 * The agent's number for the process the SDK names `pid`: a running one first (a guest pid may
 * be reused once its process has ended), else the newest ended one; none is `not_found`.
 */
function agentPidOf(procs: AgentProcessInfo[], pid: number): AgentProcessInfo {
  const named = procs.filter((p) => sdkPid(p) === pid);
  const p = named.find((i) => i.running) ?? named.sort((a, b) => b.pid - a.pid)[0];
  if (!p) throw new SandboxdError("not_found", `no process ${pid} in this sandbox`);
  return p;
}

/** An agent process's end as envd reports it: the exit status, `exited` false when unknown. */
function endOf(info: AgentProcessInfo): End {
  if (info.exitCode === null)
    return { exitCode: -1, exited: false, status: "unknown: the sandbox went away" };
  return { exitCode: info.exitCode, exited: true, status: `exit status ${info.exitCode}` };
}

/** A stream whose sandbox went away under it, as E2B's SDK reports it (a TimeoutError). */
const sandboxGone = () =>
  new ConnectError(
    "the sandbox was killed or reached its end of life while the request was in flight",
    Code.Unavailable,
  );

const ev = {
  start: (pid: number) => ({ event: { event: { case: "start" as const, value: { pid } } } }),
  data: (o: Out) => ({
    event: { event: { case: "data" as const, value: { output: { case: o.kind, value: o.data } } } },
  }),
  end: (e: End) => ({
    event: {
      event: {
        case: "end" as const,
        value: { ...e, ...(e.exitCode !== 0 ? { error: e.status } : {}) },
      },
    },
  }),
  keepalive: () => ({ event: { event: { case: "keepalive" as const, value: {} } } }),
};

/** The events of `h` until its end, with keepalives; the stream's end closes `h`. */
async function* drain(h: Handoff, ctx: HandlerContext) {
  const tick = keepaliveMs(ctx);
  const onAbort = () => h.close();
  ctx.signal.addEventListener("abort", onAbort, { once: true });
  try {
    for (;;) {
      const r = await h.next(tick);
      if (r === "closed") {
        endOfAbortedStream(ctx);
        return;
      }
      if (r === "tick") yield ev.keepalive();
      else if ("kind" in r) yield ev.data(r);
      else {
        // No exit status: the VM under the process is gone (deleted, reaped, failed). E2B's
        // stream breaks then and its SDK, finding the sandbox gone, raises a TimeoutError saying
        // so; Unavailable with that reason gives the same error.
        if (!r.exited) throw sandboxGone();
        yield ev.end(r);
        return;
      }
    }
  } finally {
    ctx.signal.removeEventListener("abort", onAbort);
    h.close();
  }
}

/** Runs a handler body, every error as the Connect error the SDK maps. */
async function rpc<T>(fn: () => Promise<T>): Promise<T> {
  try {
    return await fn();
  } catch (err) {
    throw toConnectError(err);
  }
}

export function processService(deps: Deps, envs: SandboxEnvs): Partial<ServiceImpl<typeof Process>> {
  /** Terminals held by this process, per sandbox. */
  const ptys = new Map<string, Map<number, PtyEntry>>();
  let nextPty = PTY_PID_BASE;
  /** `${sandboxId}:${pid}` → its start config (insertion order: the oldest first). */
  const configs = new Map<string, Config>();

  const remember = (sandboxId: string, pid: number, c: Config) => {
    configs.set(`${sandboxId}:${pid}`, c);
    if (configs.size > MAX_REMEMBERED) configs.delete(configs.keys().next().value!);
  };
  const vm = (t: EnvdTarget): { agent: AgentVmApi; vmId: string; row: EnvdTarget["row"] } => ({
    agent: agentOf(deps, t.row),
    vmId: t.row.vmId!,
    row: t.row,
  });

  /** The pid a selector names (a tag: the one this gateway remembers). */
  const pidOf = (t: EnvdTarget, sel: ProcessSelector | undefined): number => {
    const s = sel?.selector;
    if (s?.case === "pid") return s.value;
    if (s?.case === "tag") {
      for (const [k, c] of configs) {
        const [sid, pid] = k.split(":");
        if (sid === t.sandboxId && c.tag === s.value) return Number(pid);
      }
      throw new SandboxdError("not_found", `no process tagged ${s.value}`);
    }
    throw new SandboxdError("bad_request", "a process selector (pid or tag) is required");
  };
  const ptyOf = (t: EnvdTarget, pid: number) => ptys.get(t.sandboxId)?.get(pid);
  /** The agent process the SDK's `pid` names (guest pid, or the agent's number: see sdkPid). */
  const agentProcess = async (t: EnvdTarget, pid: number): Promise<AgentProcessInfo> => {
    const { agent, vmId, row } = vm(t);
    return agentPidOf(await inTermsOf(row, agent.listProcesses(vmId)), pid);
  };
  const needPty = (t: EnvdTarget, pid: number): PtyEntry => {
    const e = ptyOf(t, pid);
    if (!e) throw new SandboxdError("not_found", `no terminal ${pid} in this sandbox`);
    return e;
  };

  /** The agent process's output from now on (`skip`: the bytes kept before), then its end. */
  function follow(t: EnvdTarget, pid: number, ctx: HandlerContext, skip = { stdout: 0, stderr: 0 }) {
    const { agent, vmId, row } = vm(t);
    const h = new Handoff();
    const ac = new AbortController();
    ctx.signal.addEventListener("abort", () => ac.abort(), { once: true });
    const left = { ...skip };
    void inTermsOf(
      row,
      agent.followProcess(vmId, pid, {
        signal: ac.signal,
        onOutput: (stream, chunk) => {
          let data = chunk;
          if (left[stream] > 0) {
            const n = Math.min(left[stream], data.length);
            left[stream] -= n;
            data = data.subarray(n);
            if (data.length === 0) return;
          }
          return h.put({ kind: stream, data });
        },
      }),
    ).then(
      (info) => h.finish(endOf(info)),
      (err: unknown) => (ac.signal.aborted ? h.close() : h.fail(toConnectError(err))),
    );
    return drain(h, ctx);
  }

  /**
   * The agent's terminal options for a `Start` with `pty`: the size (clamped to a u16, 80x24 when
   * absent), `process.cmd`+`args` as the argv (E2B's SDK sends `/bin/bash -i -l`; an empty cmd
   * means the image user's login shell), its envs over the terminal's own (the SDK adds TERM,
   * LANG, LC_ALL), its cwd, and the user `Authorization: Basic` names. Bounds are the agent's
   * (contracts/agent/pty.ts): past them the call is `invalid_argument`.
   */
  function ptyOpenOf(
    t: EnvdTarget,
    p: StartRequest["process"],
    size: { cols?: number; rows?: number } | undefined,
    sandboxEnvs: Record<string, string>,
  ): PtyOpen {
    const clamp = (n: number | undefined, d: number) => Math.min(65535, Math.max(1, n || d));
    const o: PtyOpen = { cols: clamp(size?.cols, 80), rows: clamp(size?.rows, 24) };
    if (p?.cmd) o.argv = [p.cmd, ...p.args];
    // The sandbox's own environment (E2B's envVars), under the call's.
    const env = { ...sandboxEnvs, ...(p?.envs ?? {}) };
    if (Object.keys(env).length > 0) o.env = env;
    if (p?.cwd) o.cwd = p.cwd;
    if (t.user !== undefined) o.user = t.user;
    return o;
  }

  async function* startPty(
    t: EnvdTarget,
    req: Parameters<NonNullable<ServiceImpl<typeof Process>["start"]>>[0],
    ctx: HandlerContext,
  ) {
    const { agent, vmId, row } = vm(t);
    const size = req.pty?.size;
    const max = deps.config.limits.relaysPerTenant;
    const release = deps.relays ? deps.relays.reserve(row.tenantId, max) : () => {};
    if (!release)
      throw new SandboxdError(
        "quota_exceeded",
        `this tenant already holds ${max} relays (connects and terminals)`,
      );
    let use: { end: () => Promise<void> } | undefined;
    let tunnel: PtyTunnel;
    try {
      // Counted in flight for the terminal's whole life, as a terminal WebSocket is.
      use = await beginUseOf(deps, t.principal, row, "connect");
      tunnel = await inTermsOf(
        row,
        agent.openPty(vmId, ptyOpenOf(t, req.process, size, await envs.of(deps, row))),
      );
    } catch (err) {
      release();
      void use?.end();
      throw err;
    }
    const pid = tunnel.pid ?? nextPty++;
    const config: Config = {
      cmd: req.process?.cmd ?? "/bin/bash",
      args: req.process?.args ?? [],
      envs: req.process?.envs ?? {},
      ...(req.process?.cwd ? { cwd: req.process.cwd } : {}),
      ...(req.tag ? { tag: req.tag } : {}),
    };
    const entry: PtyEntry = {
      pid,
      tunnel,
      writer: tunnel.writable.getWriter(),
      viewers: new Set(),
      config,
      killed: false,
    };
    const table = ptys.get(t.sandboxId) ?? new Map<number, PtyEntry>();
    ptys.set(t.sandboxId, table);
    table.set(pid, entry);
    remember(t.sandboxId, pid, config);
    const viewer = new Handoff();
    entry.viewers.add(viewer);
    // The pump: the terminal's output to every attached stream, each taking it before the next
    // chunk is read (the tunnel's credit window holds the shell meanwhile); none attached: dropped.
    void (async () => {
      const reader = tunnel.readable.getReader();
      try {
        for (;;) {
          const { done, value } = await reader.read();
          if (done) break;
          await Promise.all([...entry.viewers].map((v) => v.put({ kind: "pty", data: value })));
        }
      } catch {
        // The tunnel failed: the terminal is over, as when it closed.
      } finally {
        entry.end = entry.killed
          ? { exitCode: -1, exited: false, status: "signal: killed" }
          : { exitCode: 0, exited: true, status: "exit status 0" };
        for (const v of entry.viewers) v.finish(entry.end);
        table.delete(pid);
        tunnel.close();
        release();
        void use.end();
      }
    })();
    yield ev.start(pid);
    yield* drain(viewer, ctx);
    entry.viewers.delete(viewer);
  }

  return {
    async *start(req, ctx) {
      const t = targetOf(ctx);
      try {
        if (req.pty) {
          yield* startPty(t, req, ctx);
          return;
        }
        const p = req.process;
        if (!p || p.cmd === "") throw new SandboxdError("bad_request", "process.cmd is required");
        const start: ProcessStart = {
          run: { kind: "argv", commands: [[p.cmd, ...p.args]] },
          // E2B's processes run whether or not anyone calls: no idle pause under them.
          keepAwake: true,
        };
        // The sandbox's own environment (E2B's envVars), under the call's.
        const env = { ...(await envs.of(deps, t.row)), ...p.envs };
        if (Object.keys(env).length > 0) start.env = env;
        if (p.cwd) start.cwd = p.cwd;
        if (t.user !== undefined) start.user = t.user;
        const { agent, vmId, row } = vm(t);
        const info = await inTermsOf(row, agent.startProcess(vmId, start));
        remember(t.sandboxId, sdkPid(info), {
          cmd: p.cmd,
          args: p.args,
          envs: p.envs,
          ...(p.cwd ? { cwd: p.cwd } : {}),
          ...(req.tag ? { tag: req.tag } : {}),
        });
        if (!req.stdin) {
          try {
            await inTermsOf(row, agent.processStdin(vmId, info.pid, { dataB64: "", eof: true }));
          } catch (err) {
            // A command that ended before this close (a quick `pwd` can) had no stdin left to
            // close: the start stands. Any other failure is the call's.
            if (!(err instanceof SandboxdError && err.code === "conflict")) throw err;
          }
        }
        yield ev.start(sdkPid(info));
        yield* follow(t, info.pid, ctx);
      } catch (err) {
        throw toConnectError(err);
      }
    },

    async *connect(req: ConnectRequest, ctx) {
      const t = targetOf(ctx);
      try {
        const pid = pidOf(t, req.process);
        const pty = ptyOf(t, pid);
        if (pty) {
          if (pty.viewers.size >= MAX_PTY_VIEWERS)
            throw new SandboxdError(
              "rate_limited",
              `terminal ${pid} already has ${MAX_PTY_VIEWERS} streams attached`,
            );
          const viewer = new Handoff();
          pty.viewers.add(viewer);
          try {
            yield ev.start(pid);
            yield* drain(viewer, ctx);
          } finally {
            pty.viewers.delete(viewer);
          }
          return;
        }
        const { agent, vmId, row } = vm(t);
        const n = (await agentProcess(t, pid)).pid;
        // Output from now on: what the log kept before is skipped.
        const logs = await inTermsOf(row, agent.processLogs(vmId, n));
        yield ev.start(pid);
        if (!logs.process.running) {
          const end = endOf(logs.process);
          if (!end.exited) throw sandboxGone();
          yield ev.end(end);
          return;
        }
        yield* follow(t, n, ctx, {
          stdout: Buffer.byteLength(logs.stdoutB64, "base64"),
          stderr: Buffer.byteLength(logs.stderrB64, "base64"),
        });
      } catch (err) {
        throw toConnectError(err);
      }
    },

    list: (_req, ctx) =>
      rpc(async () => {
        const t = targetOf(ctx);
        const { agent, vmId, row } = vm(t);
        const procs = (await inTermsOf(row, agent.listProcesses(vmId))).filter((p) => p.running);
        const info = (pid: number, fallback: string) => {
          const c = configs.get(`${t.sandboxId}:${pid}`) ?? { cmd: fallback, args: [], envs: {} };
          const { tag, ...config } = c;
          return { pid, config, ...(tag !== undefined ? { tag } : {}) };
        };
        return {
          processes: [
            ...procs.map((p) => info(sdkPid(p), p.command)),
            ...[...(ptys.get(t.sandboxId)?.values() ?? [])].map((e) => info(e.pid, e.config.cmd)),
          ],
        };
      }),

    sendInput: (req, ctx) =>
      rpc(async () => {
        const t = targetOf(ctx);
        const pid = pidOf(t, req.process);
        const input = req.input?.input;
        if (input?.case === "pty") {
          await needPty(t, pid).writer.write(input.value);
          return {};
        }
        if (input?.case !== "stdin")
          throw new SandboxdError("bad_request", "input.stdin or input.pty is required");
        if (ptyOf(t, pid)) {
          await needPty(t, pid).writer.write(input.value);
          return {};
        }
        const { agent, vmId, row } = vm(t);
        const n = (await agentProcess(t, pid)).pid;
        await inTermsOf(
          row,
          agent.processStdin(vmId, n, { dataB64: Buffer.from(input.value).toString("base64") }),
        );
        return {};
      }),

    closeStdin: (req, ctx) =>
      rpc(async () => {
        const t = targetOf(ctx);
        const pid = pidOf(t, req.process);
        if (ptyOf(t, pid))
          throw new SandboxdError("bad_request", "a terminal has no stdin to close; send EOT (Ctrl-D)");
        const { agent, vmId, row } = vm(t);
        const n = (await agentProcess(t, pid)).pid;
        await inTermsOf(row, agent.processStdin(vmId, n, { dataB64: "", eof: true }));
        return {};
      }),

    sendSignal: (req, ctx) =>
      rpc(async () => {
        const t = targetOf(ctx);
        const pid = pidOf(t, req.process);
        if (req.signal !== Signal.SIGKILL && req.signal !== Signal.SIGTERM)
          throw new SandboxdError("bad_request", "signal must be SIGKILL or SIGTERM");
        const pty = ptyOf(t, pid);
        if (pty) {
          // Closing the terminal hangs it up: SIGHUP to the shell, SIGKILL to its session 1 s later.
          pty.killed = true;
          pty.tunnel.close();
          return {};
        }
        // Both signals kill the process group with SIGKILL: the agent's only way to end a process.
        const { agent, vmId, row } = vm(t);
        const p = await agentProcess(t, pid);
        if (!p.running) throw new SandboxdError("not_found", `no running process ${pid}`);
        await inTermsOf(row, agent.killProcess(vmId, p.pid));
        return {};
      }),

    update: (req, ctx) =>
      rpc(async () => {
        const t = targetOf(ctx);
        const pid = pidOf(t, req.process);
        const size = req.pty?.size;
        if (!size) return {};
        const e = ptyOf(t, pid);
        if (!e) {
          await agentProcess(t, pid); // none: not_found
          throw new ConnectError(`process ${pid} has no terminal to resize`, Code.FailedPrecondition);
        }
        e.tunnel.resize(Math.min(65535, Math.max(1, size.cols)), Math.min(65535, Math.max(1, size.rows)));
        return {};
      }),
  };
}
