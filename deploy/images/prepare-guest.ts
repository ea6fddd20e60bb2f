/**
 * Run inside the agent image's build stage (deploy/images/Containerfile.agent), bundled by
 * deploy/images/build.sh: builds what the agent would otherwise build on its first start, so the
 * image carries it and a new agent needs neither a compiler nor a Debian mirror:
 * - the static guest agent (`make -C guest`, musl) and from it, with the pinned Debian cloud kernel
 *   (`apt-get download`, checksum checked), the guest artifacts in `<seed>/guest/` (copied into
 *   the agent's data volume at start by the image's entry point);
 * - the jail's RAM-file shim (gcc, against the glibc of the image's own QEMU) in `build/host/`.
 *
 * usage: bun prepare-guest.js SEED_DIR
 */
import { ensureGuestArtifacts } from "../../agent/guest/artifacts.ts";
import { ensureRamShim } from "../../agent/qemu/ram-shim.ts";

const seed = process.argv[2];
if (!seed) {
  process.stderr.write("usage: prepare-guest.js SEED_DIR\n");
  process.exit(2);
}
const log = (m: string) => process.stdout.write(`${m}\n`);
const shim = await ensureRamShim();
log(`ram shim: ${shim}`);
const a = await ensureGuestArtifacts({ dataDir: seed, log });
log(`guest artifacts: kernel ${a.kernelVersion}, initramfs ${a.key}`);
