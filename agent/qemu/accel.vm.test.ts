/**
 * The KVM boot probe against a real QEMU and guest (full tier: it needs the guest artifacts and
 * boots a VM). The probe's decisions without a VM are in accel.test.ts.
 */
import { describe, expect, test } from "bun:test";
import { existsSync } from "node:fs";
import { join, resolve } from "node:path";
import { ensureGuestArtifacts } from "../guest/artifacts.ts";
import { probeKvmBoot } from "./accel.ts";

/** Artifacts may need building on a first run (kernel download ~3 s); the probe itself is 3 s max. */
const PROBE_TEST_TIMEOUT_MS = 120_000;

// On the kvm_pvm CI hosts, /dev/kvm opens but guests cannot run: the boot probe must say so.
// (With -cpu host QEMU aborts at once: "failed to set MSR 0x10a".)
describe.skipIf(!existsSync("/sys/module/kvm_pvm"))("probeKvmBoot on a kvm_pvm host", () => {
  test(
    "reports failure instead of hanging",
    async () => {
      const artifacts = await ensureGuestArtifacts({
        dataDir:
          process.env.SANDBOXD_TEST_DATA ?? join(resolve(import.meta.dir, "..", ".."), ".data", "test"),
      });
      const r = await probeKvmBoot(artifacts, 3000);
      expect(r.ok).toBe(false);
    },
    PROBE_TEST_TIMEOUT_MS,
  );
});
