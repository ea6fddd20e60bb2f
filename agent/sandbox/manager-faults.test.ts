/**
 * The manager after a failed teardown, with a driver that stands in for the VM layer (no QEMU):
 * a destroy that fails (a full disk while freeing the VM's files) leaves the sandbox known and
 * `destroying`, the failure reaches the caller, and the next destroy does the work again instead
 * of answering the old failure for ever; then nothing of the sandbox is left in the manager.
 */
import { afterEach, expect, test } from "bun:test";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { SandboxdError } from "../../contracts/errors.ts";
import type { DriverVm, PreparedTemplate, SandboxDriver, VmSize } from "./drivers/driver.ts";
import { SandboxManager } from "./manager.ts";

const dirs: string[] = [];
afterEach(async () => {
  for (const d of dirs.splice(0)) await rm(d, { recursive: true, force: true });
});

function fakeDriver() {
  const state = { destroyFailures: 1, destroys: 0 };
  const driver = {
    name: "fake",
    accel: "tcg",
    onGuestTunnel: () => {},
    prepareTemplate: async (): Promise<PreparedTemplate> => ({
      image: { env: [], workingDir: "/", user: { uid: 0, gid: 0 }, exposedPorts: [] } as never,
      exposedPorts: [],
    }),
    dropTemplate: async () => {},
    restoreTemplate: async () => {},
    spawn: async (templateId: string, vmId: string, size: VmSize): Promise<DriverVm> => ({
      vmId,
      templateId,
      size,
      image: {} as never,
      qemuPid: 0,
      dir: "/nonexistent",
      spawnMs: 1,
      guest: { onClose: () => {}, close: () => {} } as never,
    }),
    destroy: async () => {
      state.destroys++;
      if (state.destroyFailures-- > 0) throw new SandboxdError("internal", "ENOSPC: no space left on device");
    },
    onExit: () => {},
    diskBytes: async () => 0,
    pause: async () => {},
    unpause: async () => {},
    reap: async () => [],
    detach: () => {},
  } as unknown as SandboxDriver;
  return { driver, state };
}

test("a failed destroy is retried by the next one, which frees the sandbox", async () => {
  const dir = await mkdtemp(join(tmpdir(), "sbx-mgr-"));
  dirs.push(dir);
  const { driver, state } = fakeDriver();
  const m = await SandboxManager.open({ driver, stateDir: dir, idlePauseMs: 60_000 });
  try {
    m.buildTemplate("t", { kind: "archive", path: "/nonexistent" });
    await m.templates.settled("t");
    const free = m.capacityNow().slotsFree;
    const vm = await m.create("t", { kind: "sandbox" });
    const first = await m.destroy(vm.vmId, { force: true }).catch((e) => e);
    expect(first).toBeInstanceOf(SandboxdError);
    expect((first as Error).message).toContain("ENOSPC");
    expect(m.capacityNow().slotsFree).toBe(free - 1); // still held
    await m.destroy(vm.vmId, { force: true });
    expect(state.destroys).toBe(2);
    expect(m.capacityNow().slotsFree).toBe(free);
    await expect(m.exec(vm.vmId, { run: { kind: "none" } } as never)).rejects.toMatchObject({
      code: "not_found",
    });
  } finally {
    await m.detach();
  }
});

test("a fork's children are counted from their admission: a create racing the fork is refused, not promised the same room", async () => {
  const dir = await mkdtemp(join(tmpdir(), "sbx-mgr-"));
  dirs.push(dir);
  const { driver } = fakeDriver();
  let release!: () => void;
  const gate = new Promise<void>((r) => {
    release = r;
  });
  (driver as unknown as { fork: SandboxDriver["fork"] }).fork = async (parent, ids) => {
    await gate;
    return Promise.all(ids.map((id) => driver.spawn(parent.templateId, id, parent.size)));
  };
  const m = await SandboxManager.open({ driver, stateDir: dir, idlePauseMs: 60_000, capacity: { slots: 2 } });
  try {
    m.buildTemplate("t", { kind: "archive", path: "/nonexistent" });
    await m.templates.settled("t");
    const parent = await m.create("t", { kind: "sandbox" });
    const fork = m.fork(parent.vmId, 1);
    const racing = await m.create("t", { kind: "sandbox" }).catch((e) => e);
    expect(racing).toMatchObject({ code: "at_capacity" });
    release();
    expect(await fork).toHaveLength(1);
    expect(m.capacityNow().slotsFree).toBe(0);
  } finally {
    await m.detach();
  }
});

test("a create whose spawn fails and whose cleanup destroy fails too says so in the log (the VM may be left)", async () => {
  const dir = await mkdtemp(join(tmpdir(), "sbx-mgr-"));
  dirs.push(dir);
  const { driver, state } = fakeDriver();
  (driver as unknown as { spawn: SandboxDriver["spawn"] }).spawn = async () => {
    throw new SandboxdError("vm_launch_failed", "QEMU exited at start");
  };
  const lines: string[] = [];
  const m = await SandboxManager.open({
    driver,
    stateDir: dir,
    idlePauseMs: 60_000,
    log: (l) => lines.push(l),
  });
  try {
    m.buildTemplate("t", { kind: "archive", path: "/nonexistent" });
    await m.templates.settled("t");
    const err = await m.create("t", { kind: "sandbox" }).catch((e) => e);
    expect(err).toMatchObject({ code: "vm_launch_failed" });
    expect(state.destroys).toBe(1);
    const said = lines.filter((l) => l.includes("after its failed create failed"));
    expect(said).toHaveLength(1);
    expect(said[0]).toContain("ENOSPC");
  } finally {
    await m.detach();
  }
});
