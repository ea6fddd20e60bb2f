/**
 * Builds the shared test cache once, before the VM and end-to-end files start (the runner runs
 * this first, cli/testing/run.ts): the guest artifacts (kernel, initramfs) and the python catalog
 * image (debootstrap, then its import). Files that start at once would otherwise each build them
 * in the same directory, side by side, on a clean clone. Later runs find them and return at once.
 */
import { ensurePythonImage } from "../../agent/catalog/python.ts";
import { ensureGuestArtifacts } from "../../agent/guest/artifacts.ts";
import { SHARED_DATA_DIR } from "./e2e-service.ts";

const t0 = performance.now();
const log = (m: string) => process.stdout.write(`${m}\n`);
await ensureGuestArtifacts({ dataDir: SHARED_DATA_DIR, log });
const python = await ensurePythonImage({
  dataDir: SHARED_DATA_DIR,
  log,
  ...(process.env.SANDBOXD_DEBIAN_MIRROR ? { mirror: process.env.SANDBOXD_DEBIAN_MIRROR } : {}),
});
log(
  `shared test cache ready in ${SHARED_DATA_DIR} (python image ${python.digest}), ${Math.round(performance.now() - t0)} ms`,
);
