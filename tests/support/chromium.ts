/**
 * Debian's Chromium on the host, for the suites that drive a browser (the web console, a CDP
 * tunnel). Test code only.
 */

export const CHROMIUM_PATH = "/usr/bin/chromium";

/**
 * The flags every host Chromium starts with. The test machines have no GPU and reach no network
 * beyond loopback: without the QUIC, background-networking, component-update and sync switches
 * Chromium keeps opening connections that the closed network refuses, and looks up Google's hosts
 * at every start.
 */
export const CHROMIUM_FLAGS = [
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
];
