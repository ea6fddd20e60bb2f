/**
 * The calls that reach a sandbox's guest beside its exec (manager.ts): tunnels to guest ports,
 * terminals, the file API's hold on the guest, background processes, and the connections guest
 * programs open to their egress proxy. Apart from manager.ts so that file stays about the
 * lifecycle; the manager hands in what these need of it (`GuestAccessHost`) and answers its public
 * methods from here.
 */
import { Duplex } from "node:stream";
import type { PtyOpen } from "../../contracts/agent/pty.ts";
import { describeError, SandboxdError } from "../../contracts/errors.ts";
import type { EgressFence } from "../egress/fence.ts";
import { EgressPolicy } from "../egress/policy.ts";
import { type OpenEgress, serveEgressConnection } from "../egress/proxy.ts";
import { type GuestClient, GuestError, type GuestTunnel, type PtyOptions } from "../guest/client.ts";
import type { DriverVm, SandboxDriver } from "./drivers/driver.ts";
import { planPty } from "./exec.ts";
import { resolveExecUser } from "./exec-run.ts";
import type { Sandbox } from "./manager-types.ts";
import { ProcessTable } from "./processes.ts";
import { type AgentSandboxState, isTerminal } from "./states.ts";

/** Refused egress attempts kept per sandbox for `info`: enough to see a pattern, bounded memory. */
const EGRESS_REFUSED_KEPT = 50;

/** What the guest calls need of the manager: its records, its one state path, its idle pause. */
export interface GuestAccessHost {
  driver: SandboxDriver;
  fence: EgressFence;
  log: (msg: string) => void;
  /** The live record; `not_found` when unknown. */
  get(id: string): Sandbox;
  find(id: string): Sandbox | undefined;
  setState(sb: Sandbox, to: AgentSandboxState): void;
  wake(sb: Sandbox): Promise<void>;
  goneError(sb: Sandbox): SandboxdError;
  tunnelsChanged(sb: Sandbox): void;
  armIdle(sb: Sandbox): void;
  clearIdle(sb: Sandbox): void;
  /** Writes the sandbox's record (records.ts): what an agent restart reads back. */
  persist(sb: Sandbox): Promise<void>;
}

export class GuestAccess {
  constructor(private readonly h: GuestAccessHost) {}

  /**
   * A sandbox whose VM runs (or only idle-paused: it is marked running again), counted as a
   * tunnel being opened so it is not idle-paused meanwhile; the caller ends the count
   * (`tunnelOpens--` then `tunnelsChanged`). Any other state is `conflict`, `gone` once terminal.
   */
  private holdAwake(id: string, what: string): Sandbox {
    const sb = this.h.get(id);
    if (isTerminal(sb.state)) throw this.h.goneError(sb);
    if (sb.state === "paused") this.h.setState(sb, "running");
    if (sb.state !== "running" && sb.state !== "busy") {
      throw new SandboxdError("conflict", `sandbox ${id} is ${sb.state}: ${what} a running VM`, {
        details: { id, state: sb.state },
      });
    }
    sb.tunnelOpens++;
    this.h.clearIdle(sb);
    return sb;
  }

  /**
   * The guest of a sandbox for a call that runs beside its exec (the file API, files.ts): an
   * idle-paused VM is woken first, as for a tunnel, and it is not idle-paused again until
   * `release` (counted with the tunnels being opened: a paused guest would stall the transfer).
   * Any state but running, busy or paused is `conflict` (`gone` once terminal).
   */
  async holdGuest(
    id: string,
  ): Promise<{ guest: GuestClient; image: DriverVm["image"]; release: () => void }> {
    const sb = this.holdAwake(id, "file calls need");
    let held = true;
    const release = () => {
      if (!held) return;
      held = false;
      sb.tunnelOpens--;
      sb.lastUsedAtMs = Date.now();
      this.h.tunnelsChanged(sb);
    };
    try {
      await this.h.wake(sb);
      const vm = sb.vm;
      if (!vm) throw this.h.goneError(sb);
      return { guest: vm.guest, image: vm.image, release };
    } catch (err) {
      release();
      throw err;
    }
  }

  /**
   * A byte tunnel to 127.0.0.1:`port` inside the sandbox's VM (connect-from-outside: docs/connect.md "Rules of connect URLs"),
   * over the guest agent's channel. Only a VM that runs: an idle-paused one is woken first, one
   * busy with an exec is fine, any other state is `conflict` (`gone` once terminal). While a
   * tunnel is open the VM is never idle-paused: a paused guest would freeze a live connection
   * that the client cannot see as idle. Destroy, failure and suspend end its tunnels at once.
   * Nothing accepting connections on the port inside the guest is `port_unreachable`. Which
   * ports a client may reach is the gateway's rule (exposed ports, docs/sandboxes.md "Rules of the sandboxes API"), not ours.
   */
  async openTunnel(id: string, port: number): Promise<GuestTunnel> {
    return this.guestStream(
      id,
      (vm) => this.h.driver.openTunnel(vm, port),
      (err) =>
        new SandboxdError(
          "port_unreachable",
          `sandbox ${id}: cannot connect to port ${port} inside the VM: ${err.message}`,
          { cause: err, details: { id, port, errno: err.errno } },
        ),
    );
  }

  /**
   * An interactive shell on a new pseudo-terminal in the sandbox's VM, as a tunnel to its master
   * (`resize` sets the window size). The same rules as `openTunnel`: an idle-paused VM is woken,
   * and while the terminal is open the VM is never idle-paused. The shell (or `opts.argv`) runs
   * as the image's user, or `opts.user` resolved as an exec's (exec-run.ts `resolveExecUser`: an
   * unknown name is `bad_request`), with the environment and directory of exec.ts `planPty`.
   */
  async openPty(id: string, opts: PtyOpen): Promise<GuestTunnel> {
    return this.guestStream(
      id,
      async (vm) => {
        const user = opts.user === undefined ? undefined : await resolveExecUser(vm.guest, opts.user);
        const plan: PtyOptions = { ...planPty(vm.image, opts, user), cols: opts.cols, rows: opts.rows };
        if (opts.argv !== undefined) plan.argv = opts.argv;
        return this.h.driver.openPty(vm, plan);
      },
      (err) =>
        new SandboxdError("internal", `sandbox ${id}: the guest could not start a terminal: ${err.message}`, {
          cause: err,
          details: { id, errno: err.errno },
        }),
    );
  }

  /**
   * Opens a tunnel-like guest stream (a port, a terminal) on a running VM and keeps the VM from
   * being idle-paused while it is open; `refused` words the guest's own refusal.
   */
  private async guestStream(
    id: string,
    open: (vm: DriverVm) => Promise<GuestTunnel>,
    refused: (err: GuestError) => SandboxdError,
  ): Promise<GuestTunnel> {
    const sb = this.holdAwake(id, "a tunnel needs");
    try {
      await this.h.wake(sb);
      const vm = sb.vm;
      if (!vm) throw this.h.goneError(sb);
      const t = await open(vm);
      if (isTerminal(sb.state) || sb.vm !== vm) {
        t.abort(this.h.goneError(sb)); // destroyed or failed while connecting
        throw this.h.goneError(sb);
      }
      sb.tunnels.add(t);
      sb.lastUsedAtMs = Date.now();
      t.onEnd(() => {
        sb.tunnels.delete(t);
        this.h.tunnelsChanged(sb);
      });
      return t;
    } catch (err) {
      if (err instanceof GuestError && err.code === "guest_error") throw refused(err);
      if (err instanceof GuestError) {
        throw sb.died || isTerminal(sb.state)
          ? this.h.goneError(sb)
          : new SandboxdError("internal", `tunnel to sandbox ${id}: ${describeError(err)}`, { cause: err });
      }
      throw err;
    } finally {
      sb.tunnelOpens--;
      this.h.tunnelsChanged(sb);
    }
  }

  /**
   * The sandbox's background processes (processes.ts). With `awake`, for a call that needs the
   * guest (start, stdin, kill): only a VM that runs or runs an exec, woken from its idle pause,
   * and the call counts as use for the idle pause; otherwise `conflict` (`gone` once terminal).
   */
  async processTable(id: string, awake: boolean): Promise<{ table: ProcessTable; vm?: DriverVm }> {
    const sb = this.h.get(id);
    sb.procs ??= new ProcessTable(() => this.h.tunnelsChanged(sb));
    if (!awake) return { table: sb.procs };
    if (isTerminal(sb.state)) throw this.h.goneError(sb);
    if (sb.state === "paused") this.h.setState(sb, "running");
    if (sb.state !== "running" && sb.state !== "busy") {
      throw new SandboxdError("conflict", `sandbox ${id} is ${sb.state}: processes need a running VM`, {
        details: { id, state: sb.state },
      });
    }
    await this.h.wake(sb);
    if (!sb.vm) throw this.h.goneError(sb);
    sb.lastUsedAtMs = Date.now();
    if (sb.state === "running") this.h.armIdle(sb);
    return { table: sb.procs, vm: sb.vm };
  }

  /**
   * Serves one connection a guest program opened to its egress proxy (agent/egress/proxy.ts),
   * under the sandbox's allow-list. Refused attempts are logged and kept per sandbox (`info`).
   * An unknown or ended sandbox gets its stream closed.
   */
  egressConnection(id: string, stream: Duplex): Promise<void> {
    const sb = this.h.find(id);
    if (!sb || isTerminal(sb.state)) {
      stream.destroy();
      return Promise.resolve();
    }
    return serveEgressConnection(stream, {
      sandboxId: id,
      policy: sb.egress,
      fence: this.h.fence,
      connectLocal: async (port) => {
        const t = await this.openTunnel(id, port);
        return Duplex.fromWeb({ readable: t.readable, writable: t.writable });
      },
      onAttempt: (a) => {
        if (a.allowed) return;
        sb.egressRefused.push(a);
        if (sb.egressRefused.length > EGRESS_REFUSED_KEPT) sb.egressRefused.shift();
      },
      onOpen: (c) => {
        sb.egressOpen.add(c);
        // A new allow-list that landed while this one was being resolved and connected.
        if (!sb.egress.allows(c.host)) this.closeRefused(sb, c);
        return () => sb.egressOpen.delete(c);
      },
      log: this.h.log,
    });
  }

  /**
   * Replaces a sandbox's egress allow-list (docs/egress.md "Changing a sandbox's egress"): every
   * connection from now on is checked against it, the open ones it does not allow are closed, and
   * the record on disk keeps it, so a resume, a fork and an agent restart all see it. A suspended
   * or idle-paused sandbox takes it as it is (it has no open connection); one being created or
   * deleted is `conflict`, an ended one `gone`. A malformed list is `bad_request`, nothing changed.
   */
  async setEgress(id: string, allow: readonly string[]): Promise<{ egressAllow: string[] }> {
    const policy = EgressPolicy.fromAllowList(allow);
    const sb = this.h.get(id);
    if (sb.state === "creating" || sb.state === "destroying") {
      throw new SandboxdError("conflict", `sandbox ${id} is ${sb.state}: its egress cannot change now`, {
        details: { id, state: sb.state },
      });
    }
    if (isTerminal(sb.state)) throw this.h.goneError(sb);
    sb.egress = policy;
    for (const c of [...sb.egressOpen]) if (!policy.allows(c.host)) this.closeRefused(sb, c);
    await this.h.persist(sb);
    return { egressAllow: [...policy.entries] };
  }

  private closeRefused(sb: Sandbox, c: OpenEgress): void {
    this.h.log(`egress closed: sandbox ${sb.id} -> ${c.host}:${c.port} (no longer in egress.allow)`);
    sb.egressOpen.delete(c);
    c.close();
  }
}
