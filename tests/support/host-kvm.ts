/**
 * Whether this host's KVM can make the vCPU our KVM VMs use (`-cpu host`), asked of an unjailed,
 * paused QEMU. On some kvm_pvm hosts (an AMD EPYC one) QEMU itself aborts setting MSR 0x10a
 * (IA32_ARCH_CAPABILITIES), jail or not: there, a jail has no KVM to grant, and `sandboxd doctor`
 * says so as a warning.
 */
import { spawnSync } from "node:child_process";
import { existsSync } from "node:fs";
import { machineArgs } from "../../agent/qemu/args.ts";
import { QEMU_BINARY } from "../../agent/qemu/launch.ts";

export const HOST_KVM = "/dev/kvm";
/** A paused QEMU that is still there after this long made its vCPU (an abort comes at once). */
const KVM_INIT_WINDOW_MS = 2_000;

let known: boolean | undefined;

export function hostKvmInitializes(): boolean {
  known ??= probe();
  return known;
}

function probe(): boolean {
  if (!existsSync(HOST_KVM)) return false;
  const r = spawnSync(QEMU_BINARY, [...machineArgs("kvm", 32), "-S"], {
    timeout: KVM_INIT_WINDOW_MS,
    stdio: "ignore",
  });
  // Killed by the window: it was running, paused, with its vCPU made.
  return r.signal === "SIGTERM" && r.status === null;
}
