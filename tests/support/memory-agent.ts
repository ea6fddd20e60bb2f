/**
 * STAND-IN FOR THE HOST AGENT, FOR GATEWAY TESTS ONLY. It keeps VMs and templates as objects in
 * memory and runs nothing: "exec" echoes its input. It exists to test the gateway's own logic
 * (auth, validation, tenancy, limits, state records, error mapping) through `AgentApi`; real-VM
 * end-to-end tests come with the real agent (agent/). Never wire it into a running service.
 */

import { readFile, rm } from "node:fs/promises";
import { connect, type Socket } from "node:net";
import { Duplex } from "node:stream";
import type {
  AgentApi,
  AgentHealth,
  CreatedVm,
  CreateVmOpts,
  ExecAction,
  ExecResult,
  ExecStreamOptions,
  FileAnswer,
  FileCall,
  OneShotResult,
  PtyTunnel,
  ResumeResult,
  SnapshotRef,
  SnapshotRestored,
  SnapshotTaken,
  SuspendResult,
  TemplateBuildStatus,
  TemplateRef,
  TemplateSource,
  Tunnel,
  VmEgress,
  VmId,
  VmMetrics,
  VmSummary,
} from "../../contracts/agent/api.ts";
import type { FsOp, FsOpAnswer } from "../../contracts/agent/fs-ops.ts";
import type { ProcessInfo, ProcessLogs, ProcessStart } from "../../contracts/agent/processes.ts";
import type { PtyOpen } from "../../contracts/agent/pty.ts";
import { SandboxdError } from "../../contracts/errors.ts";

interface MemVm {
  id: VmId;
  template: TemplateRef;
  state: "running" | "suspended";
  busy: boolean;
  files: Map<string, string>;
  /** Background processes by pid, with the output they wrote. */
  processes: Map<number, { info: ProcessInfo; stdout: string }>;
  /** The kept snapshot it was made from: its files stay while this VM lives (as the agent's chain holds). */
  snapshot?: SnapshotRef;
  /** The size class a create named (docs/templates.md "Size classes"); forks and snapshots keep it. */
  size?: { vcpus: number; memMib: number };
  /**
   * When it was made (`clock`), as the agent reports it: reconciliation leaves a VM younger than
   * the bring-up bound alone, since its create may still be on its way to a row.
   */
  createdAtMs: number;
}

/** A kept snapshot: the VM's files and processes as they were, and whether it was deleted. */
interface MemSnapshot {
  template: TemplateRef;
  files: Map<string, string>;
  processes: Map<number, { info: ProcessInfo; stdout: string }>;
  /** Deleted while VMs made from it ran: gone for the API, removed with its last VM. */
  deleting: boolean;
}

const RESOURCES = { vcpus: 2, memMib: 512, diskBytes: 1024 ** 3 };

export class MemoryAgent implements AgentApi {
  readonly vms = new Map<VmId, MemVm>();
  readonly templates = new Map<
    TemplateRef,
    TemplateBuildStatus & {
      source?: TemplateSource;
      uploadBytes?: number;
      uploadHead?: string;
      /** Deleted while VMs ran on it: gone for the API, removed with its last VM (as the agent does). */
      deleting?: boolean;
    }
  >();
  readonly calls: string[] = [];
  /** Kept snapshots by ref (`takeSnapshot`); a deleted one stays while VMs made from it live. */
  readonly snapshots = new Map<SnapshotRef, MemSnapshot>();
  /** While set, the stand-in answers as a region with no live agent: builds refused, health not ok. */
  absent = false;
  /** While set, one-shot execs wait for it (a test holds them in flight). */
  execOnceGate: Promise<void> | undefined;
  /** Slots left; createSandbox/fork throw at_capacity at 0. */
  slotsFree = 1000;
  /**
   * Where `openTunnel` goes: guest port -> a real TCP port on 127.0.0.1 (a test's own server),
   * so the gateway's relays run over real sockets up to this boundary.
   */
  readonly tunnelTargets = new Map<number, number>();
  /** Tunnels opened, as `vmId:port`, and the sockets still open. */
  readonly tunnelsOpened: string[] = [];
  /** Bytes the gateway has read from all tunnels (what left the "guest" towards the client). */
  tunnelBytesRead = 0;
  readonly openTunnelSockets = new Set<Socket>();
  /** When set, the next exec waits for this promise (to test `busy`). */
  execGate: Promise<void> | null = null;
  private seq = 0;
  /** The time VMs are made at: the wall clock, or a harness's stepped one. */
  clock: () => number = Date.now;

  /** Registers a ready template directly (as if built earlier). */
  addReadyTemplate(ref: TemplateRef, exposedPorts: number[] = []): void {
    this.templates.set(ref, { status: "ready", phase: "Live", exposedPorts, telemetry: {}, readyAtMs: 0 });
  }

  /** Completes a pending build. */
  finishBuild(ref: TemplateRef, ok: boolean, error?: string): void {
    const t = this.templates.get(ref);
    if (!t) throw new Error(`no template ${ref}`);
    t.status = ok ? "ready" : "failed";
    t.phase = ok ? "Live" : "Failed";
    if (!ok) t.error = error ?? "build failed";
    if (ok) t.readyAtMs = 1_700_000_000_000;
  }

  private template(ref: TemplateRef): TemplateBuildStatus {
    const t = this.templates.get(ref);
    if (!t) throw new SandboxdError("not_found", `template ${ref} unknown to agent`);
    if (t.deleting) throw new SandboxdError("not_found", `template ${ref} is being deleted`);
    return t;
  }

  /** A template marked deleting goes with its last VM (agent/sandbox/manager.ts reclaimTemplates). */
  private reclaim(ref: TemplateRef): void {
    if (!this.templates.get(ref)?.deleting) return;
    if (![...this.vms.values()].some((v) => v.template === ref)) this.templates.delete(ref);
  }

  private vm(id: VmId): MemVm {
    const vm = this.vms.get(id);
    if (!vm) throw new SandboxdError("gone", `vm ${id} is gone`);
    return vm;
  }

  private spawn(template: TemplateRef, size?: { vcpus: number; memMib: number }): CreatedVm {
    const t = this.template(template);
    if (t.status !== "ready") throw new SandboxdError("template_not_ready", `template ${template} not ready`);
    if (this.slotsFree <= 0) throw new SandboxdError("at_capacity", "no capacity on this host");
    this.slotsFree--;
    const id = `vm-${++this.seq}`;
    const vm: MemVm = {
      id,
      template,
      state: "running",
      busy: false,
      files: new Map(),
      processes: new Map(),
      createdAtMs: this.clock(),
    };
    if (size) vm.size = size;
    this.vms.set(id, vm);
    const endpoints = Object.fromEntries(t.exposedPorts.map((p) => [String(p), `${id}:${p}`]));
    return { vmId: id, forkTimeMs: 1.5, createTimeMs: 3, endpoints, resources: { ...RESOURCES, ...size } };
  }

  private run(vm: MemVm | null, action: ExecAction): ExecResult {
    const files = vm?.files ?? new Map<string, string>();
    for (const f of action.files) files.set(f.path, f.content);
    const r = action.run;
    let stdout = "";
    if (r.kind === "code") stdout = r.code;
    else if (r.kind === "shell")
      stdout = r.command.startsWith("cat ") ? (files.get(r.command.slice(4)) ?? "") : r.command;
    else if (r.kind === "argv") stdout = r.commands.at(-1)!.join(" ");
    const out: ExecResult = { stdout, stderr: "", exitCode: 0, execTimeMs: 1, totalTimeMs: 2 };
    if (action.seed !== undefined) out.seedAck = "verified";
    return out;
  }

  async createSandbox(template: TemplateRef, opts: CreateVmOpts): Promise<CreatedVm> {
    this.calls.push(`create ${template} ${opts.kind}`);
    // A size class the gateway chose (it checked the template has it), as the agent's own create.
    const size =
      opts.vcpus !== undefined || opts.memMib !== undefined
        ? { vcpus: opts.vcpus ?? RESOURCES.vcpus, memMib: opts.memMib ?? RESOURCES.memMib }
        : undefined;
    return this.spawn(template, size);
  }

  async execOnce(template: TemplateRef, action: ExecAction): Promise<OneShotResult> {
    this.calls.push(`execOnce ${template}`);
    const t = this.template(template);
    if (t.status !== "ready") throw new SandboxdError("template_not_ready", `template ${template} not ready`);
    if (this.execOnceGate) await this.execOnceGate;
    return { ...this.run(null, action), forkTimeMs: 1.5, resources: { ...RESOURCES } };
  }

  async exec(vmId: VmId, action: ExecAction): Promise<ExecResult> {
    const vm = this.vm(vmId);
    if (vm.busy) throw new SandboxdError("busy", `an exec is in flight on ${vmId}`);
    vm.busy = true;
    try {
      if (this.execGate) await this.execGate;
      return this.run(vm, action);
    } finally {
      vm.busy = false;
    }
  }

  /** The whole output at once, as two chunks: the stand-in has no guest that streams. */
  async execStream(vmId: VmId, action: ExecAction, opts: ExecStreamOptions): Promise<ExecResult> {
    const r = await this.exec(vmId, action);
    opts.onOpen?.(); // as the agent does once the guest started the command
    if (r.stdout) await opts.onOutput("stdout", Buffer.from(r.stdout));
    if (r.stderr) await opts.onOutput("stderr", Buffer.from(r.stderr));
    await this.heldOpen(opts.signal);
    return { ...r, stdout: "", stderr: "" };
  }

  /**
   * With `holdStreams`, a streamed exec, a followed log and a download stay open after their
   * output until their call is aborted (the client went away, the key was revoked), as a long command's and a
   * running process's do; `streamsHeld` counts those open now, `streamsAborted` those ended so.
   */
  holdStreams = false;
  streamsHeld = 0;
  streamsAborted = 0;
  private async heldOpen(signal: AbortSignal | undefined): Promise<void> {
    if (!this.holdStreams || !signal) return;
    this.streamsHeld++;
    try {
      await new Promise<never>((_, reject) => {
        const abort = () => {
          this.streamsAborted++;
          reject(new SandboxdError("internal", "the streamed call was aborted"));
        };
        if (signal.aborted) abort();
        else signal.addEventListener("abort", abort, { once: true });
      });
    } finally {
      this.streamsHeld--;
    }
  }

  async fork(vmId: VmId, count: number): Promise<CreatedVm[]> {
    const vm = this.vm(vmId);
    if (vm.busy) throw new SandboxdError("busy", `an exec is in flight on ${vmId}`);
    const out: CreatedVm[] = [];
    for (let i = 0; i < count; i++) {
      const child = this.spawn(vm.template, vm.size);
      this.vms.get(child.vmId)!.files = new Map(vm.files);
      out.push(child);
    }
    return out;
  }

  async takeSnapshot(vmId: VmId, ref: SnapshotRef): Promise<SnapshotTaken> {
    this.calls.push(`snapshot ${vmId} ${ref}`);
    const vm = this.vm(vmId);
    if (vm.busy) throw new SandboxdError("busy", `an exec is in flight on ${vmId}`);
    if (vm.state !== "running") throw new SandboxdError("invalid_state", `vm ${vmId} is ${vm.state}`);
    if (this.snapshots.has(ref)) throw new SandboxdError("conflict", `snapshot ${ref} exists`);
    this.snapshots.set(ref, {
      template: vm.template,
      files: new Map(vm.files),
      processes: copyProcesses(vm.processes),
      deleting: false,
    });
    const size = [...vm.files.values()].reduce((n, c) => n + c.length, 0) + 512 * 1024 * 1024;
    return { snapshot: ref, sizeBytes: size, stallMs: 1, resources: { ...RESOURCES, ...vm.size } };
  }

  /** As the real agent (agent/sandbox/kept.ts restoreSandbox): files and processes become the snapshot's. */
  async restoreSnapshot(vmId: VmId, ref: SnapshotRef): Promise<SnapshotRestored> {
    this.calls.push(`restore ${vmId} ${ref}`);
    const vm = this.vm(vmId);
    const snap = this.snapshots.get(ref);
    if (!snap || snap.deleting)
      throw new SandboxdError("not_found", `snapshot ${ref} is not kept on this agent`);
    if (vm.busy) throw new SandboxdError("busy", `an exec is in flight on ${vmId}`);
    if (vm.state !== "running") throw new SandboxdError("conflict", `vm ${vmId} is ${vm.state}`);
    if (snap.template !== vm.template)
      throw new SandboxdError("conflict", `snapshot ${ref} is of template ${snap.template}`);
    vm.files = new Map(snap.files);
    vm.processes = copyProcesses(snap.processes);
    return { snapshot: ref, restoreMs: 1, downMs: 1, standby: false, resources: { ...RESOURCES } };
  }

  async createFromSnapshot(ref: SnapshotRef, opts: CreateVmOpts): Promise<CreatedVm> {
    this.calls.push(`create-from ${ref} ${opts.kind}`);
    const snap = this.snapshots.get(ref);
    if (!snap || snap.deleting) throw new SandboxdError("not_found", `snapshot ${ref} unknown to agent`);
    const created = this.spawn(snap.template);
    const vm = this.vms.get(created.vmId)!;
    vm.files = new Map(snap.files);
    vm.processes = copyProcesses(snap.processes);
    vm.snapshot = ref;
    return created;
  }

  async deleteSnapshot(ref: SnapshotRef): Promise<void> {
    this.calls.push(`delete-snapshot ${ref}`);
    const snap = this.snapshots.get(ref);
    if (!snap) return;
    snap.deleting = true;
    this.reclaimSnapshot(ref);
  }

  /** A snapshot marked deleting goes with the last VM made from it (the agent's chain store frees its files then). */
  private reclaimSnapshot(ref: SnapshotRef | undefined): void {
    if (!ref || !this.snapshots.get(ref)?.deleting) return;
    if (![...this.vms.values()].some((v) => v.snapshot === ref)) this.snapshots.delete(ref);
  }

  async suspend(vmId: VmId): Promise<SuspendResult> {
    const vm = this.vm(vmId);
    vm.state = "suspended";
    return { memBytes: 512 * 1024 * 1024, snapshotBytes: 2 * 1024 ** 3 };
  }

  async resume(vmId: VmId): Promise<ResumeResult> {
    const vm = this.vm(vmId);
    vm.state = "running";
    return { memBytes: 512 * 1024 * 1024, resources: { ...RESOURCES } };
  }

  async destroy(vmId: VmId, opts: { force: boolean }): Promise<void> {
    this.calls.push(`destroy ${vmId} force=${opts.force}`);
    const vm = this.vms.get(vmId);
    if (this.vms.delete(vmId)) this.slotsFree++;
    if (vm) this.reclaim(vm.template);
    this.reclaimSnapshot(vm?.snapshot);
  }

  async buildTemplate(template: TemplateRef, source: TemplateSource): Promise<void> {
    this.calls.push(`build ${template} ${source.kind}`);
    if (this.absent) {
      // As the router answers while no agent of the region is live (gateway/agents/router.ts).
      throw new SandboxdError("agent_unavailable", "no live agent in region local to build on", {
        details: { noLiveAgent: true },
      });
    }
    const existing = this.templates.get(template);
    if (existing?.deleting) throw new SandboxdError("conflict", `template ${template} is being deleted`);
    if (existing && existing.status !== "failed") {
      throw new SandboxdError("conflict", `template ${template} already exists (${existing.status})`);
    }
    const entry: TemplateBuildStatus & {
      source?: TemplateSource;
      uploadBytes?: number;
      uploadHead?: string;
    } = {
      status: "building",
      phase: "Pending",
      exposedPorts: source.kind === "oci" ? (source.ready?.ports ?? []) : [],
      telemetry: { stand_in: true },
      source,
    };
    if (source.kind === "upload") {
      // The agent owns the uploaded file: read what the test needs, then remove it.
      const bytes = await readFile(source.path);
      entry.uploadBytes = bytes.byteLength;
      entry.uploadHead = bytes.subarray(0, 16).toString("latin1");
      await rm(source.path, { force: true });
    }
    this.templates.set(template, entry);
  }

  /**
   * A ready template's "bundle": its status as JSON (the stand-in has no files). The real bundle
   * and its checks are the agent's (agent/snapshot/template-copy.ts, tests/vm/template-copy.test.ts).
   */
  async exportTemplate(template: TemplateRef): Promise<ReadableStream<Uint8Array>> {
    this.calls.push(`export ${template}`);
    const t = this.template(template);
    if (t.status !== "ready")
      throw new SandboxdError("template_not_ready", `template ${template} is ${t.status}`);
    return new Response(JSON.stringify({ exposedPorts: t.exposedPorts })).body as ReadableStream<Uint8Array>;
  }

  /** Takes a stand-in bundle (exportTemplate): building, as a copy is until the test settles it. */
  async copyTemplate(template: TemplateRef, bundle: ReadableStream<Uint8Array>): Promise<void> {
    this.calls.push(`copy ${template}`);
    const { exposedPorts } = JSON.parse(await new Response(bundle).text()) as { exposedPorts: number[] };
    const existing = this.templates.get(template);
    if (existing && existing.status !== "failed")
      throw new SandboxdError("conflict", `template ${template} already exists (${existing.status})`);
    this.templates.set(template, {
      status: "building",
      phase: "Pending",
      exposedPorts,
      telemetry: { stand_in: true },
    });
  }

  async templateStatus(template: TemplateRef): Promise<TemplateBuildStatus> {
    const { status, phase, error, readyAtMs, exposedPorts, telemetry } = this.template(
      template,
    ) as TemplateBuildStatus;
    const out: TemplateBuildStatus = { status, phase, exposedPorts, telemetry };
    if (error !== undefined) out.error = error;
    if (readyAtMs !== undefined) out.readyAtMs = readyAtMs;
    return out;
  }

  async deleteTemplate(template: TemplateRef): Promise<void> {
    this.calls.push(`deleteTemplate ${template}`);
    const t = this.templates.get(template);
    if (!t) return;
    // As the agent: with VMs still on it, it is marked deleting and goes with the last of them.
    t.deleting = true;
    this.reclaim(template);
  }

  async expectWidth(template: TemplateRef, width: number): Promise<void> {
    this.calls.push(`expect ${template} ${width}`);
  }

  async releaseTemplate(template: TemplateRef): Promise<void> {
    this.calls.push(`release ${template}`);
  }

  // Background processes run nothing, as exec runs nothing: a process has ended at once, exit 0,
  // with its command line as its output. The real ones: tests/e2e/processes.test.ts.
  private process(vmId: VmId, pid: number): { info: ProcessInfo; stdout: string } {
    const p = this.vm(vmId).processes.get(pid);
    if (!p) throw new SandboxdError("not_found", `no background process ${pid}`);
    return p;
  }
  async startProcess(vmId: VmId, req: ProcessStart): Promise<ProcessInfo> {
    const vm = this.vm(vmId);
    const command = req.run.kind === "shell" ? req.run.command : req.run.commands.flat().join(" ");
    const pid = vm.processes.size + 1;
    // With `holdStreams` a process runs until killed, so that following it lasts.
    const info: ProcessInfo = {
      pid,
      command,
      running: this.holdStreams,
      exitCode: this.holdStreams ? null : 0,
      keepAwake: req.keepAwake ?? false,
      startedAtMs: 0,
    };
    vm.processes.set(pid, { info, stdout: command });
    return info;
  }
  async listProcesses(vmId: VmId): Promise<ProcessInfo[]> {
    return [...this.vm(vmId).processes.values()].map((p) => p.info);
  }
  async processLogs(vmId: VmId, pid: number): Promise<ProcessLogs> {
    const p = this.process(vmId, pid);
    const stdoutB64 = Buffer.from(p.stdout).toString("base64");
    return { stdoutB64, stderrB64: "", truncated: false, process: p.info };
  }
  async followProcess(vmId: VmId, pid: number, opts: ExecStreamOptions): Promise<ProcessInfo> {
    const p = this.process(vmId, pid);
    opts.onOpen?.();
    await opts.onOutput("stdout", new TextEncoder().encode(p.stdout));
    await this.heldOpen(opts.signal);
    return p.info;
  }
  async processStdin(vmId: VmId, pid: number): Promise<void> {
    this.process(vmId, pid);
    throw new SandboxdError("conflict", `background process ${pid} has ended`);
  }
  async killProcess(vmId: VmId, pid: number): Promise<ProcessInfo> {
    const p = this.process(vmId, pid);
    if (p.info.running) p.info = { ...p.info, running: false, exitCode: 137 };
    return p.info;
  }
  /** A terminal that echoes what is typed, as a line discipline does; `ptyResizes` records sizes. */
  readonly ptyResizes: { cols: number; rows: number }[] = [];
  async openPty(vmId: VmId, _opts: PtyOpen): Promise<PtyTunnel> {
    this.vm(vmId);
    let end!: TransformStreamDefaultController<Uint8Array>;
    const echo = new TransformStream<Uint8Array, Uint8Array>({
      start: (c) => {
        end = c;
      },
    });
    return {
      readable: echo.readable,
      writable: echo.writable,
      // Ends both sides even while the relay holds them locked, as a closed socket would.
      close: () => end.terminate(),
      resize: (cols, rows) => {
        this.ptyResizes.push({ cols, rows });
      },
    };
  }
  /** Filesystem ops are not modelled here: the real ones run GNU tools in the guest. */
  async fsOp(vmId: VmId, op: FsOp): Promise<FsOpAnswer> {
    this.vm(vmId);
    if (op.op === "home") return { home: "/root" };
    throw new SandboxdError("invalid_file", `the memory agent has no ${op.op}`);
  }
  /** Files are the VM's `files` map: exec's `files` and `cat` see the same ones. */
  async files(vmId: VmId, call: FileCall): Promise<FileAnswer> {
    const files = this.vm(vmId).files;
    const missing = () => new SandboxdError("not_found", `no such file ${call.path}`);
    if (call.op === "upload") {
      const bytes = new Uint8Array(await new Response(call.body).arrayBuffer());
      files.set(call.path, new TextDecoder().decode(bytes));
      return { op: "upload", written: { path: call.path, size: bytes.length } };
    }
    if (call.op === "download") {
      const content = files.get(call.path);
      if (content === undefined) throw missing();
      if (!this.holdStreams) return { op: "download", body: new Response(content).body! };
      // With `holdStreams` the file's bytes come, then the body stays open until it is cancelled,
      // as a large file's transfer to a slow client does.
      const bytes = new TextEncoder().encode(content);
      let sent = false;
      this.streamsHeld++;
      const body = new ReadableStream<Uint8Array>({
        pull: (ctl) => {
          if (!sent) {
            sent = true;
            ctl.enqueue(bytes);
          }
          return new Promise<void>(() => {});
        },
        cancel: () => {
          this.streamsHeld--;
          this.streamsAborted++;
        },
      });
      return { op: "download", body };
    }
    if (call.op === "remove") {
      if (!files.delete(call.path)) throw missing();
      return { op: "remove" };
    }
    const dir = `${call.path.replace(/\/+$/, "")}/`;
    const entries = [...files.entries()]
      .filter(([path]) => path.startsWith(dir) && !path.slice(dir.length).includes("/"))
      .map(([path, content]) => ({
        name: path.slice(dir.length),
        type: "file" as const,
        size: Buffer.byteLength(content),
        mode: 0o644,
        mtime: 0,
      }));
    return { op: "list", list: { path: call.path, entries } };
  }

  async openTunnel(vmId: VmId, port: number): Promise<Tunnel> {
    const vm = this.vm(vmId);
    if (vm.state !== "running") throw new SandboxdError("conflict", `vm ${vmId} is ${vm.state}`);
    const target = this.tunnelTargets.get(port);
    if (target === undefined)
      throw new SandboxdError("port_not_exposed", `no tunnel target for port ${port}`);
    this.tunnelsOpened.push(`${vmId}:${port}`);
    const socket = connect(target, "127.0.0.1");
    await new Promise<void>((resolve, reject) => {
      socket.once("connect", resolve);
      // As the agent: a refused connect inside the "guest" is port_unreachable.
      socket.once("error", (err) =>
        reject(new SandboxdError("port_unreachable", `cannot connect to port ${port}: ${err.message}`)),
      );
    });
    this.openTunnelSockets.add(socket);
    socket.once("close", () => this.openTunnelSockets.delete(socket));
    const { readable, writable } = Duplex.toWeb(socket);
    const counted = (readable as ReadableStream<Uint8Array>).pipeThrough(
      new TransformStream<Uint8Array, Uint8Array>({
        transform: (chunk, c) => {
          this.tunnelBytesRead += chunk.byteLength;
          c.enqueue(chunk);
        },
      }),
    );
    return {
      readable: counted,
      writable: writable as WritableStream<Uint8Array>,
      close: () => socket.destroy(),
    };
  }

  async health(): Promise<AgentHealth> {
    return {
      ok: !this.absent,
      version: "stand-in",
      capacity: { slotsFree: this.slotsFree, slotsTotal: 1000, vcpusFree: 64, memMibFree: 65536 },
    };
  }

  async listVms(): Promise<VmSummary[]> {
    return [...this.vms.values()].map((vm) => ({ id: vm.id, state: vm.state, createdAtMs: vm.createdAtMs }));
  }
  /** The list as given (the syntax is checked by the gateway before, by the real agent too). */
  async setEgress(vmId: VmId, egressAllow: string[]): Promise<VmEgress> {
    this.vm(vmId);
    this.calls.push(`setEgress ${vmId}`);
    return { egressAllow };
  }

  /** The kept snapshots not dropped (a dropped one whose files VMs still hold is not listed). */
  async listSnapshots(): Promise<SnapshotRef[]> {
    return [...this.snapshots].filter(([, s]) => !s.deleting).map(([ref]) => ref);
  }
  /** One made-up sample per VM (no QEMU to read here; tests/vm/live-metrics.test.ts reads real ones). */
  async metrics(vmId: VmId): Promise<VmMetrics> {
    const vm = this.vm(vmId);
    this.calls.push(`metrics ${vmId}`);
    return {
      state: vm.state,
      vcpus: RESOURCES.vcpus,
      memLimitBytes: RESOURCES.memMib * 1024 * 1024,
      intervalMs: 2000,
      samples: [
        {
          atMs: 1_700_000_000_000,
          cpuPercent: 12.5,
          memUsedBytes: 1 << 24,
          memResidentBytes: 1 << 25,
          diskBytes: 1 << 20,
        },
      ],
    };
  }
}

function copyProcesses(
  from: Map<number, { info: ProcessInfo; stdout: string }>,
): Map<number, { info: ProcessInfo; stdout: string }> {
  return new Map([...from].map(([pid, p]) => [pid, { info: { ...p.info }, stdout: p.stdout }]));
}
