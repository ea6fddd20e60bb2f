/**
 * The warm pool with a stand-in driver whose restores the test releases one at a time: a create
 * that finds the pool's VM still being warmed takes that VM instead of racing it with a restore
 * of its own, and only one create waits for each VM in flight.
 */
import { expect, test } from "bun:test";
import { SandboxdError } from "../../contracts/errors.ts";
import type { DriverVm, SandboxDriver, VmSize } from "./drivers/driver.ts";
import type { TemplateRegistry } from "./templates.ts";
import { WarmPool } from "./warm-pool.ts";

const SIZE: VmSize = { vcpus: 1, memMib: 256 } as VmSize;

function gatedPool() {
  const gates: { vmId: string; open: (ok: boolean) => void }[] = [];
  const unpaused: string[] = [];
  const driver = {
    spawn: (_t: string, vmId: string) =>
      new Promise<DriverVm>((resolve, reject) => {
        gates.push({
          vmId,
          open: (ok) =>
            ok ? resolve({ vmId } as DriverVm) : reject(new SandboxdError("spawn_failed", "no")),
        });
      }),
    pause: async () => {},
    unpause: async (vm: DriverVm) => {
      unpaused.push(vm.vmId);
    },
    destroy: async () => {},
  } as unknown as SandboxDriver;
  const templates = {
    status: () => ({}),
    settled: async () => {},
    ready: () => {},
  } as unknown as TemplateRegistry;
  const pool = new WarmPool({ driver, templates, admit: () => () => {}, sizeOf: () => SIZE, log: () => {} });
  /** Waits until `n` restores have been asked for (the pool fills in the background). */
  const asked = async (n: number) => {
    for (let i = 0; i < 1000 && gates.length < n; i++) await Bun.sleep(1);
    expect(gates.length).toBe(n);
  };
  return { pool, gates, unpaused, asked };
}

test("a create that finds the pool's VM still being warmed takes that VM, no second restore", async () => {
  const { pool, gates, unpaused, asked } = gatedPool();
  pool.expect("t", 1);
  await asked(1);
  const taking = pool.take("t");
  gates[0]!.open(true);
  const vm = await taking;
  expect(vm?.vmId).toBe(gates[0]!.vmId);
  expect(unpaused).toEqual([gates[0]!.vmId]);
  // The pool refills behind it: the only other restore is that refill.
  await asked(2);
  await pool.close();
});

test("only one create waits for each VM in flight: the next one is not queued behind the refill", async () => {
  const { pool, gates, asked } = gatedPool();
  pool.expect("t", 1);
  await asked(1);
  const first = pool.take("t");
  // One VM in flight, claimed by the first create: the second gets none at once.
  expect(await pool.take("t")).toBeUndefined();
  gates[0]!.open(true);
  expect((await first)?.vmId).toBe(gates[0]!.vmId);
  await pool.close();
});

test("a restore that fails leaves the waiting create with none (it restores its own)", async () => {
  const { pool, gates, asked } = gatedPool();
  pool.expect("t", 1);
  await asked(1);
  const taking = pool.take("t");
  gates[0]!.open(false);
  expect(await taking).toBeUndefined();
  await pool.close();
});
