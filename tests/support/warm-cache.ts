/**
 * Builds the shared test cache once, before the VM and end-to-end files start (the runner runs
 * this first, cli/testing/run.ts): the guest artifacts (kernel, initramfs) and the catalog images,
 * python and base (debootstrap, then the import). Files that start at once would otherwise each build them
 * in the same directory, side by side, on a clean clone. Later runs find them and return at once.
 */
import { ensureCatalogImage } from "../../agent/catalog/python.ts";
import { ensureGuestArtifacts } from "../../agent/guest/artifacts.ts";
import { ALL_CATALOG, SHARED_DATA_DIR } from "./e2e-service.ts";

const t0 = performance.now();
const log = (m: string) => process.stdout.write(`${m}\n`);
await ensureGuestArtifacts({ dataDir: SHARED_DATA_DIR, log });
const digests: string[] = [];
for (const id of ALL_CATALOG) {
  const image = await ensureCatalogImage(id, {
    dataDir: SHARED_DATA_DIR,
    log,
    ...(process.env.SANDBOXD_DEBIAN_MIRROR ? { mirror: process.env.SANDBOXD_DEBIAN_MIRROR } : {}),
  });
  digests.push(`${id} ${image.digest}`);
}
log(
  `shared test cache ready in ${SHARED_DATA_DIR} (images: ${digests.join(", ")}), ${Math.round(performance.now() - t0)} ms`,
);
