/**
 * A Debian bookworm image with Chromium and python3, for driving a browser INSIDE a sandbox
 * (tests/e2e/cdp-vm.test.ts). Built like the catalog's python image (debootstrap from the
 * host's Debian mirror into an OCI layout, agent/catalog/python.ts) and cached in the shared test
 * data dir, so a CI run builds it once. Test code only: the public catalog ships python alone.
 */
import { type DebootstrapImageSpec, ensureDebootstrapLayout } from "../../agent/catalog/python.ts";

/** Guest port of Chromium's DevTools (`--remote-debugging-port`). */
export const CDP_PORT = 9222;
/** Guest port of the page server (`python3 -m http.server`). */
export const PAGE_PORT = 8000;

/** Inputs of the build; any change gives a new cache key and a rebuild. */
export const CHROMIUM_IMAGE: DebootstrapImageSpec = {
  suite: "bookworm",
  variant: "minbase",
  // debootstrap resolves Depends (not Recommends), but not an alternative that only virtual
  // packages satisfy: dconf-service (via GTK) needs `dbus-session-bus`, which dbus-x11 provides.
  // No fonts: a page's title needs none, and Chromium starts without any.
  packages: ["chromium", "dbus-x11", "python3"],
  config: {
    Env: ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8", "HOME=/root"],
    WorkingDir: "/root",
    // The sessions API templates report the image's ExposedPorts as the sandbox's endpoints (what
    // connect checks), as a bake's ready.ports would.
    ExposedPorts: { [`${CDP_PORT}/tcp`]: {}, [`${PAGE_PORT}/tcp`]: {} },
    Cmd: ["/bin/sh"],
  },
  scriptVersion: 1,
};

/**
 * Builds (once, a few minutes on a fresh machine) the image's OCI layout under `dir` and returns
 * its directory. Kept apart from a data dir's `catalog/`, which every e2e suite copies.
 */
export function ensureChromiumLayout(dir: string, log?: (m: string) => void): Promise<string> {
  return ensureDebootstrapLayout({
    dir,
    name: "chromium",
    spec: CHROMIUM_IMAGE,
    ...(log ? { log } : {}),
    ...(process.env.SANDBOXD_DEBIAN_MIRROR ? { mirror: process.env.SANDBOXD_DEBIAN_MIRROR } : {}),
  });
}
