import { afterAll, describe, expect, test } from "bun:test";
import { type ChildProcess, spawn } from "node:child_process";
import { existsSync, mkdirSync, mkdtempSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { readFile } from "node:fs/promises";
import { createServer, type Server, type Socket } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { SandboxdError } from "../../contracts/errors.ts";
import {
  adoptQemu,
  argvNamesDir,
  claimVm,
  isQemuArgv,
  isQemuFor,
  killQemu,
  killQemusNaming,
  killRecordedQemu,
  ownedByAnotherLiveAgent,
  pidAlive,
  pidGone,
  qemuPidsNaming,
  readOwner,
  recordedQemuPid,
  waitGone,
} from "./process.ts";
import { vmRecordsDir } from "./records-dir.ts";

/**
 * No QEMU here: a "QEMU" is bash run through a symlink named qemu-system-test (so its argv[0] is
 * a qemu-system-* program) with QEMU-like arguments after `-c 'read -r _'`, which it ignores
 * while it blocks reading a pipe nobody writes.
 */
const root = mkdtempSync(join(tmpdir(), "vm-process-test-"));
const fakeQemu = join(root, "bin", "qemu-system-test");
const notQemu = join(root, "bin", "not-an-emulator");
mkdirSync(join(root, "bin"));
symlinkSync("/bin/bash", fakeQemu);
symlinkSync("/bin/bash", notQemu);

const children: ChildProcess[] = [];
afterAll(() => {
  for (const c of children) c.kill("SIGKILL");
  rmSync(root, { recursive: true, force: true });
});

/** Starts a fake QEMU whose arguments name `dir` the way QEMU's do; resolves once it runs. */
async function startFake(dir: string, program = fakeQemu, script = "read -r _"): Promise<number> {
  const args = [
    "-c",
    script,
    "qemu",
    "-serial",
    `file:${dir}/console.log`,
    "-chardev",
    `socket,id=agent0,path=${dir}/agent.sock,server=on,wait=off`,
    "-qmp",
    `unix:${dir}/qmp.sock,server=on,wait=off`,
    "-pidfile",
    `${dir}/qemu.pid`,
  ];
  const child = spawn(program, args, { stdio: ["pipe", "ignore", "ignore"] });
  children.push(child);
  const pid = child.pid;
  if (pid === undefined) throw new Error("no pid");
  // Until exec completes, /proc shows the spawning runtime's argv.
  const exec = async () => (await readFile(`/proc/${pid}/cmdline`, "utf8").catch(() => "")).includes(dir);
  // Bounded at 10 s (a loaded host), and a start that never shows fails here, not later.
  for (let i = 0; i < 2000 && !(await exec()); i++) await Bun.sleep(5);
  if (!(await exec())) throw new Error(`the fake QEMU (pid ${pid}) did not start within 10 s`);
  return pid;
}

const vms = join(root, "vms");

describe("identity", () => {
  test("argvNamesDir matches <dir>/ at an argument's start or after = : , only", () => {
    const argv = (a: string) => ["qemu-system-x86_64", "-x", a];
    expect(argvNamesDir(argv("/x/sbx-1/qemu.pid"), "/x/sbx-1")).toBe(true);
    expect(argvNamesDir(argv("file:/x/sbx-1/console.log"), "/x/sbx-1")).toBe(true);
    expect(argvNamesDir(argv("socket,path=/x/sbx-1/a.sock"), "/x/sbx-1")).toBe(true);
    expect(argvNamesDir(argv("a,/x/sbx-1/b"), "/x/sbx-1/")).toBe(true);
    // Prefix and suffix confusion, and the directory itself without a path inside it.
    expect(argvNamesDir(argv("/x/sbx-12/qemu.pid"), "/x/sbx-1")).toBe(false);
    expect(argvNamesDir(argv("/y/x/sbx-1/qemu.pid"), "/x/sbx-1")).toBe(false);
    expect(argvNamesDir(argv("file:/y/x/sbx-1/c.log"), "/x/sbx-1")).toBe(false);
    expect(argvNamesDir(argv("/x/sbx-1"), "/x/sbx-1")).toBe(false);
    // argv[0] is the program, not an argument.
    expect(argvNamesDir(["/x/sbx-1/qemu-system-x86_64"], "/x/sbx-1")).toBe(false);
  });

  test("isQemuArgv looks at the program's name", () => {
    expect(isQemuArgv(["qemu-system-x86_64", "-M", "microvm"])).toBe(true);
    expect(isQemuArgv(["/usr/bin/qemu-system-aarch64"])).toBe(true);
    expect(isQemuArgv(["/usr/bin/setpriv", "qemu-system-x86_64"])).toBe(false);
    expect(isQemuArgv([])).toBe(false);
  });

  test("a running QEMU is the QEMU of its own dir, not of a dir whose name it extends", async () => {
    const pid = await startFake(join(vms, "sbx-12"));
    expect(await isQemuFor(pid, join(vms, "sbx-12"))).toBe(true);
    expect(await isQemuFor(pid, join(vms, "sbx-1"))).toBe(false);
    expect(await qemuPidsNaming([join(vms, "sbx-1")])).toEqual([]);
    expect(await qemuPidsNaming([vms])).toContain(pid);
    // Not ours: nothing is signalled.
    expect(await killQemu(pid, join(vms, "sbx-1"))).toBe(false);
    expect(pidGone(pid)).toBe(false);
    expect(await killQemu(pid, join(vms, "sbx-12"))).toBe(true);
  });

  test("a process that is not a qemu-system-* program is never a QEMU, whatever its arguments", async () => {
    const dir = join(vms, "not-qemu");
    const pid = await startFake(dir, notQemu);
    expect(await isQemuFor(pid, dir)).toBe(false);
    expect(await killQemu(pid, dir)).toBe(false);
    expect(pidAlive(pid)).toBe(true);
    process.kill(pid, "SIGKILL");
  });
});

describe("kill and wait", () => {
  test("SIGKILL reaches a QEMU that ignores SIGTERM; the call returns once it is gone", async () => {
    const dir = join(vms, "stubborn");
    const pid = await startFake(dir, fakeQemu, "trap '' TERM; read -r _");
    // Returned once it is gone (not after its wait ran out with the process still there).
    expect(await killQemu(pid, dir)).toBe(true);
    expect(pidGone(pid)).toBe(true);
    expect(await isQemuFor(pid, dir)).toBe(false);
  });

  test("a dead pid: not alive, not a QEMU, nothing to kill", async () => {
    const child = spawn("true");
    const pid = child.pid as number;
    await new Promise((r) => child.once("exit", r));
    expect(pidAlive(pid)).toBe(false);
    expect(pidGone(pid)).toBe(true);
    expect(await isQemuFor(pid, vms)).toBe(false);
    expect(await killQemu(pid, vms)).toBe(false);
    // 0 and negatives address process groups in kill(2): refused outright.
    expect(pidAlive(0)).toBe(false);
    expect(pidAlive(-1)).toBe(false);
    expect(await killQemu(-1, vms)).toBe(false);
  });

  test("a zombie counts as gone: it still answers kill(0), but it has exited", async () => {
    // The shell starts a short sleep, prints its pid, then becomes a long sleep that never
    // collects it: the short one stays a zombie until the long one is killed.
    const parent = spawn("/bin/sh", ["-c", "sleep 0.05 & echo $!; exec sleep 30"], {
      stdio: ["ignore", "pipe", "ignore"],
    });
    children.push(parent);
    const zombie = await new Promise<number>((resolve) =>
      parent.stdout?.once("data", (d: Buffer) => resolve(Number(d.toString().trim()))),
    );
    expect(await waitGone(zombie, 2_000)).toBe(true);
    expect(pidAlive(zombie)).toBe(true);
    expect(pidGone(zombie)).toBe(true);
    expect(await isQemuFor(zombie, vms)).toBe(false);
    parent.kill("SIGKILL");
  });

  test("killQemusNaming kills every QEMU under the given dirs and only those", async () => {
    const a = await startFake(join(root, "scratch-a", "vm"));
    const b = await startFake(join(root, "scratch-b", "vm"));
    const other = await startFake(join(root, "scratch-ab", "vm"));
    const killed = await killQemusNaming([join(root, "scratch-a"), join(root, "scratch-b")]);
    expect(killed.sort()).toEqual([a, b].sort());
    expect(pidGone(a) && pidGone(b)).toBe(true);
    expect(pidGone(other)).toBe(false);
    expect(await killQemu(other, join(root, "scratch-ab"))).toBe(true);
  });
});

describe("owner.json and the recorded pid", () => {
  test("the owner's qemuPid, else the pid file; garbage is no owner", async () => {
    const dir = join(vms, "owned");
    mkdirSync(dir, { recursive: true });
    expect(await readOwner(dir)).toBeUndefined();
    expect(await recordedQemuPid(dir)).toBeUndefined();
    writeFileSync(join(dir, "qemu.hostpid"), "4242\n");
    expect(await recordedQemuPid(dir)).toBe(4242);
    await claimVm(dir, 4343);
    expect(await readOwner(dir)).toMatchObject({ ownerPid: process.pid, qemuPid: 4343 });
    expect(await recordedQemuPid(dir)).toBe(4343);
    expect(ownedByAnotherLiveAgent(await readOwner(dir))).toBe(false);
    // The record is the agent's, out of the VM directory (which the VM's jail writes): one there
    // is not read.
    expect(existsSync(join(dir, "owner.json"))).toBe(false);
    writeFileSync(join(dir, "owner.json"), JSON.stringify({ ownerPid: 1, qemuPid: 1 }));
    expect(await readOwner(dir)).toMatchObject({ ownerPid: process.pid, qemuPid: 4343 });
    // A record of a dead agent, and records that name no pid we could trust.
    const owner = join(vmRecordsDir(dir), "owner.json");
    writeFileSync(owner, JSON.stringify({ ownerPid: 999_999_999 }));
    expect(ownedByAnotherLiveAgent(await readOwner(dir))).toBe(false);
    writeFileSync(owner, JSON.stringify({ ownerPid: 0, qemuPid: -1 }));
    expect(await readOwner(dir)).toBeUndefined();
    writeFileSync(owner, '{"ownerPid":');
    expect(await readOwner(dir)).toBeUndefined();
    writeFileSync(join(dir, "qemu.hostpid"), "12abc");
    expect(await recordedQemuPid(dir)).toBeUndefined();
  });

  test("killRecordedQemu kills the QEMU the pid file names, and not a stranger it names", async () => {
    const dir = join(vms, "recorded");
    mkdirSync(dir, { recursive: true });
    const pid = await startFake(dir);
    writeFileSync(join(dir, "qemu.hostpid"), `${process.pid}\n`);
    expect(await killRecordedQemu(dir)).toBe(false);
    writeFileSync(join(dir, "qemu.hostpid"), `${pid}\n`);
    expect(await killRecordedQemu(dir)).toBe(true);
    expect(pidGone(pid)).toBe(true);
  });
});

describe("adoptQemu", () => {
  const GREETING =
    '{"QMP":{"version":{"qemu":{"major":7,"minor":2,"micro":0},"package":"fake"},"capabilities":[]}}\r\n';

  /** A QMP peer at `<dir>/qmp.sock` that answers every command with an empty return. */
  function fakeQmp(dir: string): Promise<{ server: Server; sockets: Socket[] }> {
    const sockets: Socket[] = [];
    const server = createServer((sock) => {
      sockets.push(sock);
      sock.on("error", () => {});
      sock.write(GREETING);
      let buf = "";
      sock.on("data", (d) => {
        buf += d.toString();
        for (let nl = buf.indexOf("\n"); nl >= 0; nl = buf.indexOf("\n")) {
          const cmd = JSON.parse(buf.slice(0, nl)) as { id?: unknown };
          buf = buf.slice(nl + 1);
          sock.write(`${JSON.stringify({ return: {}, id: cmd.id })}\r\n`);
        }
      });
    });
    return new Promise((r) => server.listen(join(dir, "qmp.sock"), () => r({ server, sockets })));
  }

  test("takes over a running QEMU; kill() ends it and removes its sockets and pid file", async () => {
    const dir = join(vms, "adopt-kill");
    mkdirSync(dir, { recursive: true });
    const pid = await startFake(dir);
    writeFileSync(join(dir, "qemu.pid"), `${pid}\n`);
    const { server } = await fakeQmp(dir);
    const proc = await adoptQemu(pid, dir);
    expect(proc.pid).toBe(pid);
    expect(proc.agentSocket).toBe(join(dir, "agent.sock"));
    expect(proc.isAlive()).toBe(true);
    await proc.kill();
    expect(pidGone(pid)).toBe(true);
    expect(proc.isAlive()).toBe(false);
    expect(await proc.exited).toEqual({ code: null, signal: null });
    expect(existsSync(join(dir, "qemu.pid"))).toBe(false);
    expect(existsSync(join(dir, "qmp.sock"))).toBe(false);
    server.close();
  });

  test("its death (QMP hang-up, pid gone) resolves `exited`", async () => {
    const dir = join(vms, "adopt-dies");
    mkdirSync(dir, { recursive: true });
    const pid = await startFake(dir);
    const { server, sockets } = await fakeQmp(dir);
    const proc = await adoptQemu(pid, dir);
    process.kill(pid, "SIGKILL");
    for (const s of sockets) s.destroy();
    expect(await proc.exited).toEqual({ code: null, signal: null });
    expect(proc.isAlive()).toBe(false);
    server.close();
  });

  test("a pid that is not the QEMU of the dir is vm_lost", async () => {
    const dir = join(vms, "adopt-wrong");
    const pid = await startFake(join(vms, "adopt-wrong-2"));
    const err = (await adoptQemu(pid, dir).catch((e: unknown) => e)) as SandboxdError;
    expect(err.code).toBe("vm_lost");
    expect(err.message).toBe(`QEMU pid ${pid} is not running`);
    expect(pidGone(pid)).toBe(false);
    await killQemu(pid, join(vms, "adopt-wrong-2"));
  });
});
