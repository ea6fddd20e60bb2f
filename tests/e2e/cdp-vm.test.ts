/**
 * End to end over real HTTP, connect-from-outside with the `cdp` relay (docs/connect.md "Rules of connect URLs"; docs/sandboxes.md "Rules of the sandboxes API"): a real
 * CDP client (Playwright's `chromium.connectOverCDP`) drives a Chromium running INSIDE a sandbox
 * (a QEMU microVM under TCG), through the real service (`bin/sandboxd up`), the gateway's relay
 * and the agent's tunnels into the guest. The page it opens is served inside the sandbox too.
 *
 * The image (Debian bookworm + chromium + python3, tests/support/chromium-image.ts) is built once
 * by debootstrap into the shared test data dir and uploaded as a sessions API template sized for a
 * browser (`mem_mib`); a Pro key of the same tenant creates the sandbox and connects. Chromium is
 * started by an exec in the sandbox (it outlives the exec), then the test connects, reads the
 * page's title, deletes the sandbox and sees the relay close. Figures are printed as JSON.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { spawnSync } from "node:child_process";
import { mkdtemp, readFile, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import * as B from "../../contracts/api/sandboxes-api.ts";
import * as A from "../../contracts/api/sessions-api.ts";
import { CDP_PORT, ensureChromiumLayout, PAGE_PORT } from "../support/chromium-image.ts";
import { expectOk, SHARED_DATA_DIR } from "../support/e2e-service.ts";
import { useService } from "../support/service.ts";

/** The image build (debootstrap of chromium and its libraries: ~90 s on a fresh machine, cached after). */
const SETUP_TIMEOUT_MS = 420_000;
/** Upload (~850 MB on loopback, ~12 s), import (unpack + mkfs.ext4), one boot, the snapshot: ~40 s. */
const TEMPLATE_TIMEOUT_MS = 240_000;
/**
 * Chromium's first start in a 1 GiB, 2-vCPU guest under TCG, to its first DevTools answer: ~17 s
 * on the 2-core CI host; the bound leaves room for a loaded one.
 */
const CHROMIUM_START_S = 180;
const TEST_TIMEOUT_MS = 480_000;
/** What a browser needs: 256 MiB (the default) is not enough for Chromium's processes. */
const MEM_MIB = 1024;
const VCPUS = 2;
const TEMPLATE = "chromium-vm";
const TITLE = "served inside the sandbox";

let work = "";
let archive = "";
const figures: Record<string, number> = {};

afterAll(async () => {
  if (work) await rm(work, { recursive: true, force: true });
  console.log(JSON.stringify({ cdp_vm_figures: figures }));
});

// No catalog: the python template build would compete with Chromium for the host's two cores.
const fx = useService({ python: false, keys: { scale: ["acme", "scale"], pro: ["acme", "pro"] } });

// Before the fixture stops `up`: the template goes while `up` still runs.
fx.beforeStop(async () => {
  if (keys) await fx.api.delete(`/v1/templates/${TEMPLATE}`, { key: keys.scale });
});

let keys: Record<"scale" | "pro", string>;
const service = () => fx.svc;
const api = () => service().api;
const ms = (t0: number) => Math.round(performance.now() - t0);

beforeAll(async () => {
  keys = fx.keys;
  const t0 = performance.now();
  const layout = await ensureChromiumLayout(join(SHARED_DATA_DIR, "debootstrap"));
  figures.image_ms = ms(t0);
  // The upload takes an archive: an OCI layout tarred is an `oci-archive`.
  work = await mkdtemp(join(tmpdir(), "sbx-cdp-vm-"));
  archive = join(work, "chromium.tar");
  const tar = spawnSync("tar", ["-C", layout, "-cf", archive, "oci-layout", "index.json", "blobs"], {
    encoding: "utf8",
  });
  if (tar.status !== 0) throw new Error(`tar failed: ${tar.stderr}`);
}, SETUP_TIMEOUT_MS);

/**
 * Run in the sandbox: write the page, start its server and Chromium detached (setsid, output to
 * files: they outlive this exec), then block until DevTools and the page answer (the ready-command
 * contract of docs/templates.md "Rules of templates") and print how long Chromium took. Chromium's flags: headless, as root
 * without its setuid sandbox, no GPU, nothing that reaches the network, a fresh profile;
 * DevTools listens on the guest's 127.0.0.1, where the agent's tunnel connects.
 */
const START = `
set -e
mkdir -p /srv/page && cd /srv/page
printf '<!doctype html><title>${TITLE}</title><p>hello from the guest</p>\\n' > index.html
setsid python3 -m http.server ${PAGE_PORT} --bind 127.0.0.1 >/tmp/page.log 2>&1 </dev/null &
t0=$(date +%s%N)
setsid chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \\
  --disable-background-networking --disable-component-update --disable-sync \\
  --remote-debugging-port=${CDP_PORT} --user-data-dir=/tmp/chromium-profile about:blank \\
  >/tmp/chromium.log 2>&1 </dev/null &
python3 - <<'EOF'
import sys, time, urllib.request
deadline = time.monotonic() + ${CHROMIUM_START_S - 10}
for url in ("http://127.0.0.1:${CDP_PORT}/json/version", "http://127.0.0.1:${PAGE_PORT}/"):
    while True:
        try:
            urllib.request.urlopen(url, timeout=5).read()
            break
        except OSError:
            if time.monotonic() > deadline:
                sys.exit("no answer from " + url + "\\n" + open("/tmp/chromium.log").read()[-3000:])
            time.sleep(0.5)
EOF
t1=$(date +%s%N)
echo "chromium_start_ms=$(( (t1 - t0) / 1000000 ))"
`;

describe("CDP into a VM", () => {
  test(
    "connectOverCDP drives Chromium inside a sandbox: a page served in the guest, its title; delete closes the relay",
    async () => {
      // A sessions API template sized for a browser (the sandboxes API bake has no size option).
      let t0 = performance.now();
      const body = new Uint8Array(await readFile(archive));
      const reg = await api().post("/v1/templates", {
        key: keys.scale,
        query: { id: TEMPLATE, mem_mib: String(MEM_MIB), vcpu_count: String(VCPUS) },
        raw: body,
        headers: { "content-type": "application/octet-stream" },
        timeoutMs: TEMPLATE_TIMEOUT_MS,
      });
      expect(expectOk(reg, 202, A.RegisterTemplateResponse)).toEqual({ id: TEMPLATE, status: "building" });
      figures.upload_ms = ms(t0);
      figures.upload_mb = Math.round(body.length / 2 ** 20);
      let t: A.TemplateA = { id: TEMPLATE, status: "building" };
      const deadline = performance.now() + TEMPLATE_TIMEOUT_MS;
      while (t.status === "building" && performance.now() < deadline) {
        await Bun.sleep(500);
        t = expectOk(await api().get(`/v1/templates/${TEMPLATE}`, { key: keys.scale }), 200, A.TemplateA);
      }
      if (t.status !== "ready") throw new Error(`template: ${JSON.stringify(t)}\n${service().logTail()}`);
      figures.template_ms = ms(t0);

      // The sandbox reports the image's ExposedPorts as its endpoints (what connect checks).
      t0 = performance.now();
      const created = expectOk(
        await api().post("/v1/sandboxes", { key: keys.pro, json: { template: TEMPLATE } }),
        201,
        B.CreateSandboxResponse,
      );
      figures.create_ms = ms(t0);
      const id = created.id;
      expect(Object.keys(created.endpoints ?? {}).sort()).toEqual([String(PAGE_PORT), String(CDP_PORT)]);
      try {
        t0 = performance.now();
        const started = expectOk(
          await api().post(`/v1/sandboxes/${id}/exec`, {
            key: keys.pro,
            json: { command: START, timeout_seconds: CHROMIUM_START_S },
            timeoutMs: (CHROMIUM_START_S + 30) * 1000,
          }),
          200,
          B.ExecResponseB,
        );
        figures.start_exec_ms = ms(t0);
        if (started.exit_code !== 0) {
          throw new Error(`start failed (${started.exit_code}): ${started.stdout}\n${started.stderr}`);
        }
        figures.chromium_start_in_vm_ms = Number(/chromium_start_ms=(\d+)/.exec(started.stdout)?.[1]);

        // No --public-url: the minted URL follows the request (plain ws on loopback), used as issued.
        const minted = expectOk(
          await api().post(`/v1/sandboxes/${id}/connect-url`, {
            key: keys.pro,
            json: { port: CDP_PORT, protocol: "cdp", ttl_seconds: 600 },
          }),
          200,
          B.ConnectUrlResponse,
        );
        const u = new URL(minted.url);
        expect(u.searchParams.get("protocol")).toBe("cdp");
        const url = minted.url;
        expect(url).toStartWith(`${service().url.replace(/^http:/, "ws:")}/v1/sandboxes/${id}/connect?`);

        const { chromium } = await import("playwright-core");
        t0 = performance.now();
        const browser = await chromium.connectOverCDP(url, { timeout: 120_000 });
        figures.connect_over_cdp_ms = ms(t0);
        const disconnected = new Promise<void>((resolve) => browser.once("disconnected", () => resolve()));
        const context = browser.contexts()[0] ?? (await browser.newContext());
        t0 = performance.now();
        const page = await context.newPage();
        figures.new_page_ms = ms(t0);
        t0 = performance.now();
        // 127.0.0.1 is the guest's: the browser and the page server both run in the sandbox.
        await page.goto(`http://127.0.0.1:${PAGE_PORT}/`, { timeout: 120_000 });
        figures.page_load_ms = ms(t0);
        expect(await page.title()).toBe(TITLE);
        expect(await page.textContent("p")).toBe("hello from the guest");

        // Deleting the sandbox closes its open relays (1001): the CDP client sees the disconnect.
        t0 = performance.now();
        expectOk(await api().delete(`/v1/sandboxes/${id}`, { key: keys.pro }), 200, B.DeleteSandboxResponse);
        const closedInTime = await Promise.race([
          disconnected.then(() => true),
          Bun.sleep(30_000).then(() => false),
        ]);
        figures.relay_closed_after_delete_ms = ms(t0);
        expect(closedInTime).toBe(true);
        expect(browser.isConnected()).toBe(false);
      } finally {
        await api()
          .delete(`/v1/sandboxes/${id}`, { key: keys.pro })
          .catch(() => undefined);
      }
      // The template can go once its sandbox is gone (sessions API delete: 204).
      expect((await api().delete(`/v1/templates/${TEMPLATE}`, { key: keys.scale })).status).toBe(204);
    },
    TEST_TIMEOUT_MS,
  );
});
