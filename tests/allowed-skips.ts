/**
 * The skips `sandboxd test` accepts (cli/testing/run.ts): any other skipped test fails the run.
 * Each entry names the file, the start of the test's full name as bun prints it (`describe >
 * test`), and why it may skip.
 *
 * Short on purpose: what a test needs that a package gives (PostgreSQL, docker-registry, skopeo,
 * debootstrap, Chromium, Node >= 20) `bin/sandboxd test` installs, so a test skipped for lack of
 * it is a broken install and fails the run. What is left depends on the host itself: root, and
 * the kvm_pvm module. CI's machines (root, TCG on a kvm_pvm host) skip none of these.
 */
import type { AllowedSkip } from "../cli/testing/plan.ts";

const NO_ROOT =
  "needs root (uid and gid changes, loop devices, mounts): skipped when the suite runs as a user";

export const ALLOWED_SKIPS: AllowedSkip[] = [
  { file: "agent/guest/agent.test.ts", test: "exec > uid and gid are applied (as root)", reason: NO_ROOT },
  {
    file: "agent/guest/agent.test.ts",
    test: "files and small ops > writeFile with uid and gid makes a file of that owner (as root)",
    reason: NO_ROOT,
  },
  { file: "agent/catalog/python.test.ts", test: "an aborted debootstrap is killed", reason: NO_ROOT },
  { file: "tests/vm/disk-full.test.ts", test: "a full disk refuses suspends and builds", reason: NO_ROOT },
  { file: "tests/vm/shm-full.test.ts", test: "a fork the tmpfs cannot hold", reason: NO_ROOT },
  {
    file: "agent/qemu/accel.vm.test.ts",
    test: "probeKvmBoot on a kvm_pvm host",
    reason:
      "runs only where the kvm_pvm module is loaded (as on the CI hosts): elsewhere there is no such probe to check",
  },
  {
    file: "tests/vm/jail-kvm.test.ts",
    test: "KVM in the jail >",
    reason:
      "runs only where the host's KVM initializes a `-cpu host` vCPU outside any jail (a /dev/kvm, and no QEMU abort setting an MSR as on some kvm_pvm hosts): elsewhere there is no KVM for the jail to grant",
  },
];
